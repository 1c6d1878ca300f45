"""The transfer plan, checked by applying it: each entry is a memcpy between two fake address
spaces (numpy byte arrays at chosen base addresses), then the destination tensors are compared
with the source slices the plan was supposed to move."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from common.kv.buffers import PagedKVBuffer, RoomBuffers, SlotStateBuffer
from common.transfer.plan import (
    MAX_BATCH_ENTRIES,
    TransferEntry,
    TransferPlan,
    TransferPlanError,
    build_plan,
    split_batches,
)
from common.transfer.wire import buffer_to_proto, room_from_protos, room_to_protos
from protos import pdflash_pb2 as pb

SRC_BASE, DST_BASE = 0x10_0000_0000, 0x20_0000_0000


class FakeMemory:
    """An address space of byte arrays placed at chosen base addresses."""

    def __init__(self, seed: int):
        self.regions: dict[int, np.ndarray] = {}
        self.rng = np.random.default_rng(seed)

    def alloc(self, base: int, nbytes: int) -> np.ndarray:
        region = self.rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.regions[base] = region
        return region

    def view(self, addr: int, length: int) -> np.ndarray:
        for base, region in self.regions.items():
            if base <= addr < base + region.size:
                assert addr + length <= base + region.size, "entry runs past its region"
                return region[addr - base : addr - base + length]
        raise AssertionError(f"address {addr:#x} is in no region")


def apply(plan: TransferPlan, src: FakeMemory, dst: FakeMemory) -> None:
    for e in plan.entries:
        dst.view(e.dst_addr, e.length)[:] = src.view(e.src_addr, e.length)


def paged(mem: FakeMemory, base: int, name: str = "kv", *, layers: int = 2, pages: int = 8, page_size: int = 4,
          heads: int = 2, head_start: int = 0, total_heads: int | None = None, head_dim: int = 4,
          kv_planes: int = 2) -> tuple[PagedKVBuffer, np.ndarray]:
    buf = PagedKVBuffer(name, base, layers, pages, page_size, heads, head_start,
                        heads if total_heads is None else total_heads, head_dim, "float32", kv_planes)
    arr = mem.alloc(base, buf.length).view(np.float32)
    return buf, arr.reshape(layers, kv_planes, pages, page_size, max(heads, 1), head_dim)


def slots(mem: FakeMemory, base: int, name: str = "state", *, layers: int = 3, num_slots: int = 5,
          slot_bytes: int = 64) -> tuple[SlotStateBuffer, np.ndarray]:
    buf = SlotStateBuffer(name, base, layers, num_slots, slot_bytes, "float32")
    return buf, mem.alloc(base, buf.length).reshape(layers, num_slots, slot_bytes)


def room(buf_indices: dict) -> RoomBuffers:
    """{name: (buffer, indices)} -> RoomBuffers."""
    return RoomBuffers([b for b, _ in buf_indices.values()], {k: i for k, (_, i) in buf_indices.items()})


@pytest.fixture
def mems() -> tuple[FakeMemory, FakeMemory]:
    return FakeMemory(1), FakeMemory(2)


def test_equal_heads_sends_whole_pages_merged_where_contiguous(mems):
    src_mem, dst_mem = mems
    s, s_arr = paged(src_mem, SRC_BASE)
    d, d_arr = paged(dst_mem, DST_BASE)
    before = d_arr.copy()
    sp, dp = [2, 3, 4, 7], [5, 6, 7, 1]
    plan = build_plan("r1", room({"kv": (s, sp)}), room({"kv": (d, dp)}), num_tokens=14)  # last page partial

    # Per (layer, k/v) block: src run 2-4 maps onto dst run 5-7 (one entry), then 7 -> 1.
    assert [e.length for e in plan.entries] == [3 * s.bytes_per_page, s.bytes_per_page] * 4
    assert plan.total_bytes == 2 * 2 * 4 * s.bytes_per_page
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_arr[:, :, dp], s_arr[:, :, sp])  # last page whole
    untouched = [p for p in range(8) if p not in dp]
    np.testing.assert_array_equal(d_arr[:, :, untouched], before[:, :, untouched])


def test_fully_contiguous_room_is_one_entry(mems):
    src_mem, dst_mem = mems
    s, s_arr = paged(src_mem, SRC_BASE, pages=4)
    d, d_arr = paged(dst_mem, DST_BASE, pages=4)
    plan = build_plan("r", room({"kv": (s, [0, 1, 2, 3])}), room({"kv": (d, [0, 1, 2, 3])}), num_tokens=16)
    assert plan.entries == [TransferEntry(SRC_BASE, DST_BASE, s.length)]
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_arr, s_arr)


def test_only_pages_covering_num_tokens_are_sent(mems):
    src_mem, dst_mem = mems
    s, s_arr = paged(src_mem, SRC_BASE)
    d, d_arr = paged(dst_mem, DST_BASE)
    before = d_arr.copy()
    plan = build_plan("r", room({"kv": (s, [0, 1, 2, 3])}), room({"kv": (d, [4, 5, 6, 7])}), num_tokens=5)
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_arr[:, :, [4, 5]], s_arr[:, :, [0, 1]])
    np.testing.assert_array_equal(d_arr[:, :, [6, 7]], before[:, :, [6, 7]])
    assert plan.total_bytes == 2 * 2 * 2 * s.bytes_per_page


@pytest.mark.parametrize("src_heads,dst_heads", [((0, 4), (2, 4)), ((2, 4), (0, 4)), ((0, 8), (3, 2))])
def test_head_range_intersection_per_token(mems, src_heads, dst_heads):
    """P holds heads [a, a+n) of 8 and D holds [b, b+m): only the common heads move, per token."""
    src_mem, dst_mem = mems
    (s0, sn), (d0, dn) = src_heads, dst_heads
    s, s_arr = paged(src_mem, SRC_BASE, heads=sn, head_start=s0, total_heads=8)
    d, d_arr = paged(dst_mem, DST_BASE, heads=dn, head_start=d0, total_heads=8)
    before = d_arr.copy()
    sp, dp, num_tokens = [3, 1], [6, 2], 6
    plan = build_plan("r", room({"kv": (s, sp)}), room({"kv": (d, dp)}), num_tokens)

    lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
    head_bytes = s.head_dim * 4
    assert len(plan.entries) == 2 * 2 * num_tokens  # one per (layer, k/v, token): strides differ
    assert all(e.length == (hi - lo) * head_bytes for e in plan.entries)
    first = plan.entries[0]  # layer 0, K, token 0
    assert first.src_addr == s.page_addr(0, 0, sp[0]) + (lo - s0) * head_bytes
    assert first.dst_addr == d.page_addr(0, 0, dp[0]) + (lo - d0) * head_bytes

    apply(plan, src_mem, dst_mem)
    expected = before.copy()
    for t in range(num_tokens):
        page, slot = divmod(t, s.page_size)
        expected[:, :, dp[page], slot, lo - d0 : hi - d0] = s_arr[:, :, sp[page], slot, lo - s0 : hi - s0]
    np.testing.assert_array_equal(d_arr, expected)  # also: other heads and tokens 6, 7 untouched


@pytest.mark.parametrize("src_heads,dst_heads", [((0, 2), (0, 2)), ((0, 4), (2, 2))])
def test_parts_from_a_start_token_add_up_to_the_whole_plan(mems, src_heads, dst_heads):
    """P sends a prompt's pages chunk by chunk (`starts`): pages [0, 1), then [1, 3), then the rest
    write what one whole plan writes, no byte twice, whether whole pages or token rows move."""
    src_mem, dst_mem = mems
    (s0, sn), (d0, dn) = src_heads, dst_heads
    s, _ = paged(src_mem, SRC_BASE, heads=sn, head_start=s0, total_heads=4)
    d, d_arr = paged(dst_mem, DST_BASE, heads=dn, head_start=d0, total_heads=4)
    src, dst, num_tokens = room({"kv": (s, [3, 0, 5, 1])}), room({"kv": (d, [6, 2, 4, 7])}), 14
    whole = build_plan("r", src, dst, num_tokens)
    parts = [build_plan("r", src, dst, stop, starts={"kv": start}) for start, stop in ((0, 4), (4, 12), (12, num_tokens))]
    assert sum(p.total_bytes for p in parts) == whole.total_bytes and all(p.entries for p in parts)
    before = d_arr.copy()
    for p in parts:
        apply(p, src_mem, dst_mem)
    by_parts, d_arr[:] = d_arr.copy(), before
    apply(whole, src_mem, dst_mem)
    np.testing.assert_array_equal(by_parts, d_arr)
    assert not (by_parts == before).all()
    with pytest.raises(TransferPlanError, match="not a page boundary"):
        build_plan("r", src, dst, num_tokens, starts={"kv": 2})
    assert build_plan("r", src, dst, 12, starts={"kv": 12}).entries == []  # nothing left to send


def test_disjoint_head_ranges_send_nothing(mems):
    src_mem, dst_mem = mems
    s, _ = paged(src_mem, SRC_BASE, heads=4, head_start=0, total_heads=8)
    d, _ = paged(dst_mem, DST_BASE, heads=4, head_start=4, total_heads=8)
    assert build_plan("r", room({"kv": (s, [0])}), room({"kv": (d, [0])}), 4).entries == []


def test_latent_kv_is_whole_pages(mems):
    src_mem, dst_mem = mems
    s, s_arr = paged(src_mem, SRC_BASE, heads=0, total_heads=0, head_dim=16, kv_planes=1)
    d, d_arr = paged(dst_mem, DST_BASE, heads=0, total_heads=0, head_dim=16, kv_planes=1)
    plan = build_plan("r", room({"kv": (s, [1, 5])}), room({"kv": (d, [0, 3])}), num_tokens=7)
    assert [e.length for e in plan.entries] == [s.bytes_per_page] * 4  # 2 layers x 2 pages
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_arr[:, :, [0, 3]], s_arr[:, :, [1, 5]])


def test_slot_state(mems):
    src_mem, dst_mem = mems
    s, s_arr = slots(src_mem, SRC_BASE)
    d, d_arr = slots(dst_mem, DST_BASE)
    before = d_arr.copy()
    plan = build_plan("r", room({"state": (s, [1, 2])}), room({"state": (d, [3, 4])}), num_tokens=1)
    assert [e.length for e in plan.entries] == [2 * 64] * 3  # slot pairs merge within a layer
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_arr[:, [3, 4]], s_arr[:, [1, 2]])
    np.testing.assert_array_equal(d_arr[:, [0, 1, 2]], before[:, [0, 1, 2]])


def test_kv_draft_kv_and_state_in_one_room(mems):
    """Target KV, the drafter's KV (own head count, page table and page count) and a state slot.
    draft_kv sits right after kv in memory and both rooms use every page, so a merge across
    buffers would be possible; it must not happen (each buffer is registered on its own)."""
    src_mem, dst_mem = mems
    s_kv, s_kv_arr = paged(src_mem, SRC_BASE, pages=2)
    d_kv, d_kv_arr = paged(dst_mem, DST_BASE, pages=2)
    s_dr, s_dr_arr = paged(src_mem, SRC_BASE + s_kv.length, "draft_kv", layers=1, pages=2, heads=1)
    d_dr, d_dr_arr = paged(dst_mem, DST_BASE + d_kv.length, "draft_kv", layers=1, pages=2, heads=1)
    s_st, s_st_arr = slots(src_mem, SRC_BASE + 0x100000)
    d_st, d_st_arr = slots(dst_mem, DST_BASE + 0x100000)
    src = room({"kv": (s_kv, [0, 1]), "draft_kv": (s_dr, [0, 1]), "state": (s_st, [0])})
    dst = room({"kv": (d_kv, [0, 1]), "draft_kv": (d_dr, [0, 1]), "state": (d_st, [2])})
    plan = build_plan("r", src, dst, num_tokens=8)

    for e in plan.entries:  # every entry lies inside one buffer on each side
        assert sum(b.base_addr <= e.src_addr and e.src_addr + e.length <= b.base_addr + b.length
                   for b in (s_kv, s_dr, s_st)) == 1
        assert sum(b.base_addr <= e.dst_addr and e.dst_addr + e.length <= b.base_addr + b.length
                   for b in (d_kv, d_dr, d_st)) == 1
    assert plan.total_bytes == s_kv.length + s_dr.length + 3 * 64
    apply(plan, src_mem, dst_mem)
    np.testing.assert_array_equal(d_kv_arr, s_kv_arr)
    np.testing.assert_array_equal(d_dr_arr, s_dr_arr)
    np.testing.assert_array_equal(d_st_arr[:, 2], s_st_arr[:, 0])


def test_buffer_on_one_side_only_is_an_error(mems):
    src_mem, dst_mem = mems
    s_kv, _ = paged(src_mem, SRC_BASE)
    s_dr, _ = paged(src_mem, SRC_BASE + 0x100000, "draft_kv")
    d_kv, _ = paged(dst_mem, DST_BASE)
    with pytest.raises(TransferPlanError, match="draft_kv"):
        build_plan("r", room({"kv": (s_kv, [0]), "draft_kv": (s_dr, [0])}), room({"kv": (d_kv, [0])}), 4)


@dataclass(frozen=True)
class ShortRegion(PagedKVBuffer):
    """A peer that registered less memory than its layout describes."""

    @property
    def length(self) -> int:
        return super().length - 1


@pytest.mark.parametrize("dst_pages,dst_cls,match", [
    ([0, 8], PagedKVBuffer, "destination index 8 out of range"),  # page 8 of 8 would land in the next block
    ([-1, 0], PagedKVBuffer, "destination index -1"),
    ([0], PagedKVBuffer, "destination has 1 indices, 2 needed"),
    ([0, 7], ShortRegion, "outside the destination region"),  # layer 1, V, page 7 ends 1 byte past
])
def test_out_of_range_destination_raises_naming_room_and_buffer(mems, dst_pages, dst_cls, match):
    src_mem, dst_mem = mems
    s, _ = paged(src_mem, SRC_BASE)
    d = dst_cls("kv", DST_BASE, 2, 8, 4, 2, 0, 2, 4, "float32")
    with pytest.raises(TransferPlanError, match=match) as err:
        build_plan("room-42", room({"kv": (s, [0, 1])}), room({"kv": (d, dst_pages)}), num_tokens=8)
    assert "room room-42, buffer kv" in str(err.value)


@pytest.mark.parametrize("field,kwargs", [("page_size", {"page_size": 8}), ("total_layers", {"layers": 3}),
                                          ("total_heads", {"total_heads": 4})])
def test_mismatched_geometry_is_an_error(mems, field, kwargs):
    src_mem, dst_mem = mems
    s, _ = paged(src_mem, SRC_BASE)
    d, _ = paged(dst_mem, DST_BASE, **kwargs)
    with pytest.raises(TransferPlanError, match=f"{field} differs"):
        build_plan("r", room({"kv": (s, [0])}), room({"kv": (d, [0])}), 4)


def test_latent_on_one_side_only_and_bad_token_count(mems):
    src_mem, dst_mem = mems
    s, _ = paged(src_mem, SRC_BASE, heads=0, total_heads=2)
    d, _ = paged(dst_mem, DST_BASE, heads=2, total_heads=2)
    with pytest.raises(TransferPlanError, match="latent"):
        build_plan("r", room({"kv": (s, [0])}), room({"kv": (d, [0])}), 4)
    with pytest.raises(TransferPlanError, match="num_tokens"):
        build_plan("r", room({"kv": (s, [0])}), room({"kv": (s, [0])}), 0)


def test_batches_hold_at_most_1024_entries(mems):
    entries = [TransferEntry(i, i, 1) for i in range(2500)]
    assert [len(b) for b in split_batches(entries)] == [1024, 1024, 452]
    assert sum(split_batches(entries), []) == entries

    src_mem, dst_mem = mems  # a per-token plan: 4 layers x 2 x 200 tokens = 1600 entries
    s, _ = paged(src_mem, SRC_BASE, layers=4, pages=16, page_size=16, heads=4, total_heads=4)
    d, _ = paged(dst_mem, DST_BASE, layers=4, pages=16, page_size=16, heads=2, head_start=2, total_heads=4)
    plan = build_plan("r", room({"kv": (s, list(range(13)))}), room({"kv": (d, list(range(13)))}), 200)
    assert [len(b) for b in plan.batches] == [MAX_BATCH_ENTRIES, 1600 - MAX_BATCH_ENTRIES]


def test_wire_round_trip(mems):
    src_mem, _ = mems
    kv, _ = paged(src_mem, SRC_BASE, heads=2, head_start=2, total_heads=8)
    latent, _ = paged(src_mem, SRC_BASE + 0x100000, "draft_kv", heads=0, total_heads=0, head_dim=16, kv_planes=1)
    state, _ = slots(src_mem, SRC_BASE + 0x200000)
    original = room({"kv": (kv, [4, 5]), "draft_kv": (latent, [1]), "state": (state, [3])})
    request = pb.BootstrapRequest(room="r", buffers=room_to_protos(original))
    decoded = room_from_protos(pb.BootstrapRequest.FromString(request.SerializeToString()).buffers)
    assert decoded.buffers == original.buffers  # kv_planes=1 recovered from the length
    assert decoded.indices == original.indices

    info = buffer_to_proto(kv)
    info.length += 1
    with pytest.raises(ValueError, match="length"):
        room_from_protos([info])
