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

from common.model import paged_runs
from common.model.static_attention import StaticAttn, gather_pages


@dataclass
class AttnMeta:
    positions: torch.Tensor  # [T] absolute position of each new token
    write_slots: torch.Tensor  # [T] cache slot that receives each new token's K/V
    logit_rows: torch.Tensor | None  # rows whose final hidden state is returned (None = all)
    # Padded per-request view used by the general path; unused when `fresh_causal`, `extend` or
    # `dense_rows`.
    q_index: torch.Tensor | None = None  # [B, maxQ] row of T for each padded query; None: no padding
    kv_pages: torch.Tensor | None = None  # [B, maxPages] pages each request reads (scratch-padded)
    max_kv: int = 0  # keys read per request: the first max_kv slots of its kv_pages
    # One request whose pages are consecutive (the usual case: the pool hands out low pages
    # first): read them as a slice of the cache, without a copy. (first page, page count)
    page_range: tuple[int, int] | None = None
    mask: torch.Tensor | None = None  # [B, 1, maxQ, maxKV] True = may attend; None = all
    out_rows: torch.Tensor | None = None  # [T] index into the flattened [B*maxQ] output; None: all
    # One request whose tokens all start at position 0: attend to the new K/V directly.
    fresh_causal: bool = False
    # On a CPU, causal batches without a window: each request on its own, its cached keys read in
    # place (common.model.paged_runs); the padded view above is then unused.
    extend: list[paged_runs.Extend] | None = None
    # Static shapes (decode, verify and draft steps that CUDA graphs replay): only positions,
    # write_slots and this are used.
    static: StaticAttn | None = None
    # Recurrent layers (KDA): each request's state slot [B], and (general path) how many new
    # tokens each adds; None on static steps, where every row adds T / B.
    state_slots: torch.Tensor | None = None
    state_counts: list[int] | None = None
    # [B] bool: the batch holds the request's first tokens, so its state starts at zero whatever
    # its slot holds (every rank learns this from the batch; None: no request starts here).
    state_fresh: torch.Tensor | None = None
    # A verify block: KDA layers leave every state slot as it was and keep the block's inputs
    # (HybridCache.block) until the step knows how many tokens it commits (common.model.kda).
    state_block: bool = False
    # A dense batch (ModelRunner.forward_dense): the T tokens are dense_rows sequences padded to
    # one length, each from position 0, with no cache: plain causal attention, nothing written.
    # Padding lies at each sequence's end, where causal attention keeps it from the real tokens.
    dense_rows: int = 0


