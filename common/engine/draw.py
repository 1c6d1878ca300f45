"""The sampler's draw in one Triton kernel, on CUDA (sampler.sample_rows calls it).

The PyTorch path (sampler._drawn_top_k_top_p) sorts every row of the vocabulary and makes Gumbel
noise for every token: on an H100 about 3 ms of a 5 ms decode step at batch 256, the sort 1.7 of
them (docs/PERFORMANCE.md). The kernel makes noise only for the tokens a row can draw:

- a row without top-k and top-p: one pass over the row, the argmax of logits / T + noise;
- otherwise its HEAD most likely tokens (torch.topk, in order) are walked, and only those get
  noise, when the row's kept tokens end among them (top_k <= HEAD, or the head holds more than
  top_p of the mass), as they do at nearly every decode step at T <= 1;
- a row whose kept tokens do not end there (a flat distribution, or top_k > HEAD) is drawn over
  the whole vocabulary, its thresholds found by bisection: 32 passes over the row for top-k and 33
  for top-p. Only such rows pay for them.

The kept tokens are the PyTorch path's: the top_k most likely, then those whose more likely
tokens hold at most top_p of the top_k's probability (the most likely always). Apart from the
order of sums, the two draw the same token from the same noise (tests compare them under
Triton's interpreter; `pdflash gpu-check --parts sampler` on a GPU), except at ties, which the
bisection keeps whole: a top_k past the head keeps every token equal to the k-th (fp32 logits of
a bf16 model tie often: a few more than k, each as unlikely as the k-th), and top-p keeps a group
of equal tokens at its edge whole where the sorted path keeps part of it. top_k < 0 counts as
off (SamplingParams refuses it).
"""
from __future__ import annotations

import torch

from common.model.fused import HAS_TRITON

HEAD = 256  # tokens the kernel walks in order before it falls back to the whole row
BLOCK = 4096  # tokens of a row one step of a pass reads (eight warps: 16 a thread)


