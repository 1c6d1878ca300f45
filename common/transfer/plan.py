"""Turn one room's buffers on P and D into a list of byte copies (src_addr, dst_addr, length).

Pure address arithmetic (numpy, no Mooncake, no torch) so it is testable anywhere. A plan is
built per (P rank, D rank) pair: `build_plan(room, src, dst, num_tokens, src_tp=..., dst_tp=...)`.
Rules:
- buffers are matched by name ("kv", "draft_kv", "state"); a name on the source only is an
  error, and so is a name on the destination only unless the source is a pipeline stage (one
  of its paged buffers holds fewer than all layers): another stage sends that buffer;
- pipeline parallelism: a paged buffer holds layers [layer_start, layer_start + num_layers) of
  total_layers (equal on both sides); only the layers both sides hold are sent, each onto the
  same global layer, so every P stage writes its own layers into D's all-layer buffer;
- tensor parallelism: `src_tp` / `dst_tp` (a `TPRank` each, or both None) name the two ranks.
  Without them the source sends every head both sides hold. With them, each D rank receives
  each of its heads exactly once even when heads are replicated (TP > KV heads): the holders
  of a head are `rep` consecutive P ranks, and D rank d takes its heads from holder
  d % rep (`sender_heads`); load spreads over replicas, and P rank r sends to D rank r when
  both sides split alike. Latent KV (num_heads 0) is held whole by every P rank, so it is the
  same rule with rep = P's TP size: whole pages from exactly one P rank per D rank. A rank's
  heads must be one of equal consecutive ranges, each on consecutive ranks (`kv_head_range`,
  or every head on every rank); `source_ranks` tells a D rank which P ranks write to it;
- paged KV sends the pages covering `num_tokens` (the last page whole), from the page at
  `starts[name]` on (tokens already sent, whole pages: P sends a prompt's pages chunk by chunk
  while it prefills, each part planned and checked alike), when the heads sent
  are exactly the heads both sides hold (or latent KV); otherwise it sends the head range
  token by token, with each side's own strides;
- slot state (a KDA layer's recurrent state or convolution windows) sends, for each layer
  both sides hold and each reserved slot, the heads this P rank sends this D rank (the same
  head rule as paged KV, over the state's own heads) of each of the slot's parts: a slot is
  [part, head, bytes], so a head range is one run per part (q, k and v of a window apart);
- entries contiguous on both sides are merged (small scattered entries are slow over TCP);
- every entry is checked against both sides' buffers before anything is returned;
- batches hold at most MAX_BATCH_ENTRIES entries (over ~2048 in flight per peer, TCP fails).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.kv.buffers import PagedKVBuffer, RoomBuffers, SlotStateBuffer
from common.runner.layout import kv_head_range

MAX_BATCH_ENTRIES = 1024
SUPPORTED_LAYOUT = "LKPSHD"

Buffer = PagedKVBuffer | SlotStateBuffer


class TransferPlanError(ValueError):
    """The two sides' buffers or indices do not describe a valid transfer; nothing was sent."""


@dataclass(frozen=True)
class TPRank:
    """Tensor-parallel rank `rank` of `size` ranks on one side of a transfer."""

    rank: int
    size: int


@dataclass(frozen=True, slots=True)
class TransferEntry:
    src_addr: int
    dst_addr: int
    length: int


Writes = list[tuple[str, list[TransferEntry]]]  # what one rank writes: (peer Mooncake session, entries)


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


def build_plan(
    room: str,
    src: RoomBuffers,
    dst: RoomBuffers,
    num_tokens: int,
    *,
    src_tp: TPRank | None = None,
    dst_tp: TPRank | None = None,
    starts: Mapping[str, int] = {},
) -> TransferPlan:
    """Entries that copy the first `num_tokens` tokens of paged buffers (of a buffer named in
    `starts`, those from that token on: a multiple of its page size) and every reserved state
    slot of `room` from `src` (one P rank) to `dst` (one D rank). `src_tp` and `dst_tp` (both or
    neither) make replicated heads go out once; see the module docstring. An empty plan means
    this P rank sends nothing to this D rank. Raises TransferPlanError before returning anything."""
    if num_tokens <= 0:
        raise TransferPlanError(f"room {room}: num_tokens must be positive, got {num_tokens}")
    if (src_tp is None) != (dst_tp is None):
        raise TransferPlanError(f"room {room}: give both src_tp and dst_tp or neither")
    src_by_name, dst_by_name = _by_name(room, "source", src), _by_name(room, "destination", dst)
    _check_names(room, src_by_name, dst_by_name)
    ranks = None if src_tp is None or dst_tp is None else (src_tp, dst_tp)
    entries: list[TransferEntry] = []
    for name in sorted(src_by_name):
        s, d = src_by_name[name], dst_by_name[name]
        s_idx, d_idx = _indices(room, "source", src, name), _indices(room, "destination", dst, name)
        if isinstance(s, PagedKVBuffer) and isinstance(d, PagedKVBuffer):
            arrays = _paged(room, s, d, s_idx, d_idx, range(starts.get(name, 0), num_tokens), ranks)
        elif isinstance(s, SlotStateBuffer) and isinstance(d, SlotStateBuffer):
            arrays = _slots(room, s, d, s_idx, d_idx, ranks)
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


