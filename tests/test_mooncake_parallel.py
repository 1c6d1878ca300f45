"""Heterogeneous-TP and pipeline-parallel KV transfer over real Mooncake TCP between two
processes on 127.0.0.1: one P process hosting every P rank's buffers (each registered on its
own, as each rank's process would) and one D process hosting every D rank's. Per layout, P
builds every (P rank, D rank) plan from the D ranks' BufferInfo (as Bootstrap carries them)
and writes the bytes; each D rank's caches must then equal its heads' slices of the model's KV
and, for Kimi-Linear's layout, of the room's KDA state slots (tests/parallel_kv.py), with every other byte unchanged and no byte sent twice. The two
processes serve every layout, so the grid costs little more than its transfers.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

try:
    import mooncake.engine  # noqa: F401  (fails without the wheel or without libibverbs1)
except ImportError as e:
    pytest.skip(f"mooncake.engine cannot be imported: {e}", allow_module_level=True)

from common.kv.buffers import RoomBuffers  # noqa: E402
from common.transfer.mooncake import MooncakeConfig, MooncakeEngine  # noqa: E402
from common.transfer.plan import TPRank, build_plan  # noqa: E402
from common.transfer.wire import room_from_protos, room_to_protos  # noqa: E402
from protos import pdflash_pb2 as pb  # noqa: E402

from parallel_kv import KVSpec, Split, d_rooms, expected_d_caches, p_rooms  # noqa: E402
from test_transfer_plan_kda import KDA_SPECS  # noqa: E402
from peer_process import Peer, serve  # noqa: E402


def _room(infos: list[bytes]) -> RoomBuffers:
    return room_from_protos(pb.BufferInfo.FromString(i) for i in infos)


def _peer_main(conn: Any) -> None:
    """P or D: an engine, the current layout's registered arrays, and a command loop."""
    engine = MooncakeEngine(MooncakeConfig(local_hostname="127.0.0.1"))
    engine.start()
    arrays: list[np.ndarray] = []  # alive while registered
    rooms: list[RoomBuffers] = []
    caches: dict[tuple[int, str], np.ndarray] = {}

    def place(arr: np.ndarray) -> int:
        arrays.append(arr)
        engine.register(arr.ctypes.data, arr.nbytes)
        return arr.ctypes.data

    def write(split: Split, session: str, d_infos: list[list[bytes]]) -> tuple[int, list[tuple[int, int]]]:
        """Plan every (P rank, D rank) pair first, so a bad bootstrap sends nothing, then write."""
        dst = [_room(infos) for infos in d_infos]
        plans = {
            (i, d_rank): build_plan("grid-room", rooms[i], dst[d_rank], split.num_tokens,
                                    src_tp=TPRank(p_rank, split.tp_p), dst_tp=TPRank(d_rank, split.tp_d))
            for i, (_, p_rank) in enumerate(split.p_ranks()) for d_rank in range(split.tp_d)
        }
        moved = engine.write(session, [e for plan in plans.values() for e in plan.entries])
        return moved, sorted(pair for pair, plan in plans.items() if plan.entries)

    def handle(cmd: str, args: list) -> Any:
        nonlocal rooms, caches
        if cmd in ("p_setup", "d_setup"):  # drop the previous layout, build this one
            for arr in arrays:
                engine.unregister(arr.ctypes.data)
            arrays.clear()
            if cmd == "p_setup":
                rooms, caches = p_rooms(args[0], place), {}
                return None
            rooms, caches = d_rooms(args[0], place)
            return engine.session_id
        if cmd == "d_describe":  # what each D rank sends P in Bootstrap; args: {rank: kv pages}
            for rank, pages in args[0].items():
                rooms[rank].indices["kv"] = pages
            return [[i.SerializeToString() for i in room_to_protos(room)] for room in rooms]
        if cmd == "d_caches":
            return {key: cache.copy() for key, cache in caches.items()}
        if cmd == "p_write":
            return write(*args)
        raise ValueError(f"unknown command {cmd}")

    serve(conn, engine, handle)


@pytest.fixture(scope="module")
def peers():
    p, d = Peer(_peer_main), Peer(_peer_main)
    yield p, d
    p.stop()
    d.stop()


def _specs(heads: int, layers: int = 2) -> tuple[KVSpec, ...]:
    # The drafter's KV: its own head size, one layer, computed on the last pipeline stage.
    return KVSpec("kv", layers, heads, 4), KVSpec("draft_kv", 1, heads, 8, staged=False)


SPLITS = (
    [Split(tp_p, tp_d, _specs(8)) for tp_p in (1, 2, 4, 8) for tp_d in (1, 2, 4, 8)]
    + [Split(tp_p, tp_d, _specs(2)) for tp_p in (1, 2, 4, 8) for tp_d in (4, 8)]  # fewer KV heads than TP_d
    + [Split(2, 4, _specs(8, layers=4), pp=2), Split(4, 2, _specs(8, layers=3), pp=3)]
    + [Split(2, 4, (KVSpec("kv", 2, 0, 16),))]  # latent KV
    # Kimi-Linear: latent KV and KDA state slots sliced by head (windows per q, k, v part)
    + [Split(tp_p, tp_d, KDA_SPECS) for tp_p, tp_d in ((1, 4), (4, 1), (2, 4), (4, 2))]
    + [Split(2, 1, KDA_SPECS, pp=3)]
)


def _setup(peers, split: Split) -> tuple[str, dict[tuple[int, str], np.ndarray]]:
    p, d = peers
    p.ok("p_setup", split)
    session = d.ok("d_setup", split)
    return session, d.ok("d_caches")


def _id(split: Split) -> str:
    heads = split.specs[0].heads
    kind = "kda" if split.specs == KDA_SPECS else f"{heads}heads" if heads else "latent"
    return f"pp{split.pp}-tp{split.tp_p}-to-tp{split.tp_d}-{kind}"


@pytest.mark.parametrize("split", SPLITS, ids=_id)
def test_each_d_rank_gets_its_head_slices(peers, split):
    p, d = peers
    session, before = _setup(peers, split)
    infos = d.ok("d_describe", {})

    moved, pairs = p.ok("p_write", split, session, infos)

    after = d.ok("d_caches")
    rooms = [_room(i) for i in infos]
    written = 0
    for key, exp in expected_d_caches(split, rooms, before).items():
        np.testing.assert_array_equal(after[key], exp.data, err_msg=f"D rank {key[0]}, {key[1]}")
        written += int(exp.written.sum())
    assert moved == written  # no byte sent twice (replicas send a head once)
    assert {d_rank for _, d_rank in pairs} == set(range(split.tp_d))


def test_bad_page_on_one_d_rank_sends_nothing(peers):
    p, d = peers
    split = Split(4, 8, _specs(8))
    session, before = _setup(peers, split)
    infos = d.ok("d_describe", {3: [0, 1, 2, split.num_pages]})  # D rank 3's last page is past the end

    reply = p.call("p_write", split, session, infos)

    assert reply[:2] == ("error", "TransferPlanError"), reply
    assert f"room grid-room, buffer kv: destination index {split.num_pages} out of range" in reply[2]
    after = d.ok("d_caches")
    for key in before:  # not even the other D ranks' bytes moved
        np.testing.assert_array_equal(after[key], before[key], err_msg=str(key))