def draw(scaled: torch.Tensor, key: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
         top_p: torch.Tensor | None) -> torch.Tensor:
    """Gumbel-max over each row's kept tokens. scaled [R, V] fp32 = logits / T; key [R] int64, the
    rows' noise keys (sampler.noise_key); top_k / top_p [R], or None where no row has either.
    Returns tokens [R] int64; a row with temperature 0 gets 0 (the caller takes greedy's)."""
    R, V = scaled.shape
    # The kernel indexes each input by row: a column of the decoder's packed inputs is strided.
    scaled, key, temperature = scaled.contiguous(), key.contiguous(), temperature.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=scaled.device)
    filters = top_k is not None
    head = min(HEAD, V)
    if filters:
        top_k, top_p = top_k.contiguous(), top_p.contiguous()
        values, index = scaled.topk(head, dim=-1)
    else:  # the kernel reads none of these without FILTERS
        values, index, top_k, top_p = scaled, key, key, temperature
    _draw_kernel[(R,)](scaled, values, index, key, temperature, top_k, top_p, out, V, head,
                       FILTERS=filters, BLOCK=min(BLOCK, triton.next_power_of_2(V)),
                       HEAD_BLOCK=triton.next_power_of_2(head), num_warps=8)
    return out


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32(h):
        """sampler._mix32 on int64 values in [0, 2^32)."""
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) % 4294967296
        h = h ^ (h >> 15)
        h = (h * 0x68E31DA5) % 4294967296
        return h ^ (h >> 16)

    @triton.jit
    def _gumbel(key, token):
        """sampler.gumbel's noise of these token ids (int64) for a row's key."""
        h = _mix32(key ^ _mix32(token + 0x1B873593))
        u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
        u = tl.minimum(tl.maximum(u, 1e-7), 1.0 - 1e-7)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _order_key(x):
        """An int64 that orders finite floats as they compare (their bits, the negatives' flipped)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)

    @triton.jit
    def _count_at_least(s_row, V, c, BLOCK: tl.constexpr):
        """How many of the row's tokens have an order key >= c."""
        n = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(s_row + cols, mask=cols < V, other=float("-inf"))
            n += tl.sum(((_order_key(x) >= c) & (cols < V)).to(tl.int64), 0)
        return n

    @triton.jit
    def _mass_above(s_row, V, m, c_k, c, BLOCK: tl.constexpr):
        """The unnormalised mass of the tokens kept by top-k (order key >= c_k) ranked above c."""
        total = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(s_row + cols, mask=cols < V, other=float("-inf"))
            k = _order_key(x)
            total += tl.sum(tl.where((k >= c_k) & (k > c) & (cols < V), tl.exp(x - m), 0.0), 0)
        return total

    @triton.jit
    def _draw_over_row(s_row, V, key, c, BLOCK: tl.constexpr):
        """The first token of the row with order key >= c that maximises value + noise."""
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(s_row + cols, mask=cols < V, other=float("-inf"))
            ok = (_order_key(x) >= c) & (cols < V)
            v = tl.where(ok, x + _gumbel(key, cols.to(tl.int64)), float("-inf"))
            bv = tl.max(v, 0)
            bi = tl.argmax(v, 0).to(tl.int64) + start
            better = bv > best_v
            best_i = tl.where(better, bi, best_i)
            best_v = tl.where(better, bv, best_v)
        return best_i

    @triton.jit
    def _draw_kernel(s_ptr, hv_ptr, hi_ptr, key_ptr, temp_ptr, k_ptr, p_ptr, out_ptr, V, head,
                     FILTERS: tl.constexpr, BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * V
        key = tl.load(key_ptr + row)
        lowest = tl.full((), -2147483648, tl.int64)
        token = tl.zeros((), tl.int64)
        if tl.load(temp_ptr + row) > 0:
            if FILTERS:
                top_k = tl.load(k_ptr + row)
                top_p = tl.load(p_ptr + row)
                k_eff = tl.where((top_k > 0) & (top_k < V), top_k, V)
                if (k_eff == V) & (top_p >= 1.0):
                    token = _draw_over_row(s_row, V, key, lowest, BLOCK)
                else:
                    j = tl.arange(0, HEAD_BLOCK)
                    in_head = j < head
                    hv = tl.load(hv_ptr + row * head + j, mask=in_head, other=float("-inf"))
                    m = tl.max(hv, 0)
                    e = tl.where(in_head, tl.exp(hv - m), 0.0)
                    if k_eff <= head:
                        z = tl.sum(tl.where(j < k_eff, e, 0.0), 0)
                    elif k_eff == V:  # the whole row's mass against its largest value, as softmax sums it
                        z = _mass_above(s_row, V, m, lowest, lowest - 1, BLOCK)
                    else:  # a top-k past the head: drawn by bisection below, which needs no z
                        z = tl.sum(e, 0)
                    p = e / z
                    before = tl.cumsum(p, 0) - p
                    # Without top-k, z is the whole row's; with a top-k past the head it is not
                    # known here, and that row goes on below.
                    if (k_eff <= head) | ((k_eff == V) & (tl.sum(p, 0) > top_p)):  # kept: in the head
                        keep = in_head & (j < k_eff) & (before <= top_p)
                        hi = tl.load(hi_ptr + row * head + j, mask=in_head, other=0)
                        v = tl.where(keep, hv + _gumbel(key, hi), float("-inf"))
                        token = tl.sum(tl.where(j == tl.argmax(v, 0), hi, 0), 0)
                    else:
                        c_k = lowest
                        if k_eff < V:  # the largest c with at least k_eff order keys >= c
                            hi_c = tl.full((), 2147483647, tl.int64)
                            for _ in range(32):
                                mid = c_k + (hi_c - c_k + 1) // 2
                                up = _count_at_least(s_row, V, mid, BLOCK) >= k_eff
                                c_k = tl.where(up, mid, c_k)
                                hi_c = tl.where(up, hi_c, mid - 1)
                        c = c_k
                        if top_p < 1.0:  # the smallest c whose tokens above hold at most top_p
                            if k_eff == V:  # every token is kept: z is their mass
                                budget = top_p * z
                            else:
                                budget = top_p * _mass_above(s_row, V, m, c_k, c_k - 1, BLOCK)
                            hi_c = _order_key(m)
                            for _ in range(32):
                                mid = c + (hi_c - c) // 2
                                down = _mass_above(s_row, V, m, c_k, mid, BLOCK) <= budget
                                hi_c = tl.where(down, mid, hi_c)
                                c = tl.where(down, c, mid + 1)
                        token = _draw_over_row(s_row, V, key, c, BLOCK)
            else:
                token = _draw_over_row(s_row, V, key, lowest, BLOCK)
        tl.store(out_ptr + row, token)
