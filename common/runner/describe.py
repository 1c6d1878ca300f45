"""What one rank's cache looks like to a transfer: its buffer descriptions (common.kv.buffers)
from the model, the rank's place in the split and where its tensors start. Pure arithmetic, so
that a plan for a layout no machine here can hold (the users' TP32) is built from the same
descriptions the runners publish."""
from __future__ import annotations

from dataclasses import dataclass

from common.kv.buffers import DTYPE_BYTES, PagedKVBuffer, SlotStateBuffer
from common.model.config import ModelConfig
from common.runner.layout import RankLayout

KDA_STATE_PARTS = {"kda_state": 1, "kda_conv": 3}  # the recurrent state; the q, k and v windows


@dataclass(frozen=True)
class CacheAddrs:
    """Where a rank's cache tensors start: the paged KV and, with KDA layers, the recurrent
    states [KDA layer, slot, head, D, D] (fp32) and convolution windows [KDA layer, slot,
    q|k|v head channels, W - 1]; slot 0 is scratch, so a tensor has state_slots + 1 slots."""

    kv: int
    kda_state: int = 0
    kda_conv: int = 0


def describe_rank(cfg: ModelConfig, layout: RankLayout, addrs: CacheAddrs, *, num_pages: int, page_size: int,
                  state_slots: int, dtype: str) -> list[PagedKVBuffer | SlotStateBuffer]:
    """The rank's KV of its layers (with KDA layers, the MLA layers' latent, numbered among the
    MLA layers) and KV heads, and, of each of its KDA layers, its KDA heads of the state slots:
    the recurrent state (one part) and the q, k and v windows (three parts, each split by
    head). `num_pages` counts the scratch page. A pipeline stage without layers of a kind
    describes no buffer for it."""
    layers, heads = layout.kv_layers(cfg), layout.kv_heads(cfg)
    out: list[PagedKVBuffer | SlotStateBuffer] = []
    if layers:
        out.append(PagedKVBuffer(
            name="kv", base_addr=addrs.kv, num_layers=len(layers), num_pages=num_pages, page_size=page_size,
            num_heads=len(heads), head_start=heads.start, total_heads=cfg.num_kv_heads, head_dim=cfg.cache_head_dim,
            dtype=dtype, kv_planes=cfg.kv_planes, layer_start=layers.start, total_layers=len(cfg.kv_layers)))
    kda = layout.kda_layers(cfg)
    if cfg.kda is None or not kda:
        return out
    heads, d = layout.kda_heads(cfg), cfg.kda.head_dim
    head_bytes = {"kda_state": d * d * 4, "kda_conv": d * (cfg.kda.conv_size - 1) * DTYPE_BYTES[dtype]}
    for name, parts in KDA_STATE_PARTS.items():
        out.append(SlotStateBuffer(
            name=name, base_addr=getattr(addrs, name), num_layers=len(kda), num_slots=state_slots + 1,
            bytes_per_slot=parts * len(heads) * head_bytes[name], dtype="float32" if name == "kda_state" else dtype,
            parts=parts, num_heads=len(heads), head_start=heads.start, total_heads=cfg.kda.num_heads,
            layer_start=kda.start, total_layers=len(cfg.kda.layers)))
    return out
