"""Hosts on one machine: network namespaces joined by a bridge (10.200.0.0/24 in the router's
namespace; nothing is added to the host's own network). Needs root and `ip netns`."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.200.0"


def netns_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"pdfprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return "ip netns add failed here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


class Namespaces:
    """P hosts, D hosts and R, each a namespace; R holds the bridge that joins the others' veth
    pairs (P's interface is `vp`, D's `vd`, in each host)."""

    def __init__(self, prefill: int = 1, decode: int = 1):
        tag = uuid.uuid4().hex[:6]
        self.prefill = [f"pdf{tag}p{i or ''}" for i in range(prefill)]
        self.decode = [f"pdf{tag}d{i or ''}" for i in range(decode)]
        self.p, self.d, self.r = self.prefill[0], self.decode[0], f"pdf{tag}r"
        hosts = self.prefill + self.decode + [self.r]
        self.ip = {ns: f"{SUBNET}.{i + 1}" for i, ns in enumerate(hosts)}

    def create(self) -> None:
        for ns in self.ip:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.r, "link", "add", "br0", "type", "bridge")
        hosts = [(ns, "vp") for ns in self.prefill] + [(ns, "vd") for ns in self.decode]
        for i, (ns, dev) in enumerate(hosts):
            # Both ends are created inside the namespaces: the host's interfaces are untouched.
            sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", f"v{i}br", "netns", self.r)
            sh("ip", "-n", self.r, "link", "set", f"v{i}br", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[ns]}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", self.r, "addr", "add", f"{self.ip[self.r]}/24", "dev", "br0")
        sh("ip", "-n", self.r, "link", "set", "br0", "up")

    def delete(self, wait_s: float = 20.0) -> None:
        """Kill every process left in the namespaces (a test that failed half-way may have left
        services, their ranks and clients there), then remove the namespaces."""
        deadline = time.monotonic() + wait_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for ns in self.ip:
            sh("ip", "netns", "del", ns, check=False)
        assert not pids, f"processes that outlived SIGKILL in the test's namespaces: {pids}"

    def pids(self) -> list[int]:
        """Every process in any of the namespaces (zombies are gone once their parent reaps them)."""
        return [int(pid) for ns in self.ip for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split()]

    def tx_bytes(self, ports: list[str]) -> int:
        """Bytes the bridge has sent out of `ports` (v{i}br: into the i-th host, P hosts first)."""
        files = [f"/sys/class/net/{p}/statistics/tx_bytes" for p in ports]
        return sum(int(n) for n in sh("ip", "netns", "exec", self.r, "cat", *files).stdout.split())

    def cross_routes(self, a: list[str], b: list[str]) -> list[tuple[str, str]]:
        """(host, peer) for every route between a host of `a` and one of `b`, both ways."""
        return [(x, y) for x in a for y in b] + [(y, x) for x in a for y in b]

    def run_in(self, ns: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", ns, *cmd, check=False, timeout=timeout, cwd=REPO)


def namespaces(**hosts):
    why = netns_available()
    if why:
        pytest.skip(why)
    ns = Namespaces(**hosts)
    try:
        ns.create()
        yield ns
    finally:
        ns.delete()
