"""Descriptions of the memory regions a runner exposes for KV transfer.

The runner owns the tensors; these dataclasses say where they live and how they are laid out,
which is all the transfer plan needs. They map one to one onto `protos.BufferInfo`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.kv.shared import SharedRegion

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class PagedKVBuffer:
    """A paged per-token KV cache stored as one tensor [layer, k/v, page, token, head, dim]
    (layout "LKPSHD"). `num_heads` heads starting at global head `head_start` are held here;
    `num_heads == 0` means latent (MLA-style) KV with `head_dim` elements per token. The MLA
    runner describes its latent cache as kv_planes 1 with one head of total_heads 1 (latent +
    rope key wide), which every TP rank holds whole: the same transfer rule as `num_heads == 0`.
    `num_layers` layers starting at global layer `layer_start` of `total_layers` are held here
    (a pipeline stage holds a range; 0 total_layers means num_layers, i.e. all of them)."""

    name: str
    base_addr: int
    num_layers: int
    num_pages: int
    page_size: int
    num_heads: int
    head_start: int
    total_heads: int
    head_dim: int
    dtype: str
    kv_planes: int = 2  # 2 for K and V; 1 for latent KV
    layout: str = "LKPSHD"
    layer_start: int = 0
    total_layers: int = 0

    def __post_init__(self) -> None:
        if self.total_layers == 0:
            object.__setattr__(self, "total_layers", self.num_layers)

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        return max(self.num_heads, 1) * self.head_dim * self.elem_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def length(self) -> int:
        return self.num_layers * self.kv_planes * self.num_pages * self.bytes_per_page

    def page_addr(self, layer: int, plane: int, page: int) -> int:
        return self.base_addr + ((layer * self.kv_planes + plane) * self.num_pages + page) * self.bytes_per_page


@dataclass(frozen=True)
class SlotStateBuffer:
    """Per-request fixed-size state, one slot per request per layer, stored as
    [layer, slot, part, head, head bytes]: each slot is `parts` blocks (a KDA recurrent state is
    one, its convolution windows three: q, k and v), each split by head over TP like the
    layer's heads. `num_heads` heads starting at global head `head_start` of `total_heads` are
    held here, so a TP rank's slot is its slice of every part. Layers as PagedKVBuffer's:
    `num_layers` from `layer_start` of `total_layers` (0: num_layers), counted among the
    model's layers of this kind. The defaults describe a slot held whole by every rank."""

    name: str
    base_addr: int
    num_layers: int
    num_slots: int
    bytes_per_slot: int
    dtype: str
    parts: int = 1
    num_heads: int = 1
    head_start: int = 0
    total_heads: int = 1
    layer_start: int = 0
    total_layers: int = 0

    def __post_init__(self) -> None:
        if self.total_layers == 0:
            object.__setattr__(self, "total_layers", self.num_layers)
        if self.parts <= 0 or self.num_heads <= 0 or self.bytes_per_slot % (self.parts * self.num_heads):
            raise ValueError(f"buffer {self.name}: {self.bytes_per_slot} bytes per slot do not split into "
                             f"{self.parts} parts of {self.num_heads} heads")

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one part of one slot."""
        return self.bytes_per_slot // (self.parts * self.num_heads)

    @property
    def length(self) -> int:
        return self.num_layers * self.num_slots * self.bytes_per_slot

    def slot_addr(self, layer: int, slot: int) -> int:
        return self.base_addr + (layer * self.num_slots + slot) * self.bytes_per_slot


@dataclass
class RoomBuffers:
    """One side's view of a room: the buffers and the page/slot indices reserved for it."""

    buffers: list[PagedKVBuffer | SlotStateBuffer]
    indices: dict[str, list[int]] = field(default_factory=dict)  # buffer name -> pages/slots


@dataclass
class RankEndpoint:
    """One process (TP rank `tp_rank` of a stage) of an instance: its Mooncake session and the
    buffers it registered there. A parallel instance has one per rank, rank 0 first."""

    tp_rank: int
    session_id: str
    buffers: list[PagedKVBuffer | SlotStateBuffer]
    shared: list[SharedRegion] = field(default_factory=list)  # how a process on this host opens them (D)
