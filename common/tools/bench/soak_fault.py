"""`pdflash bench soak --kill TARGET`: one fault in the middle of the load, and what it did.

TARGET is ROLE:INDEX, the INDEX-th (from 0) prefill, decode or replica instance in the router's
`/server_info`, or ROLE:INDEX:rankR, worker rank R (R >= 1) of a parallel instance (rank 0 is
the instance's own process). `--kill-at` seconds into the load its process gets SIGKILL: it is
gone, and the stack brings it back if it does that (`pdflash up` restarts a dead P or D, the
whole instance when one of its worker ranks died). With `--freeze` it gets SIGSTOP instead: it
hangs, as a lost node or a cut link looks to its peers, and `--restart-after` seconds later
SIGCONT (without it, it stays frozen until the load ends). Local stacks only: the process is
found by the port it serves.

While the load runs, the router's `/server_info` (a fresh Health of each backend: what decides
where the router sends a room) is read twice a second: when the instance was out of the
router's service and when it was back. Then the requests are sorted: affected ones are those
whose failure names the instance or that were in flight at the fault; each must fail with a
message that names a backend and within the transfer deadline, and every other request must
succeed.
"""
from __future__ import annotations

import argparse
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from common.tools.bench.client import get_json

ROLES = ("prefill", "decode", "replica")
WATCH_EVERY_S = 0.5
# The backend a router error names: "decode 127.0.0.1:7001: ..." or "... from prefill HOST:PORT ..."
NAMED_BACKEND = re.compile(r"\b(prefill|decode|replica) (\S+?:\d+)\b")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kill", metavar="ROLE:INDEX[:rankR]", type=lambda text: str(Target.parse(text)),  # kept as text
                   help="kill this instance (or worker rank) during the load; see `--kill-at`, `--freeze`")
    p.add_argument("--kill-at", type=float, help="seconds into the load (default: a third of --duration)")
    p.add_argument("--freeze", action="store_true", help="SIGSTOP instead of SIGKILL: it hangs instead of dying")
    p.add_argument("--restart-after", type=float, help="with --freeze: SIGCONT this many seconds after the fault")


@dataclass(frozen=True)
class Target:
    role: str
    index: int
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> Target:
        m = re.fullmatch(r"(prefill|decode|replica):(\d+)(?::rank(\d+))?", text)
        if m is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not ROLE:INDEX or ROLE:INDEX:rankR "
                                             f"(ROLE one of {', '.join(ROLES)})")
        return cls(m[1], int(m[2]), int(m[3] or 0))

    def __str__(self) -> str:
        return f"{self.role}:{self.index}" + (f":rank{self.rank}" if self.rank else "")


@dataclass
class Plan:
    """Which process, when and how: the options' (from_args gives None without --kill)."""
    target: Target
    at_s: float
    freeze: bool
    restart_after_s: float | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan | None:
        if args.kill is None:
            if args.kill_at is not None or args.freeze or args.restart_after is not None:
                raise ValueError("--kill-at, --freeze and --restart-after need --kill")
            return None
        at = args.duration / 3 if args.kill_at is None else args.kill_at
        if not 0 <= at < args.duration:
            raise ValueError(f"--kill-at {at} is not within the load's {args.duration} s")
        if args.restart_after is not None and (not args.freeze or args.restart_after <= 0):
            raise ValueError("--restart-after needs --freeze and a positive number of seconds (a killed "
                             "instance is brought back by the stack, e.g. pdflash up, not by the soak)")
        return cls(Target.parse(args.kill), at, args.freeze, args.restart_after)


@dataclass
class Timeline:
    """Seconds from the start of the load; None: it did not happen."""
    addr: str = ""
    pid: int | None = None
    fault_s: float | None = None
    restart_s: float | None = None  # SIGCONT sent (--freeze --restart-after)
    out_s: float | None = None  # first read of /server_info with the instance not ok
    back_s: float | None = None  # first read after that with it ok again
    error: str = ""  # why the fault was not made


