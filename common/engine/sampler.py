"""The batched sampler.

It runs on the device in a fixed number of tensor operations, so it works inside CUDA graphs and
needs no host synchronisation. Its randomness is position-keyed: the token drawn at output
position i of a request depends only on the logits, the request's seed and i (a counter-based
hash, not a generator's state), so a request sampled partly on P and partly on D, or verified in
blocks by speculative decoding, draws exactly what plain decoding alone draws. Drawing is
Gumbel-max: argmax(logits / T + g) with g = -log(-log(u)), u uniform, picks token t with
probability softmax(logits / T)[t]. On CUDA one Triton kernel draws (common.engine.draw): the same
kept tokens and the same noise, made only for the tokens a row keeps.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from common.engine.draw import draw
from common.engine.sampling import SamplingParams, new_seed
from common.model import fused


# PDFLASH_SAMPLER=torch keeps the PyTorch path where the draw kernel could run (an A/B of the two).
SAMPLER = os.environ.get("PDFLASH_SAMPLER", "kernel")
if SAMPLER not in ("kernel", "torch"):
    raise ValueError(f"PDFLASH_SAMPLER={SAMPLER!r}: expected kernel or torch")


class Mode(IntEnum):
    """What a batch's sampler must do; a larger mode also serves the smaller ones' rows."""

    GREEDY = 0  # argmax only
    TEMPERATURE = 1  # some rows sample, none with top-k / top-p
    FULL = 2  # some rows use top-k or top-p (a sort over the vocabulary)


def mode_of(params: Sequence[SamplingParams]) -> Mode:
    mode = Mode.GREEDY
    for p in params:
        if not p.greedy:
            mode = max(mode, Mode.FULL if p.top_k > 0 or p.top_p < 1.0 else Mode.TEMPERATURE)
    return mode


def row_values(p: SamplingParams, seed: int) -> tuple[float, float, int, int]:
    """(temperature, top_p, top_k, seed) of one row as the sampler reads them; greedy rows have
    temperature 0."""
    return (0.0 if p.greedy else p.temperature, p.top_p, p.top_k, seed)


@dataclass
class SamplingRows:
    """Per-row sampling inputs, device tensors of shape [rows]."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; 0 = off
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: the output position being drawn

    def repeat(self, n: int, step_offset: torch.Tensor) -> "SamplingRows":
        """Each row n times, at steps step + step_offset[j] (the positions of a verify block)."""
        rep = lambda t: t.repeat_interleave(n)  # noqa: E731
        return SamplingRows(rep(self.temperature), rep(self.top_p), rep(self.top_k), rep(self.seed),
                            (self.step[:, None] + step_offset[None, :]).flatten())


def sample_rows(logits: torch.Tensor, rows: SamplingRows | None, mode: Mode) -> torch.Tensor:
    """logits [R, V] fp32 -> tokens [R] int64 on the same device (rows: None when greedy)."""
    greedy = fused.argmax(logits)
    if mode == Mode.GREEDY:
        return greedy
    assert rows is not None
    temp = rows.temperature.clamp(min=1e-5)[:, None]
    scaled = logits / temp
    if SAMPLER == "kernel" and fused.runs_on(logits):  # one kernel, noise for the kept tokens alone
        filters = mode == Mode.FULL
        drawn = draw(scaled, noise_key(rows.seed, rows.step), rows.temperature,
                     rows.top_k if filters else None, rows.top_p if filters else None)
        return torch.where(rows.temperature > 0, drawn, greedy)
    noise = gumbel(rows.seed, rows.step, logits.shape[-1])
    if mode == Mode.TEMPERATURE:
        drawn = fused.argmax(scaled + noise)
    else:
        drawn = _drawn_top_k_top_p(scaled, noise, rows.top_k, rows.top_p)
    return torch.where(rows.temperature > 0, drawn, greedy)


def _drawn_top_k_top_p(scaled: torch.Tensor, noise: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                       ) -> torch.Tensor:
    """Gumbel-max over each row's kept head: its top_k tokens (0: all), then the smallest set of
    those whose probability reaches top_p (the first token always kept)."""
    ordered, index = scaled.sort(-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = ordered.softmax(-1)
    keep &= probs.cumsum(-1) - probs <= top_p[:, None]
    candidates = torch.where(keep, ordered + noise.gather(1, index), float("-inf"))
    return index.gather(1, candidates.argmax(-1, keepdim=True))[:, 0]


_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values in
    [0, 2^32); the multipliers are below 2^31, so no product leaves int64."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x68E31DA5) & _M32
    return h ^ (h >> 16)


def noise_key(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each row's key [R] of its noise at this output position."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return _mix32(_mix32(lo ^ _mix32(hi + 0x3C6EF372)) ^ (step & _M32))


def gumbel(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [R, vocab] float32, a function of (seed, step, token id) alone."""
    key = noise_key(seed, step)  # [R]
    token = _mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64) + 0x1B873593)  # [V]
    h = _mix32(key[:, None] ^ token[None, :])
    u = ((h.float() + 0.5) * 2.0 ** -32).clamp(1e-7, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
           seeds: Sequence[int] | None = None) -> list[int]:
    """The sampler for callers with host-side lists: logits [B, V] fp32; steps[i] = output
    position being drawn for row i; seeds[i] (default: params[i].seed, or a fresh one)."""
    if seeds is None:
        seeds = [new_seed() if p.seed is None else p.seed for p in params]
    values = [row_values(p, s) for p, s in zip(params, seeds)]
    dev = logits.device
    temp, top_p, top_k, seed = zip(*values) if values else ((), (), (), ())
    rows = SamplingRows(torch.tensor(temp, dtype=torch.float32, device=dev),
                        torch.tensor(top_p, dtype=torch.float32, device=dev),
                        torch.tensor(top_k, dtype=torch.int64, device=dev),
                        torch.tensor(seed, dtype=torch.int64, device=dev),
                        torch.tensor(list(steps), dtype=torch.int64, device=dev))
    return sample_rows(logits, rows, mode_of(params)).tolist()
