"""Paged attention in plain PyTorch, and the metadata that describes one batch for it.

A batch is a set of requests, each adding `n` new tokens at positions [start, start+n) on top
of `start` tokens already in its pages. Prefill chunks (n = chunk), decode (n = 1) and the
speculative verify step (n = block) are the same computation with different n.

KV cache of one layer: [2 (k/v), num_pages, page_size, kv_heads, head_dim]; a token's slot is
page * page_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    positions: torch.Tensor  # [T] absolute position of each new token
    write_slots: torch.Tensor  # [T] cache slot that receives each new token's K/V
    logit_rows: torch.Tensor | None  # rows whose final hidden state is returned (None = all)
    # Padded per-request view used by the general path; unused when `fresh_causal`.
    q_index: torch.Tensor | None = None  # [B, maxQ] row of T for each padded query
    kv_slots: torch.Tensor | None = None  # [B, maxKV] cache slots each request reads
    mask: torch.Tensor | None = None  # [B, 1, maxQ, maxKV] True = may attend; None = all
    out_rows: torch.Tensor | None = None  # [T] index into the flattened [B*maxQ] output
    # One request whose tokens all start at position 0: attend to the new K/V directly.
    fresh_causal: bool = False


def build_attn_meta(starts: list[int], counts: list[int], page_tables: list[list[int]],
                    page_size: int, scratch_slot: int, device: torch.device,
                    logit_rows: list[int] | None, causal: bool = True,
                    window: int | None = None) -> AttnMeta:
    """starts[i] tokens of request i are cached; counts[i] new ones follow. `scratch_slot` is a
    slot no request owns: padded keys read it (and are masked out).
    causal=False: the new tokens see each other both ways (a DFlash draft block); then
    `window` limits how many cached tokens before the block they see."""
    positions: list[int] = []
    write_slots: list[int] = []
    for start, n, pages in zip(starts, counts, page_tables):
        for pos in range(start, start + n):
            positions.append(pos)
            write_slots.append(pages[pos // page_size] * page_size + pos % page_size)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    meta = AttnMeta(as_long(positions), as_long(write_slots),
                    None if logit_rows is None else as_long(logit_rows))
    if causal and len(starts) == 1 and starts[0] == 0:
        meta.fresh_causal = True
        return meta

    B, max_q = len(starts), max(counts)
    kv_lens = [s + n for s, n in zip(starts, counts)]
    max_kv = max(kv_lens)
    q_index = torch.zeros(B, max_q, dtype=torch.long)
    kv_slots = torch.full((B, max_kv), scratch_slot, dtype=torch.long)
    out_rows = torch.empty(sum(counts), dtype=torch.long)
    row = 0
    for b, (start, n, pages) in enumerate(zip(starts, counts, page_tables)):
        q_index[b, :n] = torch.arange(row, row + n)
        out_rows[row:row + n] = torch.arange(b * max_q, b * max_q + n)
        kv_len = start + n
        slot_pages = torch.tensor(pages[: -(-kv_len // page_size)], dtype=torch.long)
        slots = (slot_pages[:, None] * page_size + torch.arange(page_size)).flatten()[:kv_len]
        kv_slots[b, :kv_len] = slots
        row += n
    needs_mask = (causal and max_q > 1) or len(set(kv_lens)) > 1 or window is not None
    if needs_mask:
        k_pos = torch.arange(max_kv)[None, None, :]
        mask = k_pos < torch.tensor(kv_lens)[:, None, None]
        if causal:
            # Query i of request b (position start_b + i) sees keys at positions <= its own.
            q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]  # [B, maxQ]
            mask = mask & (k_pos <= q_pos[:, :, None])
        if window is not None:
            mask = mask & (k_pos >= torch.tensor(starts)[:, None, None] - window)
        mask = mask.expand(B, max_q, max_kv).clone()
        padded = torch.arange(max_q)[None, :] >= torch.tensor(counts)[:, None]
        mask[padded] = True  # padded query rows must see something, or SDPA yields NaN
        meta.mask = mask.unsqueeze(1).to(device)
    meta.q_index, meta.kv_slots, meta.out_rows = q_index.to(device), kv_slots.to(device), out_rows.to(device)
    return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """q [T, Hq, d], k/v [T, Hkv, d] for the new tokens. Writes k/v into the cache, then
    returns attention output [T, Hq, d]."""
    k_cache = kv_layer[0].view(-1, *k.shape[1:])
    v_cache = kv_layer[1].view(-1, *v.shape[1:])
    k_cache.index_copy_(0, meta.write_slots, k)
    v_cache.index_copy_(0, meta.write_slots, v)
    gqa = q.shape[1] != k.shape[1]
    if meta.fresh_causal:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=gqa)
        return out.transpose(0, 1)
    qb = q[meta.q_index].transpose(1, 2)  # [B, Hq, maxQ, d]
    kb = k_cache[meta.kv_slots].transpose(1, 2)  # [B, Hkv, maxKV, d]
    vb = v_cache[meta.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=meta.mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(-1, *q.shape[1:])[meta.out_rows]