class Fault:
    """Runs `plan` in a thread from `start()`; `finish()` once the load is over (thaws a frozen
    process) gives the timeline."""

    def __init__(self, plan: Plan, url: str, info: dict[str, Any], listeners: dict[int, int]):
        self.plan = plan
        self.url = url
        self.timeline = Timeline()
        self._begun = 0.0  # time.monotonic() when the load began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-fault", daemon=True)
        self._frozen: psutil.Process | None = None
        self._thaw_timer: threading.Timer | None = None
        self._lock = threading.Lock()  # the timer's thaw and finish's
        same_role = [b["addr"] for b in info["backends"] if b["role"] == plan.target.role]
        if plan.target.index >= len(same_role):
            raise ValueError(f"--kill {plan.target}: the router has {len(same_role)} {plan.target.role} instances")
        self.timeline.addr = same_role[plan.target.index]
        self._instance_pid = listeners.get(int(self.timeline.addr.rsplit(":", 1)[1]))
        if self._instance_pid is None:
            raise ValueError(f"--kill {plan.target}: no process on this host listens on {self.timeline.addr}")

    def start(self, begun: float) -> None:
        self._begun = begun
        self._thread.start()

    def finish(self) -> Timeline:
        self._stop.set()
        self._thread.join()
        if self._thaw_timer is not None:
            self._thaw_timer.cancel()
        self._thaw()  # the pools must be readable, and the stack stoppable
        return self.timeline

    def _thaw(self) -> None:
        with self._lock:
            if self._frozen is not None:
                self._signal(self._frozen, signal.SIGCONT)
                self._frozen, self.timeline.restart_s = None, self._now()

    def _now(self) -> float:
        return time.monotonic() - self._begun

    def _run(self) -> None:
        t, plan = self.timeline, self.plan
        if self._stop.wait(max(0.0, plan.at_s - self._now())):
            return
        try:
            proc = process_of(self._instance_pid, plan.target.rank)
        except (LookupError, psutil.Error) as e:
            t.error = str(e)
            return
        t.pid = proc.pid
        self._signal(proc, signal.SIGSTOP if plan.freeze else signal.SIGKILL)
        t.fault_s = self._now()
        if plan.freeze:
            self._frozen = proc
            if plan.restart_after_s is not None:  # on time, whatever a read of /server_info waits for
                self._thaw_timer = threading.Timer(plan.restart_after_s, self._thaw)
                self._thaw_timer.start()
        while not self._stop.wait(WATCH_EVERY_S):
            ok = backend_ok(self.url, t.addr)
            if not ok and t.out_s is None:
                t.out_s = self._now()
            elif ok and t.out_s is not None and t.back_s is None:
                t.back_s = self._now()

    @staticmethod
    def _signal(proc: psutil.Process, sig: int) -> None:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def process_of(instance_pid: int, rank: int) -> psutil.Process:
    """The instance's process (rank 0) or its worker rank `rank`. The instance starts its ranks in
    order from a forkserver of its own (common.parallel.local_ranks): they are that server's
    children, oldest first."""
    proc = psutil.Process(instance_pid)
    if rank == 0:
        return proc
    servers = [c for c in proc.children() if "forkserver" in " ".join(c.cmdline())]
    ranks = sorted((r for server in servers for r in server.children()), key=lambda r: r.create_time())
    if rank > len(ranks):
        raise LookupError(f"the instance (pid {instance_pid}) has {len(ranks)} worker ranks, no rank {rank}")
    return ranks[rank - 1]


def backend_ok(url: str, addr: str) -> bool:
    try:
        info = get_json(url, "/server_info")
    except Exception:  # the router is busy or restarting: no answer counts as not ok
        return False
    return any(b["addr"] == addr and b["ok"] for b in info["backends"])


def named_backends(error: str | None) -> set[str]:
    """The backend addresses a failure message names."""
    return {m[2] for m in NAMED_BACKEND.finditer(error or "")}


