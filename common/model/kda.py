"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear, over per-request state slots.

Per layer, H heads of key and value width D (K = V = D), for token t of a request:

  q~,k~,v~ = x W_q, x W_k, x W_v                          each [H*D]
  q,k,v    = SiLU(causal depthwise conv_W(q~|k~|v~))        W taps per channel, no bias
  q,k      = per head x / sqrt(sum(x^2) + 1e-6); q *= D^-0.5 (fp32)
  g_t      = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)   [H, D] log-decay per channel
  beta_t   = sigmoid(b(x))                                  [H]
  S'       = diag(exp(g_t)) S_(t-1)                          S [H, D(k), D(v)] fp32
  S_t      = S' + k_t (beta_t (v_t - S'^T k_t))^T            the delta rule on the decayed state
  o_t      = S_t^T q_t
  y        = o_proj(RMSNorm_D(o_t) * sigmoid(g_b(g_a(x))))   per head, in fp32

exactly as transformers' `KimiLinearDeltaAttention` defines it. A request's memory is its slot:
the recurrent state S and the convolution window (the last W - 1 pre-convolution inputs of each
q, k and v channel). One new token takes the one-step form; more (a prefill chunk) take the
chunked form below, which equals running the one-step form token by token.

A speculative verify block (B tokens per row, of which the step keeps only an accepted prefix
it learns after the forward) cannot advance the slot: a recurrent state cannot drop tokens
afterwards. Instead the block reads the slot, leaves it as it was and keeps what its tokens
would add (`BlockInputs`: the conv inputs, and k, v, g, beta per token); `commit_block` then
replays the first `count` tokens of each row onto its slot. The replay is the chunked form with
g = 0 and beta = 0 past `count`, which makes those tokens the identity (no decay, no update), so
one static-shape call serves every count: no host read, as a CUDA graph needs.

