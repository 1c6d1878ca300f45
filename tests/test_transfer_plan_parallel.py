"""The transfer plan between parallel layouts, checked by applying it: P (pipeline stages x TP
ranks) and D (TP ranks) hold their caches as byte arrays at chosen addresses, every plan of
every (P rank, D rank) pair runs as memcpy while each destination byte counts its writes, and
each D rank must then hold exactly its heads' slices of the model's KV, every byte that should
be written written once, nothing else touched (tests/parallel_kv.py computes the expectation
with numpy slicing, not with the plan's arithmetic)."""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

from common.kv.buffers import PagedKVBuffer, RoomBuffers, SlotStateBuffer
from common.transfer.plan import (
    TPRank,
    TransferEntry,
    TransferPlan,
    TransferPlanError,
    build_plan,
    sender_heads,
    source_ranks,
)

from parallel_kv import KVSpec, Split, d_rooms, expected_d_caches, heads_of, p_rooms


class Memory:
    """Byte arrays placed at made-up addresses; each byte counts how often it was written."""

    def __init__(self, first: int):
        self.next = first
        self.bases: list[int] = []
        self.regions: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def place(self, arr: np.ndarray) -> int:
        base, self.next = self.next, self.next + (1 << 32)
        self.bases.append(base)
        self.regions[base] = (arr.reshape(-1), np.zeros(arr.size, dtype=np.int32))
        return base

    def writes(self, base: int, shape: tuple[int, ...]) -> np.ndarray:
        return self.regions[base][1].reshape(shape)

    def span(self, addr: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        base = self.bases[bisect.bisect_right(self.bases, addr) - 1]
        data, writes = self.regions[base]
        lo = addr - base
        assert 0 <= lo and lo + length <= data.size, f"entry {addr:#x}+{length} runs outside its region"
        return data[lo : lo + length], writes[lo : lo + length]


@dataclass
class Outcome:
    split: Split
    src: list[RoomBuffers]  # in split.p_ranks() order
    dst: list[RoomBuffers]  # by D rank
    plans: dict[tuple[int, int], TransferPlan]  # (P rank index in split.p_ranks(), D rank) -> plan

    def senders(self, d_rank: int) -> list[int]:
        return sorted(p for (p, d), plan in self.plans.items() if d == d_rank and plan.entries)


def transfer(split: Split, bad_d_page: tuple[int, int] | None = None) -> Outcome:
    """Build and apply every (P rank, D rank) plan, then check every D rank's caches and write
    counts. `bad_d_page` (D rank, page index) replaces that D rank's first kv page, to check
    that planning fails."""
    p_mem, d_mem = Memory(1 << 44), Memory(2 << 44)
    src = p_rooms(split, p_mem.place)
    dst, caches = d_rooms(split, d_mem.place)
    before = {key: cache.copy() for key, cache in caches.items()}
    if bad_d_page is not None:
        dst[bad_d_page[0]].indices["kv"][0] = bad_d_page[1]
    out = Outcome(split, src, dst, {})
    for i, (_, p_rank) in enumerate(split.p_ranks()):
        for d_rank in range(split.tp_d):
            out.plans[i, d_rank] = build_plan("room-7", src[i], dst[d_rank], split.num_tokens,
                                              src_tp=TPRank(p_rank, split.tp_p), dst_tp=TPRank(d_rank, split.tp_d))
    for plan in out.plans.values():
        for e in plan.entries:
            data, _ = p_mem.span(e.src_addr, e.length)
            target, writes = d_mem.span(e.dst_addr, e.length)
            target[:] = data
            writes += 1

    for (rank, name), exp in expected_d_caches(split, dst, before).items():
        where = f"D rank {rank}, {name}, {split}"
        np.testing.assert_array_equal(caches[rank, name], exp.data, err_msg=where)
        base = next(b.base_addr for b in dst[rank].buffers if b.name == name)
        np.testing.assert_array_equal(d_mem.writes(base, exp.data.shape), exp.written.astype(np.int32), err_msg=where)
    return out


# The users' shape: P TP4 -> D TP32, 8 KV heads (each D rank holds one head, replicated 4x; each
# P rank holds two), bf16, plus the drafter's KV (8 heads x 128 dims, one layer).
USERS_SPECS = (KVSpec("kv", 2, 8, 128), KVSpec("draft_kv", 1, 8, 128))


@pytest.mark.parametrize("page_size,num_tokens", [(1, 5), (16, 1), (16, 37), (64, 129)])
def test_users_shape_tp4_to_tp32(page_size, num_tokens):
    split = Split(tp_p=4, tp_d=32, specs=USERS_SPECS, page_size=page_size, dtype="bfloat16", num_tokens=num_tokens,
                  num_pages=-(-num_tokens // page_size) + 3)
    out = transfer(split)
    for d_rank in range(32):
        head = d_rank // 4
        assert out.senders(d_rank) == [head // 2]  # the one P rank holding its head
        plan = out.plans[head // 2, d_rank]
        assert plan.entries == users_shape_entries(split, out.src[head // 2], out.dst[d_rank], head)


def users_shape_entries(split: Split, src: RoomBuffers, dst: RoomBuffers, head: int) -> list[TransferEntry]:
    """The entries written out by hand: per buffer (by name, as build_plan goes), layer, k/v and
    token, one 256-byte head; P's token rows are two heads wide, D's one."""
    entries = []
    for s, d in zip(sorted(src.buffers, key=lambda b: b.name), sorted(dst.buffers, key=lambda b: b.name)):
        s_pages, d_pages = src.indices[s.name], dst.indices[d.name]
        entries += [
            TransferEntry(
                s.page_addr(layer, kv, s_pages[t // split.page_size]) + (t % split.page_size) * 2 * 256
                + (head - s.head_start) * 256,
                d.page_addr(layer, kv, d_pages[t // split.page_size]) + (t % split.page_size) * 256,
                256,
            )
            for layer in range(s.num_layers) for kv in range(2) for t in range(split.num_tokens)
        ]
    return entries


GRID = [(p, d) for p in (1, 2, 4, 8, 16) for d in (1, 2, 4, 8, 16, 32)]


@pytest.mark.parametrize("heads", [8, 2])
@pytest.mark.parametrize("tp_p,tp_d", GRID)
def test_every_tp_pair_moves_each_head_once(tp_p, tp_d, heads):
    split = Split(tp_p, tp_d, (KVSpec("kv", 2, heads, 4), KVSpec("draft_kv", 1, heads, 8)), num_tokens=9)
    out = transfer(split)
    for d_rank in range(tp_d):
        expected = set()
        for spec in split.specs:
            expected |= set(source_ranks(d_rank, heads_of(spec, d_rank, tp_d), tp_p, heads))
        assert out.senders(d_rank) == sorted(expected)
    # Replicas share the work: no P rank serves more D ranks than an even spread would give it.
    pairs = [p for (p, _), plan in out.plans.items() if plan.entries]
    assert max(pairs.count(p) for p in set(pairs)) == math.ceil(len(pairs) / tp_p)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 4), (4, 8), (8, 2), (2, 2)])
def test_latent_kv_is_whole_pages_from_one_p_rank(tp_p, tp_d):
    split = Split(tp_p, tp_d, (KVSpec("kv", 3, 0, 16),), num_tokens=10)
    out = transfer(split)
    page_bytes = split.page_size * 16 * 4
    for d_rank in range(tp_d):
        assert out.senders(d_rank) == [d_rank % tp_p] == source_ranks(d_rank, range(0), tp_p, 0)
        assert all(e.length % page_bytes == 0 for e in out.plans[d_rank % tp_p, d_rank].entries)


@pytest.mark.parametrize("pp,tp_p,tp_d,layers", [(2, 1, 1, 4), (3, 2, 4, 5), (4, 4, 2, 4), (2, 8, 32, 3)])
def test_pipeline_stages_each_write_their_layers(pp, tp_p, tp_d, layers):
    """Each stage sends its own layers into D's all-layer buffers; the drafter's KV comes from
    the last stage only (the other stages do not have it, and that is not an error)."""
    split = Split(tp_p, tp_d, (KVSpec("kv", layers, 8, 4), KVSpec("draft_kv", 1, 8, 8, staged=False)), pp=pp,
                  num_tokens=11)
    out = transfer(split)  # checks every layer's bytes (and the drafter's) written exactly once
    for d_rank in range(tp_d):
        assert {split.p_ranks()[p][0] for p in out.senders(d_rank)} == set(range(pp))


def _kv(base: int, *, layers: int, layer_start: int = 0, total_layers: int = 4, heads: int = 2, head_start: int = 0,
        total_heads: int = 2, pages: int = 4) -> PagedKVBuffer:
    return PagedKVBuffer("kv", base, layers, pages, 2, heads, head_start, total_heads, 4, "float32",
                         layer_start=layer_start, total_layers=total_layers)


def test_only_the_common_layers_move_onto_the_same_global_layers():
    s = _kv(0x1000_0000, layers=2, layer_start=2)  # a stage with layers 2, 3
    d = _kv(0x2000_0000, layers=2, layer_start=1)  # a D holding layers 1, 2
    plan = build_plan("r", RoomBuffers([s], {"kv": [0]}), RoomBuffers([d], {"kv": [3]}), num_tokens=2)
    # Global layer 2 is local layer 0 on P and local layer 1 on D; K and V pages are adjacent
    # on neither side, so two whole-page entries.
    assert [(e.src_addr, e.dst_addr, e.length) for e in plan.entries] == [
        (s.page_addr(0, kv, 0), d.page_addr(1, kv, 3), s.bytes_per_page) for kv in range(2)
    ]

    far = _kv(0x2000_0000, layers=2, layer_start=0)  # D holding layers 0, 1 only
    assert build_plan("r", RoomBuffers([s], {"kv": [0]}), RoomBuffers([far], {"kv": [3]}), 2).entries == []


@pytest.mark.parametrize("src,dst,match", [
    (dict(layers=2, layer_start=2), dict(layers=5, total_layers=5), "total_layers differs"),
    (dict(layers=2, layer_start=3), dict(layers=4), r"source layers \[3, 5\) exceed total_layers 4"),
])
def test_bad_layer_ranges_are_errors(src, dst, match):
    s, d = _kv(0x1000_0000, **src), _kv(0x2000_0000, **dst)
    with pytest.raises(TransferPlanError, match=match):
        build_plan("r", RoomBuffers([s], {"kv": [0]}), RoomBuffers([d], {"kv": [0]}), 2)


def test_destination_only_buffer_is_an_error_unless_the_source_is_a_stage():
    d_draft = PagedKVBuffer("draft_kv", 0x3000_0000, 1, 4, 2, 2, 0, 2, 4, "float32")
    d = RoomBuffers([_kv(0x2000_0000, layers=4), d_draft], {"kv": [0], "draft_kv": [0]})
    whole = RoomBuffers([_kv(0x1000_0000, layers=4)], {"kv": [0]})
    with pytest.raises(TransferPlanError, match=r"only on destination: \['draft_kv'\]"):
        build_plan("r", whole, d, 2)
    stage = RoomBuffers([_kv(0x1000_0000, layers=2)], {"kv": [0]})
    assert len(build_plan("r", stage, d, 2).entries) == 2 * 2  # layers 0-1 x K/V, one page each


def test_bad_page_on_one_d_rank_fails_every_plan_toward_it():
    """Users' shape, D rank 5's first kv page out of range: every P rank's plan toward it raises
    (the one that sends and the ones that would send nothing), the other D ranks plan fine."""
    split = Split(tp_p=4, tp_d=32, specs=USERS_SPECS, page_size=16, dtype="bfloat16", num_tokens=20, num_pages=4)
    for bad in (4, -1):
        with pytest.raises(TransferPlanError, match=f"room room-7, buffer kv: destination index {bad} out of range"):
            transfer(split, bad_d_page=(5, bad))
    src = p_rooms(split, Memory(1 << 44).place)
    dst, _ = d_rooms(split, Memory(2 << 44).place)
    dst[5].indices["kv"][1] = 4
    for p_rank in range(4):
        with pytest.raises(TransferPlanError, match="destination index 4 out of range"):
            build_plan("room-7", src[p_rank], dst[5], 20, src_tp=TPRank(p_rank, 4), dst_tp=TPRank(5, 32))
        build_plan("room-7", src[p_rank], dst[6], 20, src_tp=TPRank(p_rank, 4), dst_tp=TPRank(6, 32))


def test_rank_and_layout_must_agree():
    s = _kv(0x1000_0000, layers=4, heads=1, head_start=1, total_heads=2)  # what TP rank 1 of 2 holds
    d = _kv(0x2000_0000, layers=4, heads=2, total_heads=2)
    room_s, room_d = RoomBuffers([s], {"kv": [0]}), RoomBuffers([d], {"kv": [0]})
    assert build_plan("r", room_s, room_d, 2, src_tp=TPRank(1, 2), dst_tp=TPRank(0, 1)).entries
    with pytest.raises(TransferPlanError, match=r"rank 0 of TP 2 holds heads \[1, 2\) of 2"):
        build_plan("r", room_s, room_d, 2, src_tp=TPRank(0, 2), dst_tp=TPRank(0, 1))
    with pytest.raises(TransferPlanError, match=r"rank 0 of TP 4 holds heads \[1, 2\) of 2"):  # D is checked too
        build_plan("r", room_s, room_s, 2, src_tp=TPRank(1, 2), dst_tp=TPRank(0, 4))
    with pytest.raises(TransferPlanError, match="both src_tp and dst_tp or neither"):
        build_plan("r", room_s, room_d, 2, src_tp=TPRank(1, 2))


def test_state_slot_sends_the_head_intersection_of_each_part():
    """KDA convolution windows, 4 heads of 12 bytes per part, 3 parts (q, k, v): P TP 2 rank 1
    (heads 2-3) to D TP 4 rank 2 (head 2) is one 12-byte run per layer and part, written out by
    hand; D rank 0 (head 0) gets nothing from it. Slots are [part, head, bytes]."""
    s = SlotStateBuffer("kda_conv", 0x1000_0000, 2, 4, 3 * 2 * 12, "float32", parts=3, num_heads=2, head_start=2,
                        total_heads=4)
    d = SlotStateBuffer("kda_conv", 0x2000_0000, 2, 5, 3 * 1 * 12, "float32", parts=3, num_heads=1, head_start=2,
                        total_heads=4)
    room_s, room_d = RoomBuffers([s], {"kda_conv": [1]}), RoomBuffers([d], {"kda_conv": [3]})
    plan = build_plan("r", room_s, room_d, 1, src_tp=TPRank(1, 2), dst_tp=TPRank(2, 4))
    assert [(e.src_addr, e.dst_addr, e.length) for e in plan.entries] == [
        (0x1000_0000 + (layer * 4 + 1) * 72 + part * 24, 0x2000_0000 + (layer * 5 + 3) * 36 + part * 12, 12)
        for layer in range(2) for part in range(3)]
    d0 = dataclasses.replace(d, head_start=0)
    assert build_plan("r", room_s, RoomBuffers([d0], {"kda_conv": [3]}), 1,
                      src_tp=TPRank(1, 2), dst_tp=TPRank(0, 4)).entries == []
    with pytest.raises(TransferPlanError, match="parts differs"):
        build_plan("r", room_s, RoomBuffers([dataclasses.replace(d, parts=1, bytes_per_slot=12)], {"kda_conv": [3]}),
                   1, src_tp=TPRank(1, 2), dst_tp=TPRank(2, 4))


def test_sender_heads_rule():
    # P TP16 over 8 heads: head 3 lives on P ranks 6 and 7; D TP32 ranks 12-15 need it.
    assert [sender_heads(p, 16, range(3, 4), d, range(3, 4), 8) for d in (12, 13, 14, 15) for p in (6, 7)] == [
        range(3, 4), range(0), range(0), range(3, 4), range(3, 4), range(0), range(0), range(3, 4)]
    # Every P rank holding every head (tp 4): D rank d takes them all from P rank d % 4.
    assert sender_heads(1, 4, range(0, 8), 5, range(4, 6), 8) == range(4, 6)
    assert sender_heads(2, 4, range(0, 8), 5, range(4, 6), 8) == range(0)
    with pytest.raises(ValueError, match="not an even split"):
        sender_heads(0, 3, range(0, 3), 0, range(0, 8), 8)