def report(t: Timeline, plan: Plan, outcomes: list[Any], deadline_s: float) -> dict[str, Any]:
    """What the fault did to the requests. `outcomes`: soak.Outcome (sent_s, ended_s, response, left)."""
    if t.fault_s is None:
        return {"target": str(plan.target), "addr": t.addr, "made": False, "error": t.error or "the load ended first",
                "passed": False}
    fault = t.fault_s
    affected, unaffected = [], []
    for o in outcomes:
        if o.left:
            continue
        in_flight = o.sent_s <= fault and (o.ended_s is None or o.ended_s >= fault)
        (affected if in_flight or t.addr in named_backends(o.response.error) else unaffected).append(o)
    failed = [o for o in affected if not o.response.ok]
    # How long each failure took from the moment it could first have known (the fault, or its sending).
    waits = [o.ended_s - max(o.sent_s, fault) for o in failed if o.ended_s is not None]
    unclear = [o.response.error for o in failed if not named_backends(o.response.error)]
    late = [w for w in waits if w > deadline_s]
    unaffected_failed = [o for o in unaffected if not o.response.ok]
    return {
        "target": str(plan.target), "addr": t.addr, "pid": t.pid, "made": True,
        "how": "SIGSTOP" if plan.freeze else "SIGKILL", "fault_s": fault, "restart_s": t.restart_s,
        "out_of_service_after_s": None if t.out_s is None else t.out_s - fault,
        "back_in_service_after_s": None if t.back_s is None else t.back_s - fault,
        "affected": {"requests": len(affected), "ok": len(affected) - len(failed), "failed": len(failed),
                     "longest_wait_s": max(waits, default=None), "past_deadline": len(late),
                     "not_naming_a_backend": len(unclear), "example": failed[0].response.error if failed else None},
        "unaffected": {"requests": len(unaffected), "failed": len(unaffected_failed),
                       "example": unaffected_failed[0].response.error if unaffected_failed else None},
        "deadline_s": deadline_s,
        "passed": not late and not unclear and not unaffected_failed and t.out_s is not None,
    }


def markdown(r: dict[str, Any]) -> str:
    if not r["made"]:
        return f"fault {r['target']} ({r['addr']}) NOT made: {r['error']}\n"
    a, u = r["affected"], r["unaffected"]
    fmt = lambda s: "never" if s is None else f"{s:.1f} s"  # noqa: E731
    lines = [f"fault: {r['how']} to {r['target']} ({r['addr']}, pid {r['pid']}) at {r['fault_s']:.1f} s"
             + (f", SIGCONT at {r['restart_s']:.1f} s" if r["restart_s"] is not None else ""),
             f"- the router stopped routing to it after {fmt(r['out_of_service_after_s'])}, "
             f"routed to it again after {fmt(r['back_in_service_after_s'])} (read twice a second; a read waits "
             "up to 5 s for a hung instance's Health)",
             f"- affected (in flight at the fault, or failed naming it): {a['requests']}, {a['ok']} ok, "
             f"{a['failed']} failed" + (f", the last {fmt(a['longest_wait_s'])} after the fault or its sending "
                                        f"(deadline {r['deadline_s']:.0f} s), {a['past_deadline']} past the deadline, "
                                        f"{a['not_naming_a_backend']} naming no backend" if a["failed"] else ""),
             f"- unaffected: {u['requests']}, {u['failed']} failed"
             + (f" (e.g. {u['example'][:200]})" if u["failed"] else ""),
             ""]
    if a["example"]:
        lines.insert(-1, f"- an affected failure: {a['example'][:200]}")
    return "\n".join(lines)


def listening_pids() -> dict[int, int]:
    """port -> pid of the process listening on it (this host, as far as we may see)."""
    listeners: dict[int, int] = {}
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.pid:
                listeners.setdefault(c.laddr.port, c.pid)
    except psutil.AccessDenied:
        pass
    return listeners