def sender_heads(
    src_rank: int, src_tp: int, src_heads: range, dst_rank: int, dst_heads: range, total_heads: int
) -> range:
    """Global heads that P rank `src_rank` of `src_tp` (holding `src_heads`) sends to D rank
    `dst_rank` (holding `dst_heads`): the heads both hold, if this rank is the holder D rank
    `dst_rank` takes them from. A head is held by `rep` consecutive P ranks (see `_replicas`)
    and D rank d takes it from the (d % rep)-th of them; the holders of a head all hold the
    same range, so one D rank's heads come from as few P ranks as possible. Latent KV is one
    head (total_heads 1) held by every rank. Raises ValueError if src_heads is not such a layout."""
    rep = _replicas(src_rank, src_tp, src_heads, total_heads)
    if src_rank % rep != dst_rank % rep:
        return range(0)
    return range(max(src_heads.start, dst_heads.start), min(src_heads.stop, dst_heads.stop))


def _replicas(rank: int, tp: int, heads: range, total_heads: int) -> int:
    """How many consecutive ranks hold `heads`, the range rank `rank` of `tp` holds: 1 without
    replication (kv_head_range with tp <= heads), tp / total_heads with it, tp when every rank
    holds every head. Anything else is a layout the plan cannot pair up: ValueError."""
    rep, extra = divmod(tp * len(heads), total_heads) if total_heads else (0, 0)
    if not 0 <= rank < tp or rep == 0 or extra or heads.start != rank // rep * len(heads):
        raise ValueError(
            f"rank {rank} of TP {tp} holds heads [{heads.start}, {heads.stop}) of {total_heads}: "
            "not an even split into consecutive ranges (each replicated on consecutive ranks)"
        )
    return rep


def source_ranks(dst_rank: int, dst_heads: range, src_tp: int, total_heads: int) -> list[int]:
    """P ranks (of `src_tp`, heads split by `kv_head_range`) that send to D rank `dst_rank`
    holding `dst_heads` of `total_heads` (0: latent KV): whom D waits for, per buffer and stage."""
    if total_heads == 0:
        return [dst_rank % src_tp]
    return [
        r for r in range(src_tp)
        if sender_heads(r, src_tp, kv_head_range(r, src_tp, total_heads), dst_rank, dst_heads, total_heads)
    ]


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # src addrs, dst addrs, lengths (int64)


