"""An instance's KV transfer endpoints, one per rank: each rank registers its own buffers with
its own Mooncake engine (a pipeline stage its layers, a TP rank its heads), and P writes a
room's KV from every rank at once: by local copy to a D rank on this host whose buffers open
here (common/transfer/local.py), over Mooncake otherwise."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.engine.engine import Engine
from common.kv.buffers import RankEndpoint
from common.parallel.driver import ParallelRunner
from common.runner.model_runner import ModelRunner
from common.transfer.local import LocalWriter
from common.transfer.mooncake import MooncakeConfig, MooncakeEngine, TransferError
from common.transfer.plan import Writes
from common.transfer.writer import Moved, Peers, RankWriter


def add_mooncake_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mooncake-metadata", default="P2PHANDSHAKE", help="P2PHANDSHAKE or an http/etcd metadata URL")
    p.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--mooncake-devices", default="", help="RDMA devices, e.g. mlx5_0,mlx5_1")
    p.add_argument("--no-local-transfer", dest="local_transfer", action="store_false",
                   help="always move KV over Mooncake, also between P and D on one host (by default they "
                        "copy it directly: shared memory on the CPU, CUDA IPC on GPUs)")


def start_mooncake(args: argparse.Namespace) -> MooncakeEngine:
    eng = MooncakeEngine(MooncakeConfig(args.nodes.host_ip, args.mooncake_metadata,
                                        args.mooncake_protocol, args.mooncake_devices))
    eng.start()
    return eng


@dataclass
class TransferRanks:
    writer: RankWriter  # this process's: rank 0's
    endpoints: list[RankEndpoint]  # every rank's, in rank order, rank 0 first
    tp: int
    runner: ModelRunner  # rank 0's; a ParallelRunner reaches the other ranks

    @property
    def mooncake(self) -> MooncakeEngine:
        return self.writer.mooncake

    @classmethod
    def start(cls, args: argparse.Namespace, engine: Engine) -> "TransferRanks":
        mooncake = start_mooncake(args)
        buffers = engine.describe_buffers()
        mooncake.register_buffers(buffers)
        runner = engine.runner
        endpoints = [RankEndpoint(0, mooncake.session_id, buffers, runner.memory.regions)]
        if isinstance(runner, ParallelRunner):  # each rank its own segment, on its own host
            endpoints += runner.start_transfer(mooncake.config, args.local_transfer)
        local = LocalWriter(runner.memory, runner.device) if args.local_transfer else None
        return cls(RankWriter(mooncake, local), endpoints, runner.layout.tp, runner)

    def write(self, jobs: list[Writes], peers: Peers) -> Moved:
        """jobs[r]: what rank r writes (by local copy to the D ranks in `peers`). All ranks write
        at once; returns what moved once every rank has finished (so none still writes when the
        caller acks or frees pages), or raises TransferError naming each rank that failed."""
        remote = [self.runner.write(r, w, peers) for r, w in enumerate(jobs) if r and w]
        moved, errors = Moved(), []
        try:
            moved += self.writer.write(jobs[0], peers)
        except Exception as e:  # whatever it was, the other ranks' writes are waited for below
            errors.append(f"rank 0: {e}")
        for fut in remote:
            try:
                moved += fut.result()
            except Exception as e:
                errors.append(str(e))
        if errors:  # ranks that failed for one cause (the instance stopping) report it once
            raise TransferError("; ".join(dict.fromkeys(errors)))
        return moved
