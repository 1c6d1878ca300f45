"""Attention over a paged KV cache whose tensor shapes never depend on the batch's lengths, so
that a step can be captured once in a CUDA graph and replayed at any lengths.

Each of `rows` requests adds T new tokens (T = 1: decode; T = B: a speculative verify block or a
DFlash draft block), whose K/V are already written into the cache. Each row carries a page table
padded to a fixed number of pages (with the scratch page) and `kv_len`, the keys it reads: its
cached tokens and its T new ones. New token j of a row sees keys [kv_start, kv_len - (T-1-j)) when
causal (verify, decode), and keys [kv_start, kv_len) when not (a draft block sees itself both
ways); kv_start is 0 except for a drafter with a sliding window. Two implementations:

  torch   gathers every row's whole padded page table and masks: plain ops, runs anywhere;
          reads max_pages pages per row, so callers trim the table where shapes may vary (CPU).
          On a CPU one row, long rows or a large gather read the pages in place instead
          (`paged_runs`)
  triton  split-KV flash decoding: each program walks only the pages a row owns, up to its
          length, for one KV head with the row's T x (query heads of that KV head) queries at
          once (in fp32, in blocks of at most 16: Launch.ieee_block_m), over one slice of the
          context; a second kernel merges the slices by their log-sum-exp
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model import paged_runs

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass
class StaticAttn:
    page_table: torch.Tensor  # [rows, max_pages] int64, padded with the scratch page
    kv_len: torch.Tensor  # [rows] keys each row reads, its T new tokens included; >= T
    tokens_per_row: int  # T
    causal: bool = True
    kv_start: torch.Tensor | None = None  # [rows] first key each row reads (sliding window); None: 0
    backend: str = "torch"  # "torch" or "triton"
    # The torch backend's plan for reading the pages in place, made at the first layer's call and
    # kept for the others: the cache shape and dtype it was made for, and the plan (None: gather).
    _runs: tuple[tuple[torch.Size, torch.dtype], paged_runs.RunPlan | None] | None = field(
        default=None, init=False, repr=False, compare=False)

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q [rows * T, Hq, d] -> [rows * T, Hq, d]; kv_layer [2, pages, page_size, Hkv, d];
        `scale` None: d ** -0.5."""
        args = (self.page_table, self.kv_len, self.tokens_per_row, self.causal, self.kv_start, scale)
        if self.backend == "triton":
            return static_attention_triton(q, kv_layer, *args)
        key = (kv_layer.shape[2:], kv_layer.dtype)
        if self._runs is None or self._runs[0] != key:
            self._runs = key, paged_runs.plan(self.page_table, self.kv_len, self.kv_start, self.tokens_per_row,
                                              self.causal, kv_layer)
        if self._runs[1] is not None:
            return self._runs[1].attend(q, kv_layer, scale)
        return static_attention_torch(q, kv_layer, *args)


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and HAS_TRITON else "torch"


def static_attention_torch(q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
                           T: int = 1, causal: bool = True, kv_start: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    rows, max_pages = page_table.shape
    heads, d = kv_layer.shape[-2:]
    pages = page_table.flatten()
    k = gather_pages(kv_layer[0], pages).view(rows, -1, heads, d).transpose(1, 2)  # [rows, Hkv, S, d]
    v = gather_pages(kv_layer[1], pages).view(rows, -1, heads, d).transpose(1, 2)
    mask = _mask(k.shape[2], kv_len, T, causal, kv_start)  # [rows, T, S]
    qb = q.view(rows, T, q.shape[1], d).transpose(1, 2)  # [rows, Hq, T, d]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != heads,
                                         scale=scale)
    return out.transpose(1, 2).reshape(rows * T, q.shape[1], d)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """These pages of one layer's K or V cache [pages, page_size, heads, dim], in order. A row
    lookup in its 2-D view: on a CPU several times faster than index_select on the 4-D tensor."""
    return F.embedding(pages, cache.view(cache.shape[0], -1)).view(-1, *cache.shape[1:])


