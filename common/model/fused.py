"""Fused kernels for the small element-wise steps of a decoder layer, on CUDA.

A decode step at small batch is a few hundred short kernels, and on a GPU their launch and
memory round trips cost as much as the matrix products (docs/PERFORMANCE.md, issue 19). Each
function here does in one Triton kernel what plain PyTorch does in two to six:

  rms_norm       x.float() -> rms -> cast -> * weight
  add_rms_norm   the residual add, then the norm of the sum
  silu_mul       SiLU(gate) * up, from the fused gate/up projection's output
  rope_write_kv  RoPE on q and k of the fused q/k/v projection's output (after per-head
                 RMSNorms, for models that have them), and K and V written into their cache
                 slots; returns the rotated q
  argmax         x.argmax(-1) over a few rows of logits, in two short kernels (torch's gives a
                 row to one block, which walks the whole vocabulary)

The kernels round where PyTorch rounds (the residual sum and the normed value are cast to the
input dtype before the weight multiplies them, SiLU's output before the product), so fp32
results agree with the plain path to reduction order and bf16 results to one rounding.

The plain path runs where a kernel cannot: on the CPU (unless under Triton's interpreter), without Triton, when autograd needs
the graph (drafter training), or inside `with disabled():` (the GPU check compares both).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton's interpreter runs the kernels on CPU tensors: the tests use it where there is no GPU.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_enabled = True


@contextmanager
def disabled() -> Iterator[None]:
    """The plain path inside the block (the GPU check compares the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on t: CUDA, or any tensor under Triton's interpreter,
    with Triton installed and the kernels not disabled."""
    return _enabled and HAS_TRITON and (t.is_cuda or _INTERPRETED)


def active(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels run for these inputs: they can (runs_on) and autograd does not
    need the graph (these kernels have no backward)."""
    if not runs_on(tensors[0]):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rope_fusable(qkv: torch.Tensor, head_dim: int) -> bool:
    return active(qkv) and head_dim & (head_dim - 1) == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dimension, normalised in fp32 and scaled in x's dtype
    (as the reference implementations do, so fp32 and bf16 outputs match Hugging Face's)."""
    if not active(x, weight):
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), rows.stride(0), out.stride(0),
                                   rows.shape[1], eps, ADD=False, BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next norm, for h [T, H]."""
    if not active(h, delta, weight):
        s = h + delta
        return s, rms_norm(s, weight, eps)
    h, delta = h.contiguous(), delta.contiguous()
    s, out = torch.empty_like(h), torch.empty_like(h)
    _norm_kernel[(h.shape[0],)](h, delta, weight, s, out, h.stride(0), delta.stride(0), out.stride(0),
                                h.shape[1], eps, ADD=True, BLOCK=triton.next_power_of_2(h.shape[1]))
    return s, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] (gate first) -> [T, I]."""
    if not active(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    T, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(T, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), width, BLOCK=block)
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, num_heads: int,
                  num_kv_heads: int, kv_layer: torch.Tensor, write_slots: torch.Tensor,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * d] (q, k, v heads side by side), cos / sin_signed [T, d] at the
    tokens' positions (common.model.transformer.rope_cos_sin's tables). Writes the rotated
    K and V of token t into slot write_slots[t] of kv_layer [2, pages, page_size, Hkv, d] and
    returns the rotated q [T, Hq, d]. qk_norm (q's weight [d], k's weight [d], eps): each q and
    k head is RMS-normed before it is rotated, rounded where RMSNorm's kernel rounds (Qwen3, the
    DFlash drafter). CUDA only, and d a power of two (callers check rope_fusable())."""
    T, d = qkv.shape[0], kv_layer.shape[-1]
    q = torch.empty(T, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    k_cache = kv_layer[0].view(-1, num_kv_heads, d)
    v_cache = kv_layer[1].view(-1, num_kv_heads, d)
    # Without norms the kernel reads no weight: any tensor fills the arguments.
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_write_kernel[(T, num_heads + num_kv_heads)](
        qkv, cos, sin_signed, write_slots, q, k_cache, v_cache, q_weight, k_weight, eps, qkv.stride(0), cos.stride(0),
        sin_signed.stride(0), k_cache.stride(0), k_cache.stride(1), HQ=num_heads, HKV=num_kv_heads, D=d,
        NORM=qk_norm is not None)
    return q


ARGMAX_CHUNK = 2048  # values one program of argmax's first pass reduces


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [R, V], int64 [R]: the first index of each row's largest value, as
    torch returns it, NaN counting as the largest (so a row of overflowed logits still yields a
    token of the vocabulary). First the largest value and its first index in each chunk of
    ARGMAX_CHUNK, then per row the first chunk's index among those that reach the row's largest."""
    if not active(x) or x.dim() != 2:
        return x.argmax(-1)
    R, V = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    chunks = triton.cdiv(V, ARGMAX_CHUNK)
    values = torch.empty(R, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(R, chunks, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(R, chunks)](x, values, indices, x.stride(0), V, chunks, BLOCK=ARGMAX_CHUNK)
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    _argmax_row_kernel[(R,)](values, indices, out, chunks, BLOCK=triton.next_power_of_2(chunks))
    return out


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_kernel(h_ptr, d_ptr, w_ptr, s_ptr, out_ptr, stride_h, stride_d, stride_out, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 (a dense pass's rows)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
        if ADD:  # the sum is rounded to the residual stream's dtype before it is normed
            x = (x.to(tl.float32) + tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
            x = x.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * stride_out + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_row, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 (a dense pass's rows)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(gu_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_row + width + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, eps,
                           stride_qkv, stride_cos, stride_sin, stride_cache_slot, stride_cache_head,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
        # One program: token t, head h of q (h < HQ) or of k and v (h >= HQ). Rotate-half RoPE
        # with its sign folded into the sin table: x * cos + roll(x, D/2) * sin_signed.
        t = tl.program_id(0)
        h = tl.program_id(1)
        dd = tl.arange(0, D)
        half = (dd + D // 2) % D
        src = qkv_ptr + t * stride_qkv + h * D
        x = tl.load(src + dd).to(tl.float32)
        rolled = tl.load(src + half).to(tl.float32)
        if NORM:  # as _norm_kernel: normed and rounded, times the weight and rounded, then rotated
            out_ty = q_ptr.dtype.element_ty
            is_q = h < HQ
            w = tl.where(is_q, tl.load(qw_ptr + dd), tl.load(kw_ptr + dd)).to(tl.float32)
            w_rolled = tl.where(is_q, tl.load(qw_ptr + half), tl.load(kw_ptr + half)).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
            x = ((x * rstd).to(out_ty).to(tl.float32) * w).to(out_ty).to(tl.float32)
            rolled = ((rolled * rstd).to(out_ty).to(tl.float32) * w_rolled).to(out_ty).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cos + dd).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + dd).to(tl.float32)
        y = (x * c + rolled * s).to(q_ptr.dtype.element_ty)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + dd, y)
        else:
            slot = tl.load(slot_ptr + t)
            kh = h - HQ
            tl.store(k_ptr + slot * stride_cache_slot + kh * stride_cache_head + dd, y)
            v = tl.load(qkv_ptr + t * stride_qkv + (HQ + HKV + kh) * D + dd)
            tl.store(v_ptr + slot * stride_cache_slot + kh * stride_cache_head + dd, v)

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, values_ptr, indices_ptr, stride_x, V, chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        real = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=real, other=float("-inf")).to(tl.float32)
        # NaN is the largest, as in torch (the GPU's max would skip it): the first NaN if any.
        nan = x != x
        top = tl.max(tl.where(nan, float("-inf"), x), 0)
        first = tl.min(tl.where((x == top) & real, cols, V + BLOCK), 0)
        first_nan = tl.min(tl.where(nan, cols, V + BLOCK), 0)
        has_nan = first_nan < V + BLOCK
        tl.store(values_ptr + row * chunks + chunk, tl.where(has_nan, float("nan"), top))
        tl.store(indices_ptr + row * chunks + chunk, tl.where(has_nan, first_nan, first).to(tl.int64))

    @triton.jit
    def _argmax_row_kernel(values_ptr, indices_ptr, out_ptr, chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < chunks
        v = tl.load(values_ptr + row * chunks + c, mask=ok, other=float("-inf"))
        i = tl.load(indices_ptr + row * chunks + c, mask=ok, other=0)
        nan = ok & (v != v)
        top = tl.max(tl.where(nan, float("-inf"), v), 0)
        # Chunks are in column order: the smallest index of a chunk holding NaN is the row's first
        # NaN; else the smallest among the chunks that reach the largest value.
        pick = tl.where(tl.max(nan.to(tl.int32), 0) > 0, nan, ok & (v == top))
        big = tl.full((BLOCK,), 2**62, dtype=tl.int64)
        tl.store(out_ptr + row, tl.min(tl.where(pick, i, big), 0))