def cache_slot(pages: list[int], pos: int, page_size: int) -> int:
    """The slot of the token at `pos` of a request whose pages are `pages` (in token order)."""
    return pages[pos // page_size] * page_size + pos % page_size


def table_slots(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots [rows, T] of the tokens at positions [rows, T] of each row of a static page
    table [rows, W]. A position past the table lands in its last column, which static tables
    keep for the scratch page: tokens past a request's budget are computed but never stored."""
    column = (positions // page_size).clamp(max=page_table.shape[1] - 1)
    return page_table.gather(1, column) * page_size + positions % page_size


def build_attn_meta(starts: list[int], counts: list[int], page_tables: list[list[int]],
                    page_size: int, scratch_slot: int, device: torch.device,
                    logit_rows: list[int] | None, in_place: bool | None = None) -> AttnMeta:
    """starts[i] tokens of request i are cached; counts[i] new ones follow, each seeing the keys
    up to its own position. `scratch_slot` is a slot no request owns: padded keys read it (and
    are masked out). `in_place`: request by request, reading the pages where they lie
    (`paged_runs.Extend`), not through the padded view; None: on a CPU, where that is faster."""
    positions: list[int] = []
    write_slots: list[int] = []
    for start, n, pages in zip(starts, counts, page_tables):
        for pos in range(start, start + n):
            positions.append(pos)
            write_slots.append(cache_slot(pages, pos, page_size))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    meta = AttnMeta(as_long(positions), as_long(write_slots),
                    None if logit_rows is None else as_long(logit_rows))
    if len(starts) == 1 and starts[0] == 0:
        meta.fresh_causal = True
        return meta
    if torch.device(device).type == "cpu" if in_place is None else in_place:
        meta.extend = paged_runs.extend_requests(starts, counts, page_tables, page_size)
        return meta

    B, max_q = len(starts), max(counts)
    kv_lens = [s + n for s, n in zip(starts, counts)]
    max_kv = max(kv_lens)
    q_index = torch.zeros(B, max_q, dtype=torch.long)
    # Keys are gathered a whole page at a time (one contiguous copy per page, much faster on
    # CPU than one per token); slots past a request's length are masked out or sliced off.
    max_pages = -(-max_kv // page_size)
    kv_pages = torch.full((B, max_pages), scratch_slot // page_size, dtype=torch.long)
    out_rows = torch.empty(sum(counts), dtype=torch.long)
    row = 0
    for b, (start, n, pages) in enumerate(zip(starts, counts, page_tables)):
        q_index[b, :n] = torch.arange(row, row + n)
        out_rows[row:row + n] = torch.arange(b * max_q, b * max_q + n)
        used = -(-(start + n) // page_size)
        kv_pages[b, :used] = torch.tensor(pages[:used], dtype=torch.long)
        row += n
    if max_q > 1 or len(set(kv_lens)) > 1:
        k_pos = torch.arange(max_kv)[None, None, :]
        mask = k_pos < torch.tensor(kv_lens)[:, None, None]
        # Query i of request b (position start_b + i) sees keys at positions <= its own.
        q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]  # [B, maxQ]
        mask = (mask & (k_pos <= q_pos[:, :, None])).expand(B, max_q, max_kv).clone()
        padded = torch.arange(max_q)[None, :] >= torch.tensor(counts)[:, None]
        mask[padded] = True  # padded query rows must see something, or SDPA yields NaN
        meta.mask = mask.unsqueeze(1).to(device)
    meta.kv_pages, meta.max_kv = kv_pages.to(device), max_kv
    if len(set(counts)) > 1:  # requests of equal counts (decode, verify) need no padding
        meta.q_index, meta.out_rows = q_index.to(device), out_rows.to(device)
    used = page_tables[0][:max_pages]
    if B == 1 and used == list(range(used[0], used[0] + max_pages)):
        meta.page_range = (used[0], max_pages)
    return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """q [T, Hq, d], k/v [T, Hkv, d] for the new tokens. Writes k/v into the cache (not for a
    dense batch, which has none), then returns attention output [T, Hq, d]."""
    if meta.dense_rows:
        return dense_causal(q, k, v, meta.dense_rows)
    k_cache = kv_layer[0].view(-1, *k.shape[1:])
    v_cache = kv_layer[1].view(-1, *v.shape[1:])
    k_cache.index_copy_(0, meta.write_slots, k)
    v_cache.index_copy_(0, meta.write_slots, v)
    if meta.static is not None:
        return meta.static.attend(q, kv_layer)
    if meta.fresh_causal:  # one request from position 0: its new tokens are all its keys
        return dense_causal(q, k, v, 1)
    return attend_cached(q, kv_layer, meta)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """Causal attention of each of `rows` equal-length sequences laid end to end in q/k/v
    [T, heads, d] over its own tokens: [T, Hq, d]. The inputs go to SDPA as 4-D views: with 3-D
    ones PyTorch's CPU SDPA falls back to its (much slower) math path."""
    as_rows = lambda x: x.view(rows, -1, *x.shape[1:]).transpose(1, 2)
    return sdpa(as_rows(q), as_rows(k), as_rows(v), causal=True).transpose(1, 2).reshape(q.shape)


def attend_cached(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttnMeta,
                  scale: float | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, d] over the keys and values already in the cache's pages
    (the new tokens' included), general (non-static) path. `scale` None: d ** -0.5."""
    if meta.extend is not None:
        return paged_runs.attend_extend(q, kv_layer, meta.write_slots, meta.extend, scale)
    heads, d = kv_layer.shape[-2:]
    B = meta.kv_pages.shape[0]
    qb = (q.reshape(B, -1, *q.shape[1:]) if meta.q_index is None else q[meta.q_index]).transpose(1, 2)
    if meta.page_range is not None:
        first, n = meta.page_range
        kb, vb = kv_layer[0, first:first + n], kv_layer[1, first:first + n]
    else:
        pages = meta.kv_pages.flatten()
        kb, vb = gather_pages(kv_layer[0], pages), gather_pages(kv_layer[1], pages)
    kb = kb.view(B, -1, heads, d)[:, :meta.max_kv].transpose(1, 2)  # [B, Hkv, maxKV, d]
    vb = vb.view(B, -1, heads, d)[:, :meta.max_kv].transpose(1, 2)
    out = sdpa(qb, kb, vb, mask=meta.mask, scale=scale).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out if meta.out_rows is None else out[meta.out_rows]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
         causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA over q [B, Hq, Q, d] and k/v [B, Hkv, K, d] with grouped query heads. On CUDA no fused
    kernel takes grouped heads in fp32, so enable_gqa would send fp32 to the math kernel, which
    materialises every score (1.27 ms against 0.76 ms with the heads repeated, for 32 x 450
    tokens of prefill on an H200); there the K/V heads are repeated instead. In bf16 cuDNN takes
    grouped heads with a mask (0.12 ms; 0.16 ms repeated), and the CPU's flash kernel takes both."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.is_cuda and q.dtype == torch.float32:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