def _mask(keys: int, kv_len: torch.Tensor, T: int, causal: bool, kv_start: torch.Tensor | None) -> torch.Tensor:
    key = torch.arange(keys, device=kv_len.device)[None, None, :]
    hi = kv_len[:, None].expand(-1, T)
    if causal:
        hi = hi - (T - 1 - torch.arange(T, device=kv_len.device))[None, :]
    mask = key < hi[:, :, None]
    if kv_start is not None:
        mask = mask & (key >= kv_start[:, None, None])
    return mask


MAX_SPLITS = 64  # slices per (row, KV head) at most: the merge kernel loads them in one block


@dataclass(frozen=True)
class Launch:
    """How the Triton kernels are launched; `gpu-check --parts attention-launch` times the choices
    against each other (docs/PERFORMANCE.md, 2026-12-03).

    target_programs: programs a call aims for: 256 left long contexts at large batches
    latency-bound (few programs each walking its keys block after block), 2048 split short
    contexts into slices of one block each. On the H200 (bf16, graphs), against 2048 programs, 4
    warps, 3 stages and a 64-wide merge, these values took the 8B shape's batch-32 attention from
    18.3 to 14.6 us at 160 tokens and from 81.1 to 70.4 us at 2048, its verify block (batch 8, T 16)
    from 53.4 to 31.5 us, no case more than 5% slower; the whole 8B step at batch 32 1.53x -> 1.47x
    its floor."""
    target_programs: int = 1024
    block_n: int = 32  # keys per block of the split kernel
    num_warps: int = 2
    num_stages: int = 2
    fit_merge: bool = True  # the merge kernel's block of slices: the next power of two, not MAX_SPLITS
    # fp32 caches (exact products, no tensor cores): a row's T x group queries per KV head go to
    # programs of at most this many, not into one tile of the next power of two. On an H100, fp32,
    # batch 1, the embedded model's 3 query heads per KV head, a verify block of 6 (18 queries: a
    # 32-row tile) cost 195 us more a step than one of 5 (16 queries), against 50 us from 4 to 5
    # (docs/PERFORMANCE.md, 2026-12-06): the jump is where the tile doubles (exact fp32 products
    # on a 32-row tile need far more registers than 2 warps hold). With 16 on an H200 (same page),
    # blocks of 6 to 8 cost 1.45-1.58 ms a step against 1.56-1.73 with 0, and of 16 1.89 against
    # 2.42; 4 and 5 unchanged. `attention-launch` (bf16) does not vary it. 0: one program for all
    # of a row's queries; else a power of two of at least 16 (tl.dot's smallest tile).
    ieee_block_m: int = 16

    def __post_init__(self) -> None:
        m = self.ieee_block_m
        if m and (m < 16 or m & (m - 1)):
            raise ValueError(f"Launch.ieee_block_m {m}: 0, or a power of two of at least 16")


LAUNCH = Launch()


