"""EngineLoop: the engine's thread and the asyncio services that talk to it."""
from __future__ import annotations

import asyncio

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
