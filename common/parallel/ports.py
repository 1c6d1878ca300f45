"""Free TCP ports of this host: the rendezvous of a parallel instance's ranks, and the services
and stacks that `pdflash up`, the benchmarks and the tests start.

A port is chosen some time before its process binds it. Ports are therefore drawn at random
below the OS's ephemeral range: the OS hands ports of that range to every outgoing connection
and to bind(0), so a port taken from there could be given to one of the many connections a
stack opens (gRPC, gloo, Mooncake) before its own service bound it. They are also drawn above
the ports Mooncake binds for itself (15000-17000, its handshake and TCP transport).
"""
from __future__ import annotations

import random
import socket

LOWEST = 20000  # below: registered services and Mooncake's own ports
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (held open together, so no two are equal)."""
    top = ephemeral_range()[0] - 1
    socks: list[socket.socket] = []
    try:
        for _ in range(64 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, _rng.randint(LOWEST, top) if top - LOWEST >= 1000 else 0))
                socks.append(s)
            except OSError:
                s.close()
        if len(socks) < n:
            raise RuntimeError(f"found only {len(socks)} of {n} free ports on {host}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 both free (the router serves HTTP on p, gRPC on p + 1)."""
    for _ in range(100):
        port = free_port(host)
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports found")