def _paged(
    room: str,
    s: PagedKVBuffer,
    d: PagedKVBuffer,
    s_idx: list[int],
    d_idx: list[int],
    tokens: range,
    ranks: tuple[TPRank, TPRank] | None,
) -> Arrays:
    where = f"room {room}, buffer {s.name}"
    _check_geometry(where, s, d)
    if tokens.start < 0 or tokens.start % s.page_size:
        raise TransferPlanError(f"{where}: start token {tokens.start} is not a page boundary (page size {s.page_size})")
    n_pages = -(-tokens.stop // s.page_size)
    s_pages = _checked_indices(where, "source", s_idx, n_pages, s.num_pages)
    d_pages = _checked_indices(where, "destination", d_idx, n_pages, d.num_pages)
    layers, heads = _common_layers(s, d), _sent_heads(where, s, d, ranks)
    if not layers or not heads or not tokens:  # this P rank holds nothing (more) this D rank takes from it
        return _nothing()
    first_page = tokens.start // s.page_size
    s_pages, d_pages = s_pages[first_page:], d_pages[first_page:]
    plane = np.arange(s.kv_planes, dtype=np.int64)
    global_layer = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None]

    def blocks(b: PagedKVBuffer) -> np.ndarray:  # this side's (layer, k/v) block of each global pair
        return ((global_layer - b.layer_start) * b.kv_planes + plane).reshape(-1, 1)

    if s.num_heads == 0 or (_held(s) == heads == _held(d)):
        src = s.base_addr + (blocks(s) * s.num_pages + s_pages) * s.bytes_per_page
        dst = d.base_addr + (blocks(d) * d.num_pages + d_pages) * d.bytes_per_page
        return src.ravel(), dst.ravel(), np.full(src.size, s.bytes_per_page, dtype=np.int64)

    # Only some of a side's heads move: one entry per token, since the token strides differ
    # (each side's token row is its own num_heads wide).
    head_bytes = s.head_dim * s.elem_bytes
    tok = np.arange(tokens.start, tokens.stop, dtype=np.int64)

    def addrs(b: PagedKVBuffer, pages: np.ndarray) -> np.ndarray:
        page_of_tok = pages[tok // b.page_size - first_page]
        offset_in_page = (tok % b.page_size) * b.token_bytes + (heads.start - b.head_start) * head_bytes
        return (b.base_addr + (blocks(b) * b.num_pages + page_of_tok) * b.bytes_per_page + offset_in_page).ravel()

    src, dst = addrs(s, s_pages), addrs(d, d_pages)
    return src, dst, np.full(src.size, len(heads) * head_bytes, dtype=np.int64)


def _check_geometry(where: str, s: PagedKVBuffer, d: PagedKVBuffer) -> None:
    for field in ("layout", "total_layers", "kv_planes", "page_size", "head_dim", "dtype", "total_heads"):
        if getattr(s, field) != getattr(d, field):
            raise TransferPlanError(f"{where}: {field} differs ({getattr(s, field)} vs {getattr(d, field)})")
    if s.layout != SUPPORTED_LAYOUT:
        raise TransferPlanError(f"{where}: layout {s.layout} is not supported (only {SUPPORTED_LAYOUT})")
    if (s.num_heads == 0) != (d.num_heads == 0):
        raise TransferPlanError(f"{where}: latent KV (num_heads 0) on one side only")
    _check_ranges(where, s, d)


def _check_ranges(where: str, s: Buffer, d: Buffer) -> None:
    for side, b in (("source", s), ("destination", d)):
        if b.head_start + b.num_heads > b.total_heads:
            raise TransferPlanError(
                f"{where}: {side} heads [{b.head_start}, {b.head_start + b.num_heads}) "
                f"exceed total_heads {b.total_heads}"
            )
        if b.layer_start + b.num_layers > b.total_layers:
            raise TransferPlanError(
                f"{where}: {side} layers [{b.layer_start}, {b.layer_start + b.num_layers}) "
                f"exceed total_layers {b.total_layers}"
            )


def _held(b: Buffer) -> range:
    return range(b.head_start, b.head_start + b.num_heads)


def _common_layers(s: Buffer, d: Buffer) -> range:
    """Global layers both sides hold (each side's are a pipeline stage's range, or all)."""
    return range(max(s.layer_start, d.layer_start), min(s.layer_start + s.num_layers, d.layer_start + d.num_layers))


def _sent_heads(where: str, s: Buffer, d: Buffer, ranks: tuple[TPRank, TPRank] | None) -> range:
    """Global heads this P rank sends this D rank; latent KV counts as the one head 0."""
    latent = s.num_heads == 0
    if ranks is None:
        return range(1) if latent else range(max(s.head_start, d.head_start), min(_held(s).stop, _held(d).stop))
    src_tp, dst_tp = ranks
    try:
        if latent:
            return sender_heads(src_tp.rank, src_tp.size, range(1), dst_tp.rank, range(1), 1)
        _replicas(dst_tp.rank, dst_tp.size, _held(d), d.total_heads)  # D's ranks must be consistent too
        return sender_heads(src_tp.rank, src_tp.size, _held(s), dst_tp.rank, _held(d), s.total_heads)
    except ValueError as e:
        raise TransferPlanError(f"{where}: {e}") from e


def _slots(
    room: str,
    s: SlotStateBuffer,
    d: SlotStateBuffer,
    s_idx: list[int],
    d_idx: list[int],
    ranks: tuple[TPRank, TPRank] | None,
) -> Arrays:
    where = f"room {room}, buffer {s.name}"
    for field in ("total_layers", "parts", "total_heads", "head_bytes", "dtype"):
        if getattr(s, field) != getattr(d, field):
            raise TransferPlanError(f"{where}: {field} differs ({getattr(s, field)} vs {getattr(d, field)})")
    _check_ranges(where, s, d)
    if len(s_idx) != len(d_idx):
        raise TransferPlanError(f"{where}: {len(s_idx)} source slots vs {len(d_idx)} destination slots")
    s_slots = _checked_indices(where, "source", s_idx, len(s_idx), s.num_slots)
    d_slots = _checked_indices(where, "destination", d_idx, len(d_idx), d.num_slots)
    layers, heads = _common_layers(s, d), _sent_heads(where, s, d, ranks)
    if not layers or not heads:
        return _nothing()
    global_layer = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None, None]
    part = np.arange(s.parts, dtype=np.int64)[None, None, :]

    def addrs(b: SlotStateBuffer, slots: np.ndarray) -> np.ndarray:  # [layer, slot, part] -> first sent head
        slot_addr = b.base_addr + ((global_layer - b.layer_start) * b.num_slots + slots[None, :, None]) * b.bytes_per_slot
        return (slot_addr + (part * b.num_heads + heads.start - b.head_start) * b.head_bytes).ravel()

    src, dst = addrs(s, s_slots), addrs(d, d_slots)
    return src, dst, np.full(src.size, len(heads) * s.head_bytes, dtype=np.int64)


def _nothing() -> Arrays:
    empty = np.empty(0, dtype=np.int64)
    return empty, empty, empty


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


def _check_names(room: str, src: dict[str, Buffer], dst: dict[str, Buffer]) -> None:
    only_src = sorted(src.keys() - dst.keys())
    only_dst = sorted(dst.keys() - src.keys())
    # A pipeline stage lacks the buffers another stage computes (e.g. the drafter's KV, or the
    # KV of MLA layers when the stage holds only KDA layers).
    stage = any(b.num_layers < b.total_layers for b in src.values())
    if only_src or (only_dst and not stage):
        raise TransferPlanError(
            f"room {room}: buffers differ between sides (only on source: {only_src}, only on destination: {only_dst})"
        )


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
