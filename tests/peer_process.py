"""A child process that serves commands over a pipe, for tests that need Mooncake peers in
processes of their own (a Mooncake engine per process, memory registered there)."""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from common.transfer.mooncake import MooncakeEngine, TransferError
from common.transfer.plan import TransferPlanError

REPLY_TIMEOUT_S = 60


def serve(conn: Any, engine: MooncakeEngine, handle: Callable[[str, list], Any]) -> None:
    """The child's side: answer each command with ("ok", handle(cmd, args)), a transfer or
    plan error with ("error", kind, message), until ("stop",) closes the engine."""
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "stop":
                engine.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", handle(cmd, args)))
        except (TransferError, TransferPlanError) as e:
            conn.send(("error", type(e).__name__, str(e)))


class Peer:
    """Runs `main(conn, *args)` in a spawned process; `main` answers each command it receives
    with ("ok", result) or ("error", kind, message), and returns on ("stop",)."""

    def __init__(self, main: Callable[..., None], *args: Any):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, *args), daemon=True)
        self.proc.start()

    def call(self, *cmd: Any) -> tuple:
        self.conn.send(cmd)
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise AssertionError(f"peer gave no reply to {cmd[0]} (alive: {self.proc.is_alive()})")
        return self.conn.recv()

    def ok(self, *cmd: Any) -> Any:
        reply = self.call(*cmd)
        assert reply[0] == "ok", reply
        return reply[1]

    def stop(self) -> None:
        if self.proc.is_alive():
            self.ok("stop")
        self.proc.join(10)
        assert self.proc.exitcode == 0
