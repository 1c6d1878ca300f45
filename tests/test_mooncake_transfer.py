"""Real Mooncake TCP transfers between two processes on 127.0.0.1 (P2P handshake).

Each peer process owns torch CPU tensors registered with its own engine and answers commands
over a pipe: fill with seeded random data, describe its buffers (as protobuf BufferInfo, the
way Bootstrap carries them), report per-(layer, k/v, page, head) CRC32 checksums, or write a
room to a peer through the transfer plan. The destination's checksums are compared with the
source's: transferred pages must match, everything else must be unchanged.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

try:
    import mooncake.engine  # noqa: F401  (fails without the wheel or without libibverbs1)
except ImportError as e:
    pytest.skip(f"mooncake.engine cannot be imported: {e}", allow_module_level=True)
torch = pytest.importorskip("torch")

from common.transfer.mooncake import MooncakeConfig, MooncakeEngine, TransferError, check_allocator_env  # noqa: E402
from common.transfer.wire import room_from_protos  # noqa: E402
from protos import pdflash_pb2 as pb  # noqa: E402

from freeze import freeze  # noqa: E402
from peer_process import REPLY_TIMEOUT_S, Peer, serve  # noqa: E402

# name -> (layers, pages, page_size, num_heads, head_start, total_heads, head_dim) or
# name -> (layers, slots, bytes_per_slot) for state slots.
EQUAL_SPECS: dict[str, tuple] = {
    "kv": (3, 12, 4, 2, 0, 2, 8),
    "draft_kv": (1, 6, 4, 1, 0, 1, 8),
    "state": (3, 4, 256),
}


def _peer_main(conn: Any, specs: dict[str, tuple], config: MooncakeConfig = MooncakeConfig("127.0.0.1")) -> None:
    """One P or D process: an engine, its registered tensors, and a command loop."""
    import torch

    from common.kv.buffers import PagedKVBuffer, RoomBuffers, SlotStateBuffer
    from common.transfer.plan import TransferEntry, build_plan
    from common.transfer.wire import room_to_protos

    engine = MooncakeEngine(config)
    engine.start()
    tensors: dict[str, torch.Tensor] = {}
    buffers: dict[str, PagedKVBuffer | SlotStateBuffer] = {}
    for name, spec in specs.items():
        if len(spec) == 7:
            layers, pages, page_size, heads, head_start, total, dim = spec
            t = torch.zeros(layers, 2, pages, page_size, heads, dim, dtype=torch.float32)
            buffers[name] = PagedKVBuffer(name, t.data_ptr(), layers, pages, page_size, heads, head_start, total,
                                          dim, "float32")
        else:
            layers, slots, nbytes = spec
            t = torch.zeros(layers, slots, nbytes // 4, dtype=torch.float32)
            buffers[name] = SlotStateBuffer(name, t.data_ptr(), layers, slots, nbytes, "float32")
        assert t.numel() * 4 == buffers[name].length
        engine.register(t.data_ptr(), buffers[name].length)
        tensors[name] = t

    def checksums() -> dict[tuple, int]:
        out = {}
        for name, t in tensors.items():
            if t.dim() == 6:  # [layer, k/v, page, token, head, dim]
                for l, k, p, h in ((l, k, p, h) for l in range(t.shape[0]) for k in range(2)
                                   for p in range(t.shape[2]) for h in range(t.shape[4])):
                    out[name, l, k, p, h] = zlib.crc32(t[l, k, p, :, h].contiguous().numpy().tobytes())
            else:  # [layer, slot, ...]
                for l in range(t.shape[0]):
                    for s in range(t.shape[1]):
                        out[name, l, s] = zlib.crc32(t[l, s].numpy().tobytes())
        return out

    def handle(cmd: str, args: list) -> Any:
        if cmd == "fill":
            gen = torch.Generator().manual_seed(args[0])
            for t in tensors.values():
                t.copy_(torch.randn(t.shape, generator=gen))
            return None
        if cmd == "describe":  # what D sends P in Bootstrap
            room = RoomBuffers(list(buffers.values()), args[0])
            return engine.session_id, [i.SerializeToString() for i in room_to_protos(room)]
        if cmd == "checksums":
            return checksums()
        if cmd == "write":  # P side: plan from both descriptions, then write
            peer, dst_infos, src_indices, num_tokens = args
            dst = room_from_protos(pb.BufferInfo.FromString(b) for b in dst_infos)
            plan = build_plan("test-room", RoomBuffers(list(buffers.values()), src_indices), dst, num_tokens)
            return engine.write(peer, plan.entries), len(plan.entries), len(plan.batches)
        if cmd == "write_raw":  # bypasses the plan's checks: the engine must refuse on its own
            peer, dst_addr, length = args
            return engine.write(peer, [TransferEntry(buffers["kv"].base_addr, dst_addr, length)])
        raise ValueError(f"unknown command {cmd}")

    serve(conn, engine, handle)


@pytest.fixture(scope="module")
def pair():
    src, dst = Peer(_peer_main, EQUAL_SPECS), Peer(_peer_main, EQUAL_SPECS)
    yield src, dst
    src.stop()
    dst.stop()


def _fresh(pair, seed: int) -> None:
    src, dst = pair
    src.ok("fill", seed)
    dst.ok("fill", seed + 1)


def test_pages_arrive_intact_and_others_stay_untouched(pair):
    src, dst = pair
    _fresh(pair, 10)
    src_idx = {"kv": [3, 4, 5, 9], "draft_kv": [0, 1, 2, 3], "state": [1]}
    dst_idx = {"kv": [10, 11, 0, 7, 8], "draft_kv": [5, 4, 2, 3], "state": [3]}  # kv: one spare page
    num_tokens = 14  # 3.5 pages: the last page goes whole
    session, infos = dst.ok("describe", dst_idx)
    before, src_sums = dst.ok("checksums"), src.ok("checksums")

    moved, n_entries, _ = src.ok("write", session, infos, src_idx, num_tokens)

    after = dst.ok("checksums")
    kv_page, draft_page = 4 * 2 * 8 * 4, 4 * 1 * 8 * 4  # tokens x heads x dim x fp32
    assert moved == 3 * 2 * 4 * kv_page + 1 * 2 * 4 * draft_page + 3 * 256
    # Entries per (layer, k/v) block after merging: kv 3,4 -> 10,11 | 5 -> 0 | 9 -> 7;
    # draft_kv 0 -> 5 | 1 -> 4 | 2,3 -> 2,3; state one per layer.
    assert n_entries == 3 * 2 * 3 + 1 * 2 * 3 + 3
    expected = dict(before)
    for name, layers, heads in (("kv", 3, 2), ("draft_kv", 1, 1)):
        for sp, dp in zip(src_idx[name], dst_idx[name]):
            for l in range(layers):
                for k in range(2):
                    for h in range(heads):
                        expected[name, l, k, dp, h] = src_sums[name, l, k, sp, h]
    for l in range(3):
        expected["state", l, 3] = src_sums["state", l, 1]
    assert after == expected
    assert after["kv", 0, 0, 8, 0] == before["kv", 0, 0, 8, 0]  # the spare page was not written


def test_plan_error_submits_nothing_and_peer_survives(pair):
    src, dst = pair
    _fresh(pair, 20)
    session, infos = dst.ok("describe", {"kv": [0, 12], "draft_kv": [0, 1], "state": [0]})  # page 12 of 12
    before = dst.ok("checksums")
    reply = src.call("write", session, infos, {"kv": [0, 1], "draft_kv": [0, 1], "state": [0]}, 8)
    assert reply[0] == "error" and reply[1] == "TransferPlanError"
    assert "room test-room, buffer kv" in reply[2] and "index 12 out of range" in reply[2]
    assert dst.ok("checksums") == before  # not even the valid buffers were sent

    session, infos = dst.ok("describe", {"kv": [0, 1], "draft_kv": [0, 1], "state": [0]})
    assert src.ok("write", session, infos, {"kv": [0, 1], "draft_kv": [0, 1], "state": [0]}, 8)[0] > 0


def test_unregistered_destination_raises_transfer_error(pair):
    src, dst = pair
    session, infos = dst.ok("describe", {})
    kv = next(b for b in room_from_protos(pb.BufferInfo.FromString(i) for i in infos).buffers if b.name == "kv")
    for dst_addr, length in ((kv.base_addr + kv.length - 16, 64), (0x1000, 64)):  # straddles the end; unmapped
        reply = src.call("write_raw", session, dst_addr, length)
        assert reply[:2] == ("error", "TransferError") and "rc=-1" in reply[2], reply
    reply = src.call("write_raw", "127.0.0.1:1", kv.base_addr, 64)  # nobody listens there
    assert reply[:2] == ("error", "TransferError"), reply
    assert src.ok("write_raw", session, kv.base_addr, 64) == 64  # the engine still works afterwards


FROZEN_IDX = {"kv": [0, 1], "draft_kv": [0, 1], "state": [0]}  # 11 entries
# 6 pages each way round (no two entries merge): 36 + 12 + 3 entries, more than a write keeps in
# flight at once (2 per TCP lane, 16 lanes)
SCATTERED_SRC = {"kv": list(range(6)), "draft_kv": list(range(6)), "state": [0]}
SCATTERED_DST = {"kv": list(range(5, -1, -1)), "draft_kv": list(range(5, -1, -1)), "state": [0]}


def _write_to_frozen(dst: Peer, src: Peer, resume_after_s: float | None, src_idx: dict = FROZEN_IDX,
                     dst_idx: dict = FROZEN_IDX, num_tokens: int = 8) -> tuple[tuple, float]:
    """src writes a room to dst while dst is stopped (SIGSTOP), after a first write has set up
    the connections; dst resumes after `resume_after_s` (None: when the write has returned)."""
    session, infos = dst.ok("describe", dst_idx)
    assert src.ok("write", session, infos, src_idx, num_tokens)[0] > 0  # handshake and lanes before the freeze
    src.ok("fill", 77)  # new bytes, so that the test sees whether they landed
    freeze(dst.proc.pid)
    start = time.monotonic()  # before the timer: a write that waits for the resume takes its time at least
    resume = None
    if resume_after_s is not None:
        resume = threading.Timer(resume_after_s, os.kill, (dst.proc.pid, signal.SIGCONT))
        resume.start()
    try:
        reply = src.call("write", session, infos, src_idx, num_tokens)
        return reply, time.monotonic() - start
    finally:
        if resume is not None:
            resume.join()
        os.kill(dst.proc.pid, signal.SIGCONT)


@pytest.fixture
def short_deadline_src(monkeypatch) -> Iterator[Peer]:
    """A source peer whose writes have a 5 s deadline (the floor) and keep 2 entries per lane,
    32, in flight whatever their size (this test's entries are small)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # floored to 5 s; a spawned peer inherits it
    src = Peer(_peer_main, EQUAL_SPECS, MooncakeConfig("127.0.0.1", tcp_in_flight_bytes=1))
    yield src
    src.stop()


def test_write_all_in_flight_at_the_deadline_waits_for_it(pair, short_deadline_src):
    """D stops reading for 8 s, past P's 5 s deadline, after the room's 11 entries have all been
    submitted. Mooncake cannot cancel them, and they land when D resumes: the write waits for
    them and succeeds, late, rather than returning with bytes still on their way into pages
    that P and D would then free."""
    _, dst = pair
    src = short_deadline_src
    reply, took = _write_to_frozen(dst, src, resume_after_s=8)
    assert reply[0] == "ok" and reply[1][0] > 0, reply
    assert 8 <= took < 12, took
    sent, got = src.ok("checksums"), dst.ok("checksums")
    written = [k for k in sent if k[0] != "state" and k[3] in FROZEN_IDX[k[0]]]
    assert written and all(got[k] == sent[k] for k in written)


def test_write_past_its_deadline_stops_submitting_and_drains(pair, short_deadline_src):
    """A room of 51 entries to a D stopped for 8 s: 32 go in flight, the deadline passes at 5 s
    with the rest unsubmitted; the write submits nothing more, waits until the 32 have landed
    (D resumed), and fails saying so."""
    _, dst = pair
    reply, took = _write_to_frozen(dst, short_deadline_src, 8, SCATTERED_SRC, SCATTERED_DST, num_tokens=24)
    assert reply[:2] == ("error", "TransferError"), reply
    assert "deadline passed with 19 entries not submitted" in reply[2], reply
    assert 8 <= took < 12, took


def test_write_to_a_frozen_peer_fails_when_mooncake_gives_up(pair, monkeypatch):
    """D never resumes during the write: it ends when Mooncake's TCP transport has failed every
    stalled entry. A lane drops its connection after MC_TCP_PROGRESS_TIMEOUT_SEC without
    progress (30 s by default, 8 s here; 11 entries, each on a lane of its own)."""
    _, dst = pair
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "8")
    src = Peer(_peer_main, EQUAL_SPECS)
    try:
        reply, took = _write_to_frozen(dst, src, resume_after_s=None)
        assert reply[:2] == ("error", "TransferError") and "11 of the 11 submitted entries failed" in reply[2], reply
        assert 7.5 <= took < 20, took
        session, infos = dst.ok("describe", FROZEN_IDX)
        assert src.ok("write", session, infos, FROZEN_IDX, 8)[0] > 0
    finally:
        src.stop()


