"""python -m prefill_svc: a prefill instance that ships KV to decode instances over Mooncake."""
from __future__ import annotations

import argparse
import asyncio

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
from prefill_svc.kv_sender import KVSender
from prefill_svc.service import PrefillServicer
from protos import pdflash_pb2_grpc as pb_grpc


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=8192, help="tokens per prefill step")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a room may take end to end")
    p.add_argument("--no-chunk-overlap", dest="chunk_overlap", action="store_false",
                   help="send a prompt's KV only after its last prefill chunk (by default the pages each chunk "
                        "completes go to decode while the next chunk computes; always off for an instance over "
                        "several nodes)")
    p.add_argument("--verify-transfer", action="store_true", help="send page checksums; D checks every page it received")
    add_model_args(p)
    add_parallel_args(p, pipeline=True)
    add_spec_args(p)
    add_mooncake_args(p)
    add_tls_args(p)
    return parse_nodes(p, p.parse_args(argv))


async def main(args: argparse.Namespace, stop: asyncio.Event) -> None:
    tls = Tls.from_args(args)  # before the model load: a bad file fails fast
    log = setup_logging(f"prefill:{args.port}")
    if not args.nodes.head:
        return await serve_node(args, ModelOptions.from_args(args), "prefill", log, stop)
    # The port answers from now on (NOT_SERVING, calls UNAVAILABLE saying why) while the model
    # loads and the instance's nodes join: a while, and again after a lost node (rejoin).
    server, gate, checks = await serve_gated(args.host, args.port, "pdflash.PrefillService", args.nodes, tls)
    runner = None
    try:
        runner, tokenizer = await asyncio.to_thread(load_model, ModelOptions.from_args(args))
        engine = Engine(runner, tokenizer.eos_token_ids, chunk_size=args.chunk_size, prefill_only=True,
                        proposer=load_proposer(args, runner), spec=spec_config(args))
        loop = EngineLoop(engine, asyncio.get_running_loop())
        ranks = TransferRanks.start(args, engine)  # every rank sends its own layers' and heads' KV
        # A worker rank writes between its forwards: a write stalled by a cut link (up to the transfer
        # timeout) would hold the next chunk's forward, and with it the heartbeats that keep an
        # instance over several nodes alive, so there the KV goes after the last chunk only.
        overlap = args.chunk_overlap and not args.nodes.multi
        if args.chunk_overlap and not overlap:
            log.info("chunk overlap off: this instance spans %d nodes", args.nodes.nnodes)
        servicer = PrefillServicer(loop, KVSender(ranks, engine, args.deadline, args.verify_transfer, tls),
                                   runner.cfg.name, args.deadline, overlap)
        loop.start()
        watch_nodes(runner, loop, checks)
        await gate.open(pb_grpc.add_PrefillServiceServicer_to_server, servicer, checks)
        log.info("ready on %s:%d (mooncake %s, TP %d x PP %d, EP %d, %d KV pages of %d tokens)", args.host, args.port,
                 ranks.mooncake.session_id, args.tp, args.pp, args.ep, runner.pool.num_pages, runner.page_size)
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
