"""python -m decode_svc: a decode instance (KV from prefill over Mooncake) or, with
--role colocated, a replica that also prefills locally."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses

from common.engine.engine import Engine
from common.service.engine_loop import EngineLoop
from common.service.gate import serve_gated
from common.service.grpc_process import run_service, setup_logging
from common.service.loader import (
    ModelOptions,
    add_model_args,
    add_parallel_args,
    load_model,
    load_proposer,
    parse_nodes,
    spec_config,
)
from common.service.nodes import serve_node, watch_nodes
from common.service.spec_args import add_spec_args
from common.service.tls import Tls, add_tls_args
from common.service.transfer_ranks import TransferRanks, add_mooncake_args
from decode_svc.kv_receiver import PEER_ABORT_TIMEOUT_S, KVReceiver
from decode_svc.service import DecodeServicer
from protos import pdflash_pb2_grpc as pb_grpc


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", default="decode", choices=["decode", "colocated"])
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill chunk (colocated)")
    p.add_argument("--max-running", type=int, default=256,
                   help="requests decoded at once; requests handed off beyond it wait, their KV held")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds for bootstrap + KV transfer")
    p.add_argument("--peer-abort-timeout", type=float, default=PEER_ABORT_TIMEOUT_S,
                   help="seconds per attempt at prefill's Abort of a room given up on (its pages stay parked until it answers)")
    add_model_args(p)
    add_parallel_args(p, pipeline=False)
    add_spec_args(p)
    add_mooncake_args(p)
    add_tls_args(p)
    return parse_nodes(p, p.parse_args(argv))


async def main(args: argparse.Namespace, stop: asyncio.Event) -> None:
    tls = Tls.from_args(args)  # before the model load: a bad file fails fast
    log = setup_logging(f"{args.role}:{args.port}")
    # A P on this host copies the prompt's KV straight into our buffers: they are allocated shareable
    # (on every node: a P may share the host of any of our ranks).
    opts = dataclasses.replace(ModelOptions.from_args(args), shared_kv=args.role == "decode" and args.local_transfer)
    if not args.nodes.head:
        return await serve_node(args, opts, args.role, log, stop)
    # The port answers from now on (NOT_SERVING, calls UNAVAILABLE saying why) while the model
    # loads and the instance's nodes join: a while, and again after a lost node (rejoin).
    server, gate, checks = await serve_gated(args.host, args.port, "pdflash.DecodeService", args.nodes, tls)
    runner = None
    try:
        runner, tokenizer = await asyncio.to_thread(load_model, opts)
        engine = Engine(runner, tokenizer.eos_token_ids, chunk_size=args.chunk_size, max_running=args.max_running,
                        proposer=load_proposer(args, runner), spec=spec_config(args))
        loop = EngineLoop(engine, asyncio.get_running_loop())
        receiver = None
        if args.role == "decode":
            ranks = TransferRanks.start(args, engine)  # P writes each of our ranks' heads to that rank
            receiver = KVReceiver(loop, ranks.mooncake.session_id, f"{args.host}:{args.port}", ranks.endpoints, args.tp,
                                  args.peer_abort_timeout, tls)
        servicer = DecodeServicer(loop, tokenizer, receiver, args.role, runner.cfg.name, args.deadline)
        loop.start()
        watch_nodes(runner, loop, checks)
        await gate.open(pb_grpc.add_DecodeServiceServicer_to_server, servicer, checks)
        log.info("ready on %s:%d (%s, TP %d, EP %d, %d KV pages of %d tokens)", args.host, args.port, args.role,
                 args.tp, args.ep, runner.pool.num_pages, runner.page_size)
        await stop.wait()
        await server.stop(grace=2)
        await loop.stop()
    finally:  # also after a failed start: the port closes here, not in the interpreter's exit
        await server.stop(grace=None)
        if runner is not None:
            runner.close()


if __name__ == "__main__":
    args = parse_args()
    run_service(lambda stop: main(args, stop))