def test_head_range_intersection_over_two_batches():
    """P holds heads 0-3 of 4, D holds heads 2-3: per-token entries, 4 x 2 x 192 = 1536 of
    them, so the engine must split them into two batches (<= 1024 each)."""
    src = Peer(_peer_main, {"kv": (4, 16, 16, 4, 0, 4, 8)})
    dst = Peer(_peer_main, {"kv": (4, 16, 16, 2, 2, 4, 8)})
    try:
        src.ok("fill", 30)
        dst.ok("fill", 31)
        src_pages, dst_pages = list(range(12)), [15 - p for p in range(12)]
        session, infos = dst.ok("describe", {"kv": dst_pages})
        before, src_sums = dst.ok("checksums"), src.ok("checksums")
        moved, n_entries, n_batches = src.ok("write", session, infos, {"kv": src_pages}, 192)
        assert (n_entries, n_batches) == (1536, 2)
        assert moved == 1536 * 2 * 8 * 4
        expected = dict(before)
        for sp, dp in zip(src_pages, dst_pages):
            for l in range(4):
                for k in range(2):
                    for h in (2, 3):  # global head h is local h-2 on D
                        expected["kv", l, k, dp, h - 2] = src_sums["kv", l, k, sp, h]
        assert dst.ok("checksums") == expected
    finally:
        src.stop()
        dst.stop()


def _start_rdma(conn: Any) -> None:
    # A fresh process as a service starts: a TCP engine started earlier in this test worker set
    # MC_FORCE_TCP in its environment (MooncakeEngine does, for Mooncake to read), which the
    # spawned child inherits.
    os.environ.pop("MC_FORCE_TCP", None)
    try:
        MooncakeEngine(MooncakeConfig(protocol="rdma")).start()
        conn.send("started")
    except TransferError as e:
        conn.send(str(e))


@pytest.mark.skipif(bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")),
                    reason="this host has RDMA devices")
def test_rdma_without_devices_is_refused():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_start_rdma, args=(child,))
    proc.start()
    assert parent.poll(REPLY_TIMEOUT_S)
    assert "no RDMA device" in parent.recv()
    proc.join(10)


def test_expandable_segments_are_refused(monkeypatch):
    check_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6,expandable_segments:True")
    with pytest.raises(TransferError, match="expandable"):
        MooncakeEngine(MooncakeConfig()).start()
