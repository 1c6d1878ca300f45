"""Free TCP ports of this host: the rendezvous of a parallel instance's ranks, and the services
and stacks that `pdflash up`, the benchmarks and the tests start."""
from __future__ import annotations

import socket


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (held open together, so no two are equal)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
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
