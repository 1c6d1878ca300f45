"""Turn one room's buffers on P and D into a list of byte copies (src_addr, dst_addr, length).

Pure address arithmetic (numpy, no Mooncake, no torch) so it is testable anywhere. Rules:
- buffers are matched by name ("kv", "draft_kv", "state"); a name on one side only is an error;
- paged KV sends the pages covering `num_tokens` (the last page whole) when both sides hold
  the same heads (or latent KV); otherwise, for heterogeneous TP, it sends the intersecting
  head range token by token, with each side's own strides;
- slot state sends each (layer, slot) pair;
- entries contiguous on both sides are merged (small scattered entries are slow over TCP);
- every entry is checked against both sides' buffers before anything is returned;
- batches hold at most MAX_BATCH_ENTRIES entries (over ~2048 in flight per peer, TCP fails).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.buffers import PagedKVBuffer, RoomBuffers, SlotStateBuffer

MAX_BATCH_ENTRIES = 1024
SUPPORTED_LAYOUT = "LKPSHD"

Buffer = PagedKVBuffer | SlotStateBuffer


class TransferPlanError(ValueError):
    """The two sides' buffers or indices do not describe a valid transfer; nothing was sent."""


@dataclass(frozen=True, slots=True)
class TransferEntry:
    src_addr: int
    dst_addr: int
    length: int


@dataclass(frozen=True)
class TransferPlan:
    room: str
    entries: list[TransferEntry]

    @property
    def total_bytes(self) -> int:
        return sum(e.length for e in self.entries)

    @property
    def batches(self) -> list[list[TransferEntry]]:
        return split_batches(self.entries)


def split_batches(entries: Sequence[TransferEntry], max_entries: int = MAX_BATCH_ENTRIES) -> list[list[TransferEntry]]:
    if max_entries <= 0:
        raise ValueError(f"max_entries must be positive, got {max_entries}")
    return [list(entries[i : i + max_entries]) for i in range(0, len(entries), max_entries)]


def build_plan(room: str, src: RoomBuffers, dst: RoomBuffers, num_tokens: int) -> TransferPlan:
    """Entries that copy the first `num_tokens` tokens of paged buffers and every reserved state
    slot of `room` from `src` to `dst`. Raises TransferPlanError before returning anything."""
    if num_tokens <= 0:
        raise TransferPlanError(f"room {room}: num_tokens must be positive, got {num_tokens}")
    src_by_name, dst_by_name = _by_name(room, "source", src), _by_name(room, "destination", dst)
    if src_by_name.keys() != dst_by_name.keys():
        only_src = sorted(src_by_name.keys() - dst_by_name.keys())
        only_dst = sorted(dst_by_name.keys() - src_by_name.keys())
        raise TransferPlanError(
            f"room {room}: buffers differ between sides (only on source: {only_src}, only on destination: {only_dst})"
        )
    entries: list[TransferEntry] = []
    for name in sorted(src_by_name):
        s, d = src_by_name[name], dst_by_name[name]
        s_idx, d_idx = _indices(room, "source", src, name), _indices(room, "destination", dst, name)
        if isinstance(s, PagedKVBuffer) and isinstance(d, PagedKVBuffer):
            arrays = _paged(room, s, d, s_idx, d_idx, num_tokens)
        elif isinstance(s, SlotStateBuffer) and isinstance(d, SlotStateBuffer):
            arrays = _slots(room, s, d, s_idx, d_idx)
        else:
            raise TransferPlanError(
                f"room {room}, buffer {name}: kinds differ ({type(s).__name__} vs {type(d).__name__})"
            )
        # Merge per buffer, never across: an entry spanning two registrations would be
        # rejected by the peer even when the two happen to be adjacent in memory.
        src_a, dst_a, len_a = _merge(*arrays)
        _check_bounds(room, "source", s, src_a, len_a)
        _check_bounds(room, "destination", d, dst_a, len_a)
        entries.extend(TransferEntry(a, b, n) for a, b, n in zip(src_a.tolist(), dst_a.tolist(), len_a.tolist()))
    return TransferPlan(room, entries)


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # src addrs, dst addrs, lengths (int64)