Chunked form (C tokens at a time, per head, fp32), with G = cumsum(g) inside the chunk and
decay[i, j, c] = exp(G_ic - G_jc) for j <= i (never above 1, so nothing overflows):
  A[i, j]  = beta_i sum_c k_ic k_jc decay[i, j, c]  (j < i)     T = (I + A)^-1 (unit lower triangular)
  U = T diag(beta) V          Wk = T diag(beta) (K * exp(G))
  V_new = U - Wk S            O = (Q * exp(G)) S + (sum_c q_ic k_jc decay[i, j, c])_(j <= i) V_new
  S <- exp(G_last) S + (K * exp(G_last - G))^T V_new
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.model.attention import AttnMeta
from common.model.config import ModelConfig
from common.model.transformer import linear

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)
L2_EPS = 1e-6  # of the q/k normalisation, as transformers and FLA use it


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k, v, g [B, H, D], beta [B, H], state [B, H, D, D] (fp32) ->
    output [B, H, D] and the new state."""
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def kda_chunked(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor | None, torch.Tensor]:
    """n tokens per row: q, k, v, g [B, H, n, D], beta [B, H, n], state [B, H, D, D] (fp32) ->
    output [B, H, n, D] and the state after the last token (the module docstring's chunked form).
    q None: the state alone (output None)."""
    n = k.shape[2]
    out = None if q is None else torch.empty_like(v)
    for start in range(0, n, chunk):
        s = slice(start, min(start + chunk, n))
        kc, vc, bc = k[:, :, s], v[:, :, s], beta[:, :, s, None]
        G = g[:, :, s].cumsum(2)  # [B, H, C, D]
        C = G.shape[2]
        below = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        decay = (G[:, :, :, None] - G[:, :, None, :]).masked_fill(~below[..., None], float("-inf")).exp()
        a = ((kc[:, :, :, None] * kc[:, :, None, :] * decay).sum(-1) * bc).tril(-1)
        eye = torch.eye(C, dtype=k.dtype, device=k.device)
        # (I + A) X = [beta V | beta K exp(G)]: unit lower triangular, solved by substitution.
        rhs = torch.cat([vc * bc, kc * bc * G.exp()], -1)
        u, wk = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split(
            [vc.shape[-1], kc.shape[-1]], -1)
        v_new = u - wk @ state
        if out is not None:
            qc = q[:, :, s]
            qk = (qc[:, :, :, None] * kc[:, :, None, :] * decay).sum(-1)  # masked above by decay = 0
            out[:, :, s] = (qc * G.exp()) @ state + qk @ v_new
        last = G[:, :, -1:]  # [B, H, 1, D]
        state = state * last.transpose(2, 3).exp() + (kc * (last - G).exp()).transpose(2, 3) @ v_new
    return out, state


@dataclass
class BlockInputs:
    """Verify blocks' scratch of KDA layers (leading dims [layers] for all, or one layer's),
    sized for the largest batch and block; rows are a static step's rows, not slots.
    window [.., rows, 3*H*D, W-1+B]: the row's conv window, then its block's conv inputs;
    tokens [.., rows, B, H, 3D+1] fp32: each block token's k, v (after conv, SiLU and norm), g
    and beta, all that the state update reads."""

    window: torch.Tensor
    tokens: torch.Tensor

    def layer(self, i: int) -> "BlockInputs":
        return BlockInputs(self.window[i], self.tokens[i])

    def fits(self, rows: int, block: int) -> bool:
        return rows <= self.tokens.shape[-4] and block <= self.tokens.shape[-3]


def commit_block(recurrent: torch.Tensor, conv: torch.Tensor, block: BlockInputs, slots: torch.Tensor,
                 count: torch.Tensor, B: int) -> None:
    """Advance the slots [rows] of one layer's recurrent [slots, H, D, D] and conv [slots, 3*H*D,
    W-1] by the first count[i] (0..B) tokens of row i's verify block of B, from `block` (this
    layer's, as the block's forward left it). Static shapes, no host read."""
    rows, W1, D = slots.shape[0], conv.shape[-1], recurrent.shape[-1]
    k, v, g, beta = block.tokens[:rows, :B].split([D, D, D, 1], -1)
    drop = torch.arange(B, device=count.device)[None, :] >= count[:, None]  # [rows, B]
    # Dropped tokens neither decay (g = 0) nor update (beta = 0) the state: they are the identity.
    g, beta = g.masked_fill(drop[..., None, None], 0), beta[..., 0].masked_fill(drop[..., None], 0)
    _, state = kda_chunked(None, *(t.transpose(1, 2) for t in (k, v, g, beta)), recurrent[slots])
    recurrent.index_copy_(0, slots, state)
    # The window after `count` tokens: the W - 1 conv inputs before the first dropped one.
    taps = (count[:, None] + torch.arange(W1, device=count.device)[None, :])[:, None, :]
    conv.index_copy_(0, slots, block.window[:rows].gather(2, taps.expand(rows, conv.shape[1], W1)))


class KimiDeltaAttention(nn.Module):
    """One KDA layer (`cfg.kda` heads). Its state is passed in: `recurrent` [slots, H, D, D] fp32 and
    `conv` [slots, 3*H*D, W-1] (the layer's slice of common.kv.state_pool's tensors); each
    request's row is the slot `meta.state_slots` names. Slot 0 is scratch: padding rows of a
    static step read and write it, and no request owns it. With `block` (a verify block, this
    layer's BlockInputs) the slots are read and left as they were; the block's inputs go there."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        k = cfg.kda
        self.cfg, self.heads, self.dim = cfg, k.num_heads, k.head_dim
        P = k.proj_size
        # Everything read from the hidden state in one matmul: q, k, v, then the low-rank inputs
        # of the forget gate (f_a) and of the output gate (g_a), then beta's logits.
        self.splits = [3 * P, self.dim, self.dim, self.heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * P, k.conv_size))
        self.f_b_proj = nn.Linear(self.dim, P, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.g_b_proj = nn.Linear(self.dim, P, bias=False)
        self.o_norm = nn.Parameter(torch.empty(self.dim))
        self.o_proj = nn.Linear(P, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor, meta: AttnMeta,
                block: BlockInputs | None = None) -> torch.Tensor:
        H, D, T = self.heads, self.dim, x.shape[0]
        mixed, f_a, g_a, b = linear(x, self.in_proj.weight).split(self.splits, -1)
        g = linear(f_a, self.f_b_proj.weight).float() + self.dt_bias.float()
        g = (-self.A_log.float().exp()[:, None] * F.softplus(g.view(T, H, D))).view(T, H * D)
        beta = b.float().sigmoid()
        slots, counts, fresh = meta.state_slots, meta.state_counts, meta.state_fresh
        if counts is None or len(set(counts)) == 1:  # every request adds as many tokens: one batch
            o = self._rows(mixed, g, beta, slots, fresh, recurrent, conv, block)
        else:  # prefill chunks: never a verify block
            ends = torch.tensor(counts).cumsum(0).tolist()
            o = torch.cat([self._rows(mixed[e - n:e], g[e - n:e], beta[e - n:e], slots[i:i + 1],
                                      None if fresh is None else fresh[i:i + 1], recurrent, conv)
                           for i, (n, e) in enumerate(zip(counts, ends))])
        gate = linear(g_a, self.g_b_proj.weight).view(T, H, D)
        o = F.rms_norm(o, (D,), eps=self.cfg.rms_eps) * self.o_norm.float() * gate.float().sigmoid()
        return linear(o.to(x.dtype).view(T, H * D), self.o_proj.weight)

    def _rows(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
              fresh: torch.Tensor | None, recurrent: torch.Tensor, conv: torch.Tensor,
              block: BlockInputs | None = None) -> torch.Tensor:
        """Rows = slots.shape[0] requests of n tokens each (flattened row by row): outputs [T, H, D]
        fp32; their slots' state and windows are updated in place (or, with `block`, what would
        update them is kept there). Rows `fresh` start from zeros."""
        H, D, rows = self.heads, self.dim, slots.shape[0]
        n = mixed.shape[0] // rows
        window, state = conv[slots], recurrent[slots]
        if fresh is not None:  # where, not a product: a slot's leftovers may hold anything
            window = window.masked_fill(fresh[:, None, None], 0)
            state = state.masked_fill(fresh[:, None, None, None], 0)
        # Convolution over [window | new inputs]: the window supplies the W - 1 inputs before the
        # first new token (zeros for a fresh request, as the reference's zero padding).
        seq = torch.cat([window, mixed.view(rows, n, -1).transpose(1, 2).to(conv.dtype)], -1)
        if block is None:
            conv.index_copy_(0, slots, seq[..., -(conv.shape[-1]):])
        else:
            block.window[:rows, :, :seq.shape[-1]] = seq
        qkv = F.silu(F.conv1d(seq.to(self.conv_weight.dtype), self.conv_weight[:, None], groups=seq.shape[1]))
        q, k, v = qkv.transpose(1, 2).float().view(rows, n, 3, H, D).unbind(2)  # [rows, n, H, D] each
        q, k = l2norm(q) * D ** -0.5, l2norm(k)
        g, beta = g.view(rows, n, H, D), beta.view(rows, n, H)
        if n == 1:
            o, state = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]
        else:
            o, state = kda_chunked(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), state)
            o = o.transpose(1, 2)
        if block is None:
            recurrent.index_copy_(0, slots, state)
        else:
            block.tokens[:rows, :n] = torch.cat([k, v, g, beta[..., None]], -1)
        return o.reshape(rows * n, H, D)

    def hf_weights(self, tensors: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
        """This module's parameters from Hugging Face tensors under `src` ("model.layers.{i}.self_attn."),
        named as the model's own checkpoints and transformers' save_pretrained write them
        (separate q/k/v convolutions, the forget gate's f_a/f_b/dt_bias/A_log beside the rest)."""
        t = lambda name: tensors[src + name]
        return {
            "in_proj.weight": torch.cat([t("q_proj.weight"), t("k_proj.weight"), t("v_proj.weight"),
                                         t("f_a_proj.weight"), t("g_a_proj.weight"), t("b_proj.weight")]),
            "conv_weight": torch.cat([t(f"{p}_conv1d.weight")[:, 0] for p in "qkv"]),
            "f_b_proj.weight": t("f_b_proj.weight"),
            "dt_bias": t("dt_bias"),
            "A_log": t("A_log").flatten(),
            "g_b_proj.weight": t("g_b_proj.weight"),
            "o_norm": t("o_norm.weight"),
            "o_proj.weight": t("o_proj.weight"),
        }
