"""Runs an Engine on its own thread and lets asyncio services talk to it.

The engine (and its page pool) is touched only by the engine thread. Services hand it work
with `call(fn)` (fn(engine) runs between two steps; its result comes back as an awaitable)
and read each request's outputs from the asyncio queue `open(rid)` returned.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from common.engine.engine import Engine, StepOutput

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The forward pass of a step raised; the requests in that step are failed."""


class EngineLoop:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self._loop = loop
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._handlers: set[asyncio.Task] = set()  # the tasks that opened a stream (see stop)
        self._stop = threading.Event()
        self.out_of_service: str | None = None  # why this instance cannot serve any more
        self._on_out_of_service: list[Callable[[EngineFailure], None]] = []
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Let the requests' handlers end first (up to grace_s), then stop the engine thread. A
        handler whose client has gone (the router stopped first) is cancelled by gRPC but still
        returns its pages through the engine thread in its clean-up; the server's own grace does
        not wait for it, since for gRPC that call has ended."""
        me = asyncio.current_task()  # a handler that stops the loop itself would wait on itself
        handlers = [t for t in self._handlers if not t.done() and t is not me]
        if handlers:
            _, late = await asyncio.wait(handlers, timeout=grace_s)
            if late:
                logger.warning("stopping with %d request handlers still running after %.0f s", len(late), grace_s)
        self._stop.set()
        self._calls.put((lambda e: None, self._loop.create_future()))  # wake the thread
        self._thread.join(timeout=10)

    def open(self, rid: str) -> asyncio.Queue:
        """Queue of StepOutput (or an exception) for request rid; close() it when done. The
        calling task (the request's handler) is one that stop() lets end."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        return q

    def close(self, rid: str) -> None:
        self._streams.pop(rid, None)

    async def abort(self, rid: str) -> bool:
        """Abort rid wherever it is in the engine (its pages return) and end its stream. Once out
        of service there is nothing to do: its stream has failed, its pages go with the instance."""
        if self.out_of_service is not None:
            return False

        def abort(engine: Engine) -> bool:
            req = engine.abort(rid)
            if req is not None:
                self.emit(StepOutput(req, [], "", True))
            return req is not None

        return await self.call(abort)

    def take_out_of_service(self, why: str, grace_s: float) -> None:
        """From any thread: the instance cannot serve any more (a node of it is lost). Health says
        so at once; after grace_s every request in flight fails with `why`, from here: the engine
        thread may be stuck in a step that never returns."""
        self.out_of_service = why
        self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self._fail_streams, EngineFailure(why))

    def on_out_of_service(self, fail: Callable[[EngineFailure], None]) -> None:
        """fail(error) runs on the event loop with the streams' failure: for requests that wait
        elsewhere than on their stream (a room waiting for its KV)."""
        self._on_out_of_service.append(fail)

    def _fail_streams(self, error: EngineFailure) -> None:
        for q in self._streams.values():
            q.put_nowait(error)
        for fail in self._on_out_of_service:
            fail(error)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Raises EngineFailure once out of service: the engine thread may be stuck in a step for
        good (a rank or node of the instance is gone), so nothing new waits on it."""
        if self.out_of_service is not None:
            raise EngineFailure(self.out_of_service)
        fut = self._loop.create_future()
        self._calls.put((fn, fut))
        return await fut

    async def release(self, fn: Callable[[Engine], Any]) -> None:
        """`call` for a request's clean-up, skipped once out of service: the pages go with the
        instance, which is stopping, and its failure must still reach the client."""
        if self.out_of_service is None:
            await self.call(fn)

    # ---- engine thread -----------------------------------------------------------------
    def emit(self, out: StepOutput) -> None:
        """On the engine thread (a step, or a `call`'s fn): out goes to its request's stream
        ahead of whatever a later step emits. A call's result reaches its caller only after the
        event loop resumes it, by which time the next step may already have emitted: an output
        a call makes is emitted here, never put on the stream by the caller."""
        q = self._streams.get(out.req.rid)
        if q is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, out)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_work
            try:
                fn, fut = self._calls.get(timeout=0.5) if block else self._calls.get_nowait()
                self._apply(fn, fut)
                while True:  # drain whatever else is queued before the next step
                    self._apply(*self._calls.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work:
                self._step()

    def _apply(self, fn: Callable[[Engine], Any], fut: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # returned to the caller, who decides what it means
            result, error = None, e
        self._loop.call_soon_threadsafe(_settle, fut, result, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing its requests")
            failed = self._fail_all(EngineFailure(f"engine step failed: {e}"))
            outputs = []
            logger.error("failed %d requests", failed)
        for out in outputs:
            self.emit(out)

    def _fail_all(self, error: Exception) -> int:
        reqs = [*self.engine.prefilling, *self.engine.running]
        for req in reqs:
            self.engine.abort(req.rid)
            q = self._streams.get(req.rid)
            if q is not None:
                self._loop.call_soon_threadsafe(q.put_nowait, error)
        return len(reqs)


def _settle(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


__all__ = ["EngineLoop", "EngineFailure", "StepOutput"]