def num_splits(batch: int, kv_heads: int, max_keys: int, launch: Launch) -> int:
    """Context slices per (row, KV head; per block of its queries where they take several):
    about launch.target_programs programs in all, but no more slices than blocks of keys. A
    runtime argument: one compiled kernel serves them all."""
    return max(1, min(launch.target_programs // (batch * kv_heads), -(-max_keys // launch.block_n), MAX_SPLITS))


def static_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
                            T: int = 1, causal: bool = True, kv_start: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    launch = LAUNCH  # read per call: gpu-check swaps it to time the choices
    rows = page_table.shape[0]
    Hq, d = q.shape[1], q.shape[2]
    page_size, Hkv = kv_layer.shape[2], kv_layer.shape[3]
    # Rows may be strided (q is a slice of the fused q/k projection; the static inputs are
    # columns of one packed buffer); the innermost dimension must not be.
    assert q.stride(2) == 1 and page_table.stride(1) == 1
    group = Hq // Hkv
    queries = T * group  # per KV head
    block_m = max(16, triton.next_power_of_2(queries))
    ieee = q.dtype == torch.float32
    if ieee and launch.ieee_block_m:
        block_m = min(block_m, launch.ieee_block_m)
    query_blocks = -(-queries // block_m)
    splits = num_splits(rows, Hkv * query_blocks, page_table.shape[1] * page_size, launch)
    k_cache = kv_layer[0].view(-1, Hkv, d)  # [slot, head, dim]
    v_cache = kv_layer[1].view(-1, Hkv, d)
    part_out = torch.empty(rows * T, Hq, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows * T, Hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(rows * T, Hq, d, dtype=q.dtype, device=q.device)
    start = kv_len if kv_start is None else kv_start  # unread when WINDOW is off
    block_d = triton.next_power_of_2(d)
    _split_kernel[(rows, Hkv * query_blocks, splits)](
        q, k_cache, v_cache, page_table, kv_len, start, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0), kv_len.stride(0),
        start.stride(0), d ** -0.5 if scale is None else scale, splits,
        T=T, CAUSAL=causal, WINDOW=kv_start is not None, PAGE=page_size, GROUP=group, D=d,
        QUERY_BLOCKS=query_blocks, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=launch.block_n,
        IEEE=ieee, num_warps=launch.num_warps, num_stages=launch.num_stages)
    _merge_kernel[(rows * T, Hq)](part_out, part_lse, out, out.stride(0), out.stride(1), splits,
                                  D=d, BLOCK_S=max(2, triton.next_power_of_2(splits)) if launch.fit_merge else MAX_SPLITS,
                                  BLOCK_D=block_d)
    return out


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, len_ptr, start_ptr, po_ptr, plse_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_len, stride_start,
                      scale, splits,
                      T: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PAGE: tl.constexpr,
                      GROUP: tl.constexpr, D: tl.constexpr, QUERY_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # One program: row b, KV head h, block qb of its queries, slice s of the row's keys. The
        # queries of h are the row's T new tokens x the GROUP query heads of h: query m is token
        # m // GROUP, head m % GROUP; a program takes queries [qb BLOCK_M, (qb + 1) BLOCK_M),
        # padded to at least 16, tl.dot's smallest tile.
        b = tl.program_id(0)
        h = tl.program_id(1) // QUERY_BLOCKS
        qb = tl.program_id(1) % QUERY_BLOCKS
        s = tl.program_id(2)
        length = tl.load(len_ptr + b * stride_len).to(tl.int32)
        per = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
        lo = s * per
        end = tl.minimum(lo + per, length)

        m_idx = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = m_idx // GROUP
        head = h * GROUP + m_idx % GROUP
        m_ok = m_idx < T * GROUP
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        q_rows = (b * T + tok) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dd[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if CAUSAL:
            hi = length - (T - 1 - tok)  # [BLOCK_M] keys < hi are visible to the query
        else:
            hi = tl.zeros([BLOCK_M], tl.int32) + length
        if WINDOW:
            first = tl.load(start_ptr + b * stride_start).to(tl.int32)
        else:
            first = 0
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            page = tl.load(pt_ptr + b * stride_pt + n // PAGE, mask=n_ok, other=0)
            slot = page * PAGE + n % PAGE
            kv_off = slot[:, None] * stride_kt + h * stride_kh + dd[None, :]
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
            if IEEE:  # fp32 caches: no TF32 rounding, so fp32 runs match the reference
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = (n[None, :] < hi[:, None]) & (n[None, :] >= first) & n_ok[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            # A query that has seen no key yet keeps m = -inf: subtract 0 instead (p is 0 anyway).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        # A query that saw no key in this slice has l == 0: weight -inf, so the merge ignores it.
        lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
        o = acc / tl.maximum(l, 1e-30)[:, None]
        heads = tl.num_programs(1) // QUERY_BLOCKS * GROUP  # Hq
        base = ((b * T + tok) * heads + head) * splits + s  # [query, head, s] in the partials
        tl.store(po_ptr + base[:, None] * D + dd[None, :], o, mask=m_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + base, lse, mask=m_ok)

    @triton.jit
    def _merge_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh, splits,
                      D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        base = r * tl.num_programs(1) + h
        sp = tl.arange(0, BLOCK_S)
        sp_ok = sp < splits
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        lse = tl.load(plse_ptr + base * splits + sp, mask=sp_ok, other=float("-inf"))
        top = tl.max(lse, 0)  # finite: every query sees at least one key (its own token)
        w = tl.exp(lse - top)
        parts = tl.load(po_ptr + (base * splits + sp)[:, None] * D + dd[None, :],
                        mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + r * stride_ob + h * stride_oh + dd, o.to(out_ptr.dtype.element_ty), mask=d_ok)
