"""Warm every replica before timing (the router alone may warm only one).

The router's `GET /server_info` lists its backends. One request goes to each directly over
gRPC, exactly as the router would send it: colocated replicas get DecodeService.Generate with no
prefill address; in pd mode P.Prefill and D.Generate go out together with one room id, pairing
P[i % nP] with D[i % nD] for i < max(nP, nD), so every P and every D serves one. If a backend
cannot be reached from here (addresses private to the router's network), the warm-up falls back
to max(nP, nD) sequential requests through the router, whose round robin then covers each
backend only if nobody else is sending: the summary says which method was used.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import grpc

from common.tools.bench.client import get_json, run_requests
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

WARMUP_TIMEOUT_S = 1800.0


def backends(info: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(prefill addresses, decode or replica addresses) from /server_info."""
    prefills = [b["addr"] for b in info["backends"] if b["role"] == "prefill"]
    decodes = [b["addr"] for b in info["backends"] if b["role"] != "prefill"]
    return prefills, decodes


def plan(prefills: list[str], decodes: list[str]) -> list[tuple[str | None, str]]:
    """(prefill or None, decode) pairs that give every backend at least one request."""
    if not prefills:
        return [(None, d) for d in decodes]
    n = max(len(prefills), len(decodes))
    return [(prefills[i % len(prefills)], decodes[i % len(decodes)]) for i in range(n)]


def warm_up(url: str, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """One request per backend; raises RuntimeError if a reachable backend fails it."""
    info = get_json(url, "/server_info")
    pairs = plan(*backends(info))
    deadline = float(info.get("transfer_deadline", 60.0))
    try:
        done = asyncio.run(_direct(pairs, input_ids, max_new_tokens, deadline))
        return {"method": "grpc-direct", "requests": done}
    except _Unreachable as e:
        print(f"warm-up: {e}; falling back to {len(pairs)} requests through the router (round robin)", flush=True)
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                        "ignore_eos": True}}
    out = []
    for _ in pairs:  # one at a time: round robin moves one step per request
        [r], secs = run_requests(url, [body], 1, "warm-up (router)", WARMUP_TIMEOUT_S)
        if not r.ok:
            raise RuntimeError(f"warm-up request through the router failed: {r.error}")
        out.append({"prefill": None, "decode": None, "seconds": secs})
    return {"method": "router-round-robin", "requests": out}


class _Unreachable(Exception):
    pass


async def _direct(pairs: list[tuple[str | None, str]], input_ids: list[int], max_new_tokens: int,
                  deadline: float) -> list[dict[str, Any]]:
    sampling = pb.SamplingParams(temperature=0, top_p=1, max_new_tokens=max_new_tokens, ignore_eos=True)
    out = []
    for prefill, decode in pairs:  # one at a time: each may be a cold start
        start = time.monotonic()
        tokens = await _one(prefill, decode, input_ids, sampling, deadline)
        out.append({"prefill": prefill, "decode": decode, "seconds": time.monotonic() - start, "tokens": tokens})
        print(f"warm-up: {'P ' + prefill + ' -> ' if prefill else ''}D {decode}: {tokens} tokens in "
              f"{out[-1]['seconds']:.2f} s", flush=True)
    return out


async def _one(prefill: str | None, decode: str, input_ids: list[int], sampling: pb.SamplingParams,
               deadline: float) -> int:
    room = f"warmup-{uuid.uuid4().hex}"
    channels = [grpc.aio.insecure_channel(a) for a in ([decode] + ([prefill] if prefill else []))]
    try:
        for ch, addr in zip(channels, [decode, prefill]):
            try:
                await asyncio.wait_for(ch.channel_ready(), 10)
            except asyncio.TimeoutError:
                raise _Unreachable(f"cannot connect to {addr}") from None
        d = pb_grpc.DecodeServiceStub(channels[0])
        call = d.Generate(pb.GenerateRequest(room=room, input_ids=input_ids, sampling=sampling,
                                             prefill_addr=prefill or "", deadline_s=deadline),
                          timeout=WARMUP_TIMEOUT_S)
        tasks = []
        if prefill:
            p = pb_grpc.PrefillServiceStub(channels[1])
            tasks.append(asyncio.ensure_future(p.Prefill(pb.PrefillRequest(
                room=room, input_ids=input_ids, sampling=sampling, decode_addr=decode, deadline_s=deadline),
                timeout=WARMUP_TIMEOUT_S)))
        tokens, finished = 0, False
        try:
            async for chunk in call:
                tokens += len(chunk.token_ids)
                finished = finished or chunk.finished
            for t in tasks:
                reply = await t
                if not reply.ok:
                    raise RuntimeError(f"warm-up: prefill {prefill} failed: {reply.error}")
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"warm-up of {'P ' + prefill + ' / ' if prefill else ''}D {decode} failed: "
                               f"{e.code().name} {e.details()}") from None
        finally:
            for t in tasks:
                t.cancel()  # no-op when done
        if not finished:
            raise RuntimeError(f"warm-up: decode {decode} ended its stream without a last chunk")
        return tokens
    finally:
        for ch in channels:
            await ch.close()
