"""A model's KV cache and per-request state split over P (pipeline stages x TP ranks) and D (TP
ranks), as plain byte arrays, for the parallel transfer-plan tests (in memory and over Mooncake).

The model's KV is one random byte array per buffer, indexed [layer, k/v, position, head, dim
bytes], and a room's state (KDA recurrent states, convolution windows) one indexed [layer, part,
head, bytes]; every P rank's cache is cut from it with numpy slicing (replicas of a head hold
the same bytes, as they would after computing the same prefill), and so is what each D rank
must hold afterwards. Nothing here uses the plan's address arithmetic: it is the independent side
of the comparison.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.kv.buffers import DTYPE_BYTES, PagedKVBuffer, RoomBuffers, SlotStateBuffer
from common.runner.layout import kv_head_range, layer_range


@dataclass(frozen=True)
class KVSpec:
    """One paged buffer of the model. `heads` 0 means latent KV (one plane, head-less rows).
    `staged` buffers are split over pipeline stages; the others live on the last stage only
    (like the drafter's KV, computed after the last target layer)."""

    name: str
    layers: int
    heads: int
    head_dim: int
    staged: bool = True

    @property
    def planes(self) -> int:
        return 1 if self.heads == 0 else 2


@dataclass(frozen=True)
class StateSpec:
    """One buffer of per-request state slots: `parts` blocks per slot (a KDA recurrent state one,
    its q, k, v convolution windows three), each of `heads` heads of `head_bytes` bytes, split
    over TP by head. A room holds one slot of it (the split's `num_pages` is the slot count)."""

    name: str
    layers: int
    heads: int
    head_bytes: int
    parts: int = 1
    staged: bool = True


@dataclass(frozen=True)
class Split:
    tp_p: int
    tp_d: int
    specs: tuple[KVSpec | StateSpec, ...]
    pp: int = 1
    page_size: int = 4
    num_pages: int = 6
    num_tokens: int = 13
    dtype: str = "float32"
    seed: int = 0

    @property
    def n_pages(self) -> int:  # pages a room needs
        return -(-self.num_tokens // self.page_size)

    @property
    def head_bytes(self) -> dict[str, int]:
        return {s.name: s.head_bytes if isinstance(s, StateSpec) else s.head_dim * DTYPE_BYTES[self.dtype]
                for s in self.specs}

    def p_ranks(self) -> list[tuple[int, int]]:
        """(stage, TP rank) of every P rank."""
        return [(stage, rank) for stage in range(self.pp) for rank in range(self.tp_p)]


def heads_of(spec: KVSpec | StateSpec, rank: int, tp: int) -> range:
    return range(0) if spec.heads == 0 else kv_head_range(rank, tp, spec.heads)


def layers_of(spec: KVSpec | StateSpec, stage: int, pp: int) -> range:
    if spec.staged:
        return layer_range(stage, pp, spec.layers)
    return range(spec.layers) if stage == pp - 1 else range(0)


def model_kv(split: Split) -> dict[str, np.ndarray]:
    """name -> the whole model's KV bytes [layer, k/v, position, head, dim bytes], or a room's
    state [layer, part, head, bytes]."""
    rng = np.random.default_rng(split.seed)
    positions = split.n_pages * split.page_size  # the last page's tail too: whole pages carry it

    def shape(s: KVSpec | StateSpec) -> tuple[int, ...]:
        if isinstance(s, StateSpec):
            return s.layers, s.parts, s.heads, s.head_bytes
        return s.layers, s.planes, positions, max(s.heads, 1), split.head_bytes[s.name]

    return {s.name: rng.integers(0, 256, shape(s), dtype=np.uint8) for s in split.specs}


def cache_shape(split: Split, spec: KVSpec | StateSpec, layers: range, heads: range) -> tuple[int, ...]:
    """[layer, k/v, page, token, head, dim bytes] of one rank's buffer (layout LKPSHD), or
    [layer, slot, part, head, bytes] of its state slots."""
    if isinstance(spec, StateSpec):
        return len(layers), split.num_pages, spec.parts, len(heads), spec.head_bytes
    return (len(layers), spec.planes, split.num_pages, split.page_size, max(len(heads), 1),
            split.head_bytes[spec.name])


def describe(split: Split, spec: KVSpec | StateSpec, base: int, layers: range, heads: range
             ) -> PagedKVBuffer | SlotStateBuffer:
    if isinstance(spec, StateSpec):
        return SlotStateBuffer(spec.name, base, len(layers), split.num_pages, spec.parts * len(heads) * spec.head_bytes,
                               split.dtype, spec.parts, len(heads), heads.start, spec.heads, layers.start, spec.layers)
    return PagedKVBuffer(spec.name, base, len(layers), split.num_pages, split.page_size, len(heads),
                         heads.start, spec.heads, spec.head_dim, split.dtype, spec.planes,
                         layer_start=layers.start, total_layers=spec.layers)


def room_slot(split: Split, salt: int) -> list[int]:
    """A room's state slot (the same on a side's ranks, as its pages are), never slot 0."""
    return [1 + salt % (split.num_pages - 1)]


def page_table(split: Split, salt: int) -> list[int]:
    """A room's pages in token order: distinct, shuffled, never simply 0..n-1."""
    return np.random.default_rng([split.seed, salt]).permutation(split.num_pages)[: split.n_pages].tolist()


def _rows(kv: np.ndarray, layers: range, heads: range, n_pages: int, page_size: int) -> np.ndarray:
    """The model's KV of these layers and heads, as [layer, k/v, page, token, head, dim bytes]."""
    cut = kv[layers.start : layers.stop]
    if heads:
        cut = cut[:, :, :, heads.start : heads.stop]
    return cut.reshape(cut.shape[0], cut.shape[1], n_pages, page_size, *cut.shape[3:])


@dataclass
class Expected:
    """What one D rank's buffer must hold, and which bytes must have been written once."""

    data: np.ndarray
    written: np.ndarray = field(repr=False)  # bool, same shape


def expected_d_cache(split: Split, spec: KVSpec | StateSpec, kv: np.ndarray, before: np.ndarray, rank: int,
                     pages: list[int]) -> Expected:
    """Tokens below num_tokens of D rank `rank`'s heads, all layers. The last page's tail is
    written too when whole pages can move, i.e. the P ranks holding these heads hold exactly
    these heads (or latent KV)."""
    heads = heads_of(spec, rank, split.tp_d)
    if isinstance(spec, StateSpec):  # the room's slot: its heads of every part, all layers
        data, written = before.copy(), np.zeros(before.shape, dtype=bool)
        data[:, pages[0]] = kv[:, :, heads.start:heads.stop]
        written[:, pages[0]] = True
        return Expected(data, written)
    whole_pages = spec.heads == 0 or heads in [heads_of(spec, p, split.tp_p) for p in range(split.tp_p)]
    n_tokens = split.n_pages * split.page_size if whole_pages else split.num_tokens
    rows = _rows(kv, range(spec.layers), heads, split.n_pages, split.page_size)
    data, written = before.copy(), np.zeros(before.shape, dtype=bool)
    for t in range(n_tokens):
        page, slot = pages[t // split.page_size], t % split.page_size
        data[:, :, page, slot] = rows[:, :, t // split.page_size, slot]
        written[:, :, page, slot] = True
    return Expected(data, written)


# Keeps an array alive at some address (a fake one in memory, a registered one for Mooncake)
# and returns that address.
Place = Callable[[np.ndarray], int]


def p_rooms(split: Split, place: Place) -> list[RoomBuffers]:
    """Every P rank's room, in split.p_ranks() order: its buffers, holding its slice of the
    model's KV at its pages (other pages random), and the pages."""
    kv, rooms = model_kv(split), []
    rng = np.random.default_rng([split.seed, 1])
    for stage, rank in split.p_ranks():
        room = RoomBuffers([])
        for spec in split.specs:
            layers, heads = layers_of(spec, stage, split.pp), heads_of(spec, rank, split.tp_p)
            if not layers:
                continue
            cache = rng.integers(0, 256, cache_shape(split, spec, layers, heads), dtype=np.uint8)
            if isinstance(spec, StateSpec):
                pages = room_slot(split, salt=stage)
                cache[:, pages[0]] = kv[spec.name][layers.start:layers.stop, :, heads.start:heads.stop]
            else:
                pages = page_table(split, salt=100 + stage)  # a stage's TP ranks share their page table
                cache[:, :, pages] = _rows(kv[spec.name], layers, heads, split.n_pages, split.page_size)
            room.buffers.append(describe(split, spec, place(cache), layers, heads))
            room.indices[spec.name] = pages
        rooms.append(room)
    return rooms


def d_rooms(split: Split, place: Place) -> tuple[list[RoomBuffers], dict[tuple[int, str], np.ndarray]]:
    """Every D rank's room (all layers, its heads, random bytes) and its caches by (rank, name)."""
    rng = np.random.default_rng([split.seed, 2])
    rooms, caches = [], {}
    for rank in range(split.tp_d):
        room = RoomBuffers([])
        for spec in split.specs:
            heads = heads_of(spec, rank, split.tp_d)
            cache = caches[rank, spec.name] = rng.integers(
                0, 256, cache_shape(split, spec, range(spec.layers), heads), dtype=np.uint8)
            room.buffers.append(describe(split, spec, place(cache), range(spec.layers), heads))
            # D's ranks share their page table and slot
            room.indices[spec.name] = room_slot(split, 2) if isinstance(spec, StateSpec) else page_table(split, 200)
        rooms.append(room)
    return rooms, caches


def expected_d_caches(split: Split, rooms: list[RoomBuffers], before: dict[tuple[int, str], np.ndarray]
                      ) -> dict[tuple[int, str], Expected]:
    kv = model_kv(split)
    return {
        (rank, spec.name): expected_d_cache(split, spec, kv[spec.name], before[rank, spec.name], rank,
                                            rooms[rank].indices[spec.name])
        for rank in range(split.tp_d) for spec in split.specs
    }
