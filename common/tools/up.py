"""`pdflash up`: the whole stack on one machine.

Starts prefill instances, then decode instances (or colocated replicas), then the router,
each group only once the previous one answers its health check; prints the URL; on Ctrl-C or
SIGTERM stops every child (router first, so no new work arrives) and waits for them.

The instances of a role may differ in shape: `--prefill 3 --prefill-tp 1,2,4` starts P at TP 1,
2 and 4 (each --*-tp/-pp/-ep flag is one size for all, or one per instance).
"""
from __future__ import annotations

import argparse
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.parallel.ports import free_port
from common.service.spec_args import add_spec_args, spec_flags
from common.service.tls import Tls, add_tls_args, blocking_channel, tls_flags

STARTUP_TIMEOUT_S = 300.0


MAX_RESTARTS = 5


@dataclass
class Child:
    name: str
    addr: str
    module: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of ours (secrets stay out of argv)
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> "Child":
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.argv], env=child_env() | self.env)
        return self


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (pd)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (pd)")
    p.add_argument("--replicas", type=int, default=1, help="colocated replicas (colocated)")
    each = " (N for all, or N,M,... one per instance)"
    p.add_argument("--prefill-tp", type=_sizes, default=(1,), help="tensor-parallel processes per prefill instance" + each)
    p.add_argument("--prefill-pp", type=_sizes, default=(1,),
                   help="pipeline stages (processes) per prefill instance" + each)
    p.add_argument("--decode-tp", type=_sizes, default=(1,),
                   help="tensor-parallel processes per decode instance (or replica)" + each)
    p.add_argument("--prefill-ep", type=_sizes, default=(1,),
                   help="expert parallel (MoE models): routed experts sharded over each prefill stage's TP ranks" + each)
    p.add_argument("--decode-ep", type=_sizes, default=(1,),
                   help="expert parallel (MoE models): routed experts sharded over the decode TP ranks" + each)
    p.add_argument("--host", default="127.0.0.1",
                   help="address every service listens on; another host's address serves that network (docs/DEPLOY.md)")
    p.add_argument("--port", type=int, default=30000, help="router HTTP port (gRPC on port+1)")
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-pages", type=int, default=512)
    p.add_argument("--state-slots", type=int, default=64, help="models with KDA layers: requests whose state fits at a time")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: decode eagerly, without CUDA graphs")
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--no-chunk-overlap", dest="chunk_overlap", action="store_false",
                   help="prefill: send a prompt's KV only after its last chunk, not each chunk's pages as it ends")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds for a room's bootstrap + KV transfer")
    p.add_argument("--peer-abort-timeout", type=float, default=10.0,
                   help="decode: seconds per attempt at prefill's Abort of a room it gave up on")
    p.add_argument("--request-timeout", type=float, default=600.0, help="router: seconds per request")
    p.add_argument("--verify-transfer", action="store_true", help="checksum every KV page P sends and D receives")
    p.add_argument("--no-local-transfer", dest="local_transfer", action="store_false",
                   help="pd: move KV over Mooncake even between P and D on this host (by default copied directly)")
    p.add_argument("--api-key", default=os.environ.get("PDFLASH_API_KEY") or None,
                   help="router: require `Authorization: Bearer KEY` on all but /health (default: $PDFLASH_API_KEY)")
    p.add_argument("--allow-route-header", action="store_true",
                   help="router: tests and debugging, let a request name its P and D instance (X-PDflash-Route)")
    add_spec_args(p)
    add_tls_args(p)


def _sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not N or N,M,... (one per instance)") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: every size must be at least 1")
    return sizes


@dataclass(frozen=True)
class Shape:
    """One instance's processes: TP ranks per stage, pipeline stages, EP ranks among the TP ranks."""
    tp: int
    pp: int
    ep: int

    def flags(self) -> list[str]:
        return ["--tp", str(self.tp), "--ep", str(self.ep)] + (["--pp", str(self.pp)] if self.pp > 1 else [])


def shapes(args: argparse.Namespace, side: str, count: int) -> list[Shape]:
    """The shapes of `count` instances of `side` ("prefill" or "decode") from its --SIDE-tp/-pp/-ep
    sizes (one for all, or one per instance); ValueError if they do not fit."""
    per: dict[str, tuple[int, ...]] = {}
    for dim in ("tp", "pp", "ep"):
        sizes = getattr(args, f"{side}_{dim}", (1,))
        if len(sizes) not in (1, count):
            raise ValueError(f"--{side}-{dim} gives {len(sizes)} sizes for {count} {side} instances")
        per[dim] = sizes * count if len(sizes) == 1 else sizes
    out = [Shape(*dims) for dims in zip(per["tp"], per["pp"], per["ep"])]
    # EP shards the experts over the TP ranks (SGLang's --ep-size): it must divide TP. Whether it
    # divides the model's experts each instance checks when it loads the model (and exits with the reason).
    for s in out:
        if s.tp % s.ep:
            raise ValueError(f"--{side}-ep {s.ep} must divide --{side}-tp {s.tp}: the experts are sharded over the TP ranks")
    return out


def model_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--page-size", str(args.page_size), "--kv-pages", str(args.kv_pages),
             "--state-slots", str(args.state_slots)]
    if args.model:
        flags += ["--model", args.model]
    if args.device:
        flags += ["--device", args.device]
    if args.no_cuda_graphs:
        flags.append("--no-cuda-graphs")
    return flags


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "1")  # Mooncake's per-connection INFO lines drown the rest
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def wait_grpc_healthy(children: list[Child], timeout: float, tls: Tls | None) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        with blocking_channel(c.addr, tls) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during start-up")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{c.name} not healthy after {timeout:.0f} s")
                time.sleep(0.5)