def _paged(
    room: str, s: PagedKVBuffer, d: PagedKVBuffer, s_idx: list[int], d_idx: list[int], num_tokens: int
) -> Arrays:
    where = f"room {room}, buffer {s.name}"
    for field in ("layout", "num_layers", "kv_planes", "page_size", "head_dim", "dtype", "total_heads"):
        if getattr(s, field) != getattr(d, field):
            raise TransferPlanError(f"{where}: {field} differs ({getattr(s, field)} vs {getattr(d, field)})")
    if s.layout != SUPPORTED_LAYOUT:
        raise TransferPlanError(f"{where}: layout {s.layout} is not supported (only {SUPPORTED_LAYOUT})")
    if (s.num_heads == 0) != (d.num_heads == 0):
        raise TransferPlanError(f"{where}: latent KV (num_heads 0) on one side only")
    for side, b in (("source", s), ("destination", d)):
        if b.head_start + b.num_heads > b.total_heads:
            raise TransferPlanError(
                f"{where}: {side} heads [{b.head_start}, {b.head_start + b.num_heads}) "
                f"exceed total_heads {b.total_heads}"
            )
    n_pages = -(-num_tokens // s.page_size)
    s_pages = _checked_indices(where, "source", s_idx, n_pages, s.num_pages)
    d_pages = _checked_indices(where, "destination", d_idx, n_pages, d.num_pages)
    block = np.arange(s.num_layers * s.kv_planes, dtype=np.int64)[:, None]  # (layer, k/v) pairs

    if s.num_heads == d.num_heads and s.head_start == d.head_start:
        src = s.base_addr + (block * s.num_pages + s_pages) * s.bytes_per_page
        dst = d.base_addr + (block * d.num_pages + d_pages) * d.bytes_per_page
        return src.ravel(), dst.ravel(), np.full(src.size, s.bytes_per_page, dtype=np.int64)

    # Heterogeneous TP: only the heads both sides hold, one entry per token, since the
    # token strides differ (each side's token row is its own num_heads wide).
    lo, hi = max(s.head_start, d.head_start), min(s.head_start + s.num_heads, d.head_start + d.num_heads)
    if lo >= hi:  # this source rank holds none of the destination rank's heads
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    head_bytes = s.head_dim * s.elem_bytes
    tok = np.arange(num_tokens, dtype=np.int64)

    def addrs(b: PagedKVBuffer, pages: np.ndarray) -> np.ndarray:
        page_of_tok = pages[tok // b.page_size]
        offset_in_page = (tok % b.page_size) * b.token_bytes + (lo - b.head_start) * head_bytes
        return (b.base_addr + (block * b.num_pages + page_of_tok) * b.bytes_per_page + offset_in_page).ravel()

    src, dst = addrs(s, s_pages), addrs(d, d_pages)
    return src, dst, np.full(src.size, (hi - lo) * head_bytes, dtype=np.int64)


def _slots(room: str, s: SlotStateBuffer, d: SlotStateBuffer, s_idx: list[int], d_idx: list[int]) -> Arrays:
    where = f"room {room}, buffer {s.name}"
    for field in ("num_layers", "bytes_per_slot", "dtype"):
        if getattr(s, field) != getattr(d, field):
            raise TransferPlanError(f"{where}: {field} differs ({getattr(s, field)} vs {getattr(d, field)})")
    if len(s_idx) != len(d_idx):
        raise TransferPlanError(f"{where}: {len(s_idx)} source slots vs {len(d_idx)} destination slots")
    s_slots = _checked_indices(where, "source", s_idx, len(s_idx), s.num_slots)
    d_slots = _checked_indices(where, "destination", d_idx, len(d_idx), d.num_slots)
    layer = np.arange(s.num_layers, dtype=np.int64)[:, None]
    src = s.base_addr + (layer * s.num_slots + s_slots) * s.bytes_per_slot
    dst = d.base_addr + (layer * d.num_slots + d_slots) * d.bytes_per_slot
    return src.ravel(), dst.ravel(), np.full(src.size, s.bytes_per_slot, dtype=np.int64)


def _merge(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Arrays:
    """Fuse runs of consecutive entries that continue each other on both sides."""
    if src.size == 0:
        return src, dst, length
    starts_run = np.ones(src.size, dtype=bool)
    starts_run[1:] = (src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])
    first = np.flatnonzero(starts_run)
    return src[first], dst[first], np.add.reduceat(length, first)


def _check_bounds(room: str, side: str, buf: Buffer, addrs: np.ndarray, lengths: np.ndarray) -> None:
    end = buf.base_addr + buf.length
    bad = np.flatnonzero((addrs < buf.base_addr) | (addrs + lengths > end) | (lengths <= 0))
    if bad.size:
        i = int(bad[0])
        raise TransferPlanError(
            f"room {room}, buffer {buf.name}: {bad.size} entries fall outside the {side} region "
            f"[{buf.base_addr:#x}, {end:#x}), first at {int(addrs[i]):#x} + {int(lengths[i])} bytes"
        )


def _checked_indices(where: str, side: str, indices: list[int], needed: int, limit: int) -> np.ndarray:
    # A page index past num_pages can still land inside the buffer (in the next layer's
    # block), so indices are checked here; the bounds check only catches the region's edges.
    if len(indices) < needed:
        raise TransferPlanError(f"{where}: {side} has {len(indices)} indices, {needed} needed")
    arr = np.asarray(indices[:needed], dtype=np.int64)
    bad = arr[(arr < 0) | (arr >= limit)]
    if bad.size:
        raise TransferPlanError(f"{where}: {side} index {int(bad[0])} out of range [0, {limit})")
    return arr


def _by_name(room: str, side: str, rb: RoomBuffers) -> dict[str, Buffer]:
    by_name: dict[str, Buffer] = {}
    for b in rb.buffers:
        if b.name in by_name:
            raise TransferPlanError(f"room {room}: {side} lists buffer {b.name} twice")
        by_name[b.name] = b
    return by_name


def _indices(room: str, side: str, rb: RoomBuffers, name: str) -> list[int]:
    if name not in rb.indices:
        raise TransferPlanError(f"room {room}, buffer {name}: {side} reserved no pages/slots")
    return rb.indices[name]
