"""EngineLoop: the engine's thread and the asyncio services that talk to it."""
from __future__ import annotations

import asyncio
import time

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.service.engine_loop import EngineLoop


def test_stop_lets_a_cancelled_handler_return_its_pages(embedded_runner, embedded_tokenizer):
    """A service stopping while a request's handler has just been cancelled (its client, the
    router, stopped first) still gets that request's pages back: the handler's clean-up goes
    through the engine thread, which stop() keeps until the handler has ended."""
    pool = embedded_runner.pool
    free = pool.num_free

    async def scenario() -> asyncio.Task:
        loop = EngineLoop(Engine(embedded_runner, embedded_tokenizer.eos_token_ids), asyncio.get_running_loop())
        loop.start()
        req = Request("r", list(range(100, 140)), SamplingParams(max_new_tokens=4000, ignore_eos=True))
        decoding = asyncio.Event()

        async def handler() -> None:  # the shape of the services' Generate and Prefill
            outputs = loop.open(req.rid)
            try:
                await loop.call(lambda e: e.add(req))
                while True:
                    await outputs.get()
                    decoding.set()
            finally:
                loop.close(req.rid)
                await loop.release(lambda e: e.abort(req.rid) or e.release(req))

        task = asyncio.create_task(handler())
        await asyncio.wait_for(decoding.wait(), 60)
        assert pool.num_free < free
        task.cancel()  # as gRPC does when the client goes
        await loop.stop()
        return task

    task = asyncio.run(scenario())
    assert task.done()
    assert pool.num_free == free


def test_an_output_a_call_makes_reaches_the_stream_before_later_steps(embedded_runner, embedded_tokenizer):
    """D's hand-off: add_prefilled (a call on the engine thread) makes the room's first output,
    and the engine steps the room at once. Emitted from the engine thread, that output is first on
    the stream; handed back to the caller and put there by it, the steps that ran before the event
    loop resumed the caller come first (seen under load as a D output shifted by a token or two).
    The event loop is held up for a moment to open that window every time."""
    engine = Engine(embedded_runner, embedded_tokenizer.eos_token_ids)

    async def first_on_stream(emit_on_engine_thread: bool) -> list[int]:
        aio = asyncio.get_running_loop()
        loop = EngineLoop(engine, aio)
        loop.start()
        req = Request("r", list(range(100, 120)), SamplingParams(max_new_tokens=6, ignore_eos=True))
        engine.reserve(req)
        req.cache.length = req.prompt_len  # whatever the pages hold: only the order is looked at
        outputs = loop.open(req.rid)

        def add(e: Engine):
            aio.call_soon_threadsafe(time.sleep, 0.5)  # the event loop busy while the engine steps
            out = e.add_prefilled(req, 7)
            if emit_on_engine_thread:
                loop.emit(out)
            return out

        out = await loop.call(add)
        if not emit_on_engine_thread:
            outputs.put_nowait(out)
        got = []
        while not got or not got[-1].finished:
            got.append(await outputs.get())
        loop.close(req.rid)
        async with asyncio.timeout(60):  # stop() from a handler returns: it does not wait out its grace on itself
            await loop.stop(grace_s=3600)
        return [t for o in got for t in o.new_ids]

    assert asyncio.run(first_on_stream(True))[0] == 7
    assert asyncio.run(first_on_stream(False))[0] != 7  # the race this guards against, provoked
