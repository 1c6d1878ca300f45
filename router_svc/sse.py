"""Server-sent events: `data: {json}` lines ending with `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from aiohttp import web

from protos import pdflash_pb2 as pb
from router_svc.errors import ApiError, internal

log = logging.getLogger("router_svc")

Events = Callable[[pb.GenerateChunk], list[dict]]  # the events one chunk turns into


async def stream(request: web.Request, chunks: AsyncIterator[pb.GenerateChunk], events: Events
                 ) -> web.StreamResponse:
    """Headers go out with the first chunk, so an error before it (no free pages, P down, a
    timeout) is still a plain HTTP error with its status; after it, it is an SSE error event."""
    async with aclosing(chunks):
        first = await anext(chunks)  # ApiError here -> the caller's error response
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await _send(resp, events(first))
            async for chunk in chunks:
                await _send(resp, events(chunk))
        except ApiError as e:
            await _send(resp, [e.body()])
        except (ConnectionError, web.HTTPException):
            raise  # the client is gone: closing `chunks` aborts the request
        except Exception:
            log.exception("streaming failed")
            await _send(resp, [internal().body()])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _send(resp: web.StreamResponse, events: list[dict]) -> None:
    for event in events:
        await resp.write(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
