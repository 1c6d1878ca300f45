"""Decode attention (one new token per row) whose tensor shapes never depend on the batch's
lengths, so that a decode step can be captured once in a CUDA graph and replayed at any lengths.

Each row carries a page table padded to a fixed number of pages (with the scratch page) and its
context length (keys to read, the new token's included). Two implementations:

  torch   gathers every row's whole padded page table and masks keys past its length: plain
          ops, runs anywhere; reads max_pages pages per row, so it suits small pools (CPU tests)
  triton  split-KV flash decoding: each program walks only the pages a row owns, up to its
          length, for one KV head (all its query heads at once) and one slice of the context;
          a second kernel merges the slices by their log-sum-exp
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass
class StaticDecode:
    page_table: torch.Tensor  # [B, max_pages] int64, padded with the scratch page
    ctx_lens: torch.Tensor  # [B] keys each row reads (its new token included); >= 1
    backend: str  # "torch" or "triton"

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, d] -> [B, Hq, d]; kv_layer [2, pages, page_size, Hkv, d] already holds the
        new tokens' K/V."""
        fn = decode_attention_triton if self.backend == "triton" else decode_attention_torch
        return fn(q, kv_layer, self.page_table, self.ctx_lens)


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and HAS_TRITON else "torch"


def decode_attention_torch(q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor,
                           ctx_lens: torch.Tensor) -> torch.Tensor:
    B, max_pages = page_table.shape
    heads, d = kv_layer.shape[-2:]
    pages = page_table.flatten()
    k = kv_layer[0].index_select(0, pages).view(B, -1, heads, d).transpose(1, 2)  # [B, Hkv, S, d]
    v = kv_layer[1].index_select(0, pages).view(B, -1, heads, d).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < ctx_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         enable_gqa=q.shape[1] != heads)
    return out.squeeze(2)


MAX_SPLITS = 64  # the merge kernel loads a row's slices in one block of this size


def num_splits(batch: int, kv_heads: int, max_keys: int, block_n: int = 32) -> int:
    """Context slices per (row, KV head): enough programs to fill a large GPU at batch 1, but no
    more slices than blocks of keys. A runtime argument: one compiled kernel serves them all."""
    return max(1, min(256 // (batch * kv_heads), -(-max_keys // block_n), MAX_SPLITS))


def decode_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor,
                            ctx_lens: torch.Tensor) -> torch.Tensor:
    B, Hq, d = q.shape
    page_size, Hkv = kv_layer.shape[2], kv_layer.shape[3]
    # Rows may be strided (q is a slice of the fused q/k projection; the static inputs are
    # columns of one packed buffer); the innermost dimension must not be.
    assert q.stride(2) == 1 and page_table.stride(1) == 1
    group = Hq // Hkv
    splits = num_splits(B, Hkv, page_table.shape[1] * page_size)
    k_cache = kv_layer[0].view(-1, Hkv, d)  # [slot, head, dim]
    v_cache = kv_layer[1].view(-1, Hkv, d)
    part_out = torch.empty(B, Hq, splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(d)
    _split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, page_table, ctx_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0), ctx_lens.stride(0),
        d ** -0.5, splits,
        PAGE=page_size, GROUP=group, D=d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=32, IEEE=q.dtype == torch.float32)
    _merge_kernel[(B, Hq)](part_out, part_lse, out, out.stride(0), out.stride(1), splits,
                           D=d, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d)
    return out


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, len_ptr, po_ptr, plse_ptr,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_pt, stride_len, scale, splits,
                      PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr):
        # One program: row b, KV head h, slice s of the row's context, all GROUP query heads
        # of h at once (padded to BLOCK_G rows so that tl.dot can use tensor cores).
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(len_ptr + b * stride_len).to(tl.int32)
        per = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, length)

        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = dd < D
        q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + dd[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
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
            scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        # An empty slice (short context) leaves l == 0: weight -inf, so the merge ignores it.
        lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
        o = acc / tl.maximum(l, 1e-30)[:, None]
        heads = tl.num_programs(1) * GROUP  # Hq
        base = (b * heads + h * GROUP + g) * splits + s  # [b, query head, s] in the partials
        tl.store(po_ptr + base[:, None] * D + dd[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + base, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh, splits,
                      D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        base = b * tl.num_programs(1) + h
        sp = tl.arange(0, BLOCK_S)
        sp_ok = sp < splits
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        lse = tl.load(plse_ptr + base * splits + sp, mask=sp_ok, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # slice 0 is never empty: the max is finite
        parts = tl.load(po_ptr + (base * splits + sp)[:, None] * D + dd[None, :],
                        mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + dd, o.to(out_ptr.dtype.element_ty), mask=d_ok)