def wait_http_healthy(child: Child, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not listening yet, or not HTTP (yet)
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def stop_all(children: list[Child], timeout: float = 15.0) -> None:
    for c in reversed(children):  # router first: no new work reaches the workers
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in reversed(children):
        try:
            c.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def threads_env(args: argparse.Namespace, ranks: int) -> dict[str, str]:
    """On the CPU the stack's `ranks` compute processes share the host's cores: one share each,
    unless OMP_NUM_THREADS says otherwise. torch's default, a thread per core in every process,
    has them spin waiting on each other: several times the CPU for the same work on a small host."""
    if "OMP_NUM_THREADS" in os.environ or (args.device or _default_device()) != "cpu":
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}


def _default_device() -> str:
    import torch  # here only: `up` runs no model, and importing torch costs seconds of CPU per stack start

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    if min(args.prefill, args.decode, args.replicas) < 1:
        raise ValueError("--prefill, --decode and --replicas must be at least 1")
    if args.mode == "colocated" and {args.prefill_tp, args.prefill_pp, args.prefill_ep} != {(1,)}:
        raise ValueError("--prefill-tp/--prefill-pp/--prefill-ep apply to --mode pd; a colocated replica is split "
                         "with --decode-tp/--decode-ep")
    # Sizes that do not fit are refused before anything starts.
    if args.mode == "pd":
        shapes(args, "prefill", args.prefill)
        shapes(args, "decode", args.decode)
    else:
        shapes(args, "decode", args.replicas)
    children: list[Child] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        workers = start_workers(args, children)
        router_args = ["--host", args.host, "--port", str(args.port), "--request-timeout", str(args.request_timeout),
                       "--transfer-deadline", str(args.deadline), *tls_flags(args)]
        if args.model:
            router_args += ["--model", args.model]
        if args.allow_route_header:
            router_args.append("--allow-route-header")
        if args.mode == "pd":
            prefills = ",".join(c.addr for c in workers if c.name.startswith("prefill"))
            decodes = ",".join(c.addr for c in workers if c.name.startswith("decode"))
            router_args += ["--policy", "pd", "--prefill", prefills, "--decode", decodes]
        else:
            router_args += ["--policy", "round_robin", "--replicas", ",".join(c.addr for c in workers)]
        key = {"PDFLASH_API_KEY": args.api_key} if args.api_key else {}
        router = Child("router", f"{args.host}:{args.port}", "router_svc", router_args, env=key).start()
        children.append(router)
        url = f"http://{args.host}:{args.port}"
        wait_http_healthy(router, url + "/health", STARTUP_TIMEOUT_S)
        auth = " -H 'Authorization: Bearer $PDFLASH_API_KEY'" if args.api_key else ""
        print(f"\npdflash is up ({args.mode}): {url}  (OpenAI API at {url}/v1, gRPC router at "
              f"{args.host}:{args.port + 1})\n  try: curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
              "-d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"What is 2+3?\"}]}'\n"
              "Ctrl-C stops everything.", flush=True)
        supervise(children, router)
    except KeyboardInterrupt:
        print("\nstopping pdflash ...", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as e:
        print(f"pdflash up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(children)


def supervise(children: list[Child], router: Child) -> None:
    """Restart a prefill/decode process that dies (same port: the router reconnects by itself);
    requests it held fail with a clear error meanwhile. The router dying ends the stack."""
    while True:
        for c in children:
            if c.proc.poll() is None:
                continue
            if c is router or c.restarts >= MAX_RESTARTS:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}")
            c.restarts += 1
            print(f"pdflash up: {c.name} exited with code {c.proc.returncode}; restarting it "
                  f"({c.restarts}/{MAX_RESTARTS})", file=sys.stderr, flush=True)
            c.start()
        time.sleep(1.0)


def start_workers(args: argparse.Namespace, children: list[Child]) -> list[Child]:
    common = model_flags(args) + spec_flags(args) + tls_flags(args) + [
        "--host", args.host, "--chunk-size", str(args.chunk_size), "--deadline", str(args.deadline)]
    if args.mode == "pd":
        verify = ["--verify-transfer"] if args.verify_transfer else []
        overlap = [] if args.chunk_overlap else ["--no-chunk-overlap"]
        transport = [] if args.local_transfer else ["--no-local-transfer"]
        prefill, decode = shapes(args, "prefill", args.prefill), shapes(args, "decode", args.decode)
        groups = [("prefill", "prefill_svc", [verify + overlap + transport + s.flags() for s in prefill]),
                  ("decode", "decode_svc", [["--role", "decode", *s.flags(), *transport,
                                             "--peer-abort-timeout", str(args.peer_abort_timeout)] for s in decode])]
        every = prefill + decode
    else:
        every = shapes(args, "decode", args.replicas)
        groups = [("replica", "decode_svc", [["--role", "colocated", *s.flags()] for s in every])]
    env = threads_env(args, sum(s.tp * s.pp for s in every))
    workers: list[Child] = []
    for kind, module, extras in groups:  # P before D: P owns the bootstrap
        group = []
        for i, extra in enumerate(extras):
            port = free_port(args.host)
            c = Child(f"{kind}{i}", f"{args.host}:{port}", module, ["--port", str(port), *common, *extra], env=env).start()
            children.append(c)
            group.append(c)
        wait_grpc_healthy(group, STARTUP_TIMEOUT_S, Tls.from_args(args))
        workers += group
    return workers
