"""Is a pdflash service up?  Exit 0 when it is, 1 when not (the reason on stderr).

    healthcheck.py grpc HOST:PORT    prefill / decode / replica: standard gRPC health, SERVING
    healthcheck.py http HOST:PORT    router: GET /health answers 200
    healthcheck.py tcp HOST:PORT     anything listening (the Mooncake metadata service)
    healthcheck.py none              nothing to check (non-head ranks of a multi-node instance)

Used by the images' HEALTHCHECK (compose) and by deploy/pd.sh's process launcher. The grpc check
needs grpcio + grpcio-health-checking (in the image and the project's venv); the others need only
the standard library.
"""
from __future__ import annotations

import socket
import sys
import urllib.request


def check(kind: str, addr: str, timeout: float) -> str | None:
    """None when healthy, else why not."""
    host, _, port = addr.rpartition(":")
    try:
        if kind == "tcp":
            socket.create_connection((host, int(port)), timeout=timeout).close()
        elif kind == "http":
            with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout) as r:
                if r.status != 200:
                    return f"/health answered {r.status}"
        elif kind == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(addr) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        else:
            return f"unknown check {kind!r} (grpc, http, tcp or none)"
    except Exception as e:  # any failure to answer is "not healthy"
        return f"{type(e).__name__}: {e}"
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["none"]:
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    why = check(argv[0], argv[1], timeout)
    if why:
        print(f"{argv[0]} {argv[1]}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
