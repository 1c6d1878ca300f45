"""The transformer math for Llama / Qwen2 / Qwen3 dense decoders over a paged KV cache.

Only math lives here: weights come from common.model.weights, the KV cache and the per-batch
attention metadata are passed in explicitly (see common.model.attention.AttnMeta).
"""
from __future__ import annotations

import functools
import math
import os
import timeit
from collections.abc import Callable

import torch
from torch import nn

from common.model import cpu_packed, fused, gemv
from common.model.attention import AttnMeta, paged_attention
from common.model.config import ModelConfig, YarnScaling
from common.model.rope import yarn_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm), the add in the norm's kernel; (h, norm(h)) when delta is None."""
        if delta is None:
            return h, self(h)
        return fused.add_rms_norm(h, delta, self.weight, self.eps)


def rope_cos_sin(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_position, rope_dim] in fp32 for rotate-half RoPE, the sign of
    rotate-half folded into the sin table (its first half negated; see apply_rope)."""
    d = cfg.rope_dim
    attention_factor = 1.0
    if isinstance(cfg.rope_scaling, YarnScaling):
        inv_freq, attention_factor = yarn_inv_freq(d, cfg.rope_theta, cfg.rope_scaling)
    else:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if cfg.rope_scaling is not None:
            inv_freq = _llama3_scale(inv_freq, cfg)
    t = torch.arange(cfg.max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return (emb.cos() * attention_factor).to(device), (sin * attention_factor).to(device)


def _llama3_scale(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    rs = cfg.rope_scaling
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, d]; cos / sin_signed [T, d] are rope_cos_sin's tables
    gathered at the tokens' positions. With the sign folded into the table,
    rotate_half(x) * sin == roll(x, d/2) * sin_signed, exactly, in fewer ops."""
    return (x * cos.unsqueeze(1) + x.roll(x.shape[-1] // 2, -1) * sin_signed.unsqueeze(1)).to(x.dtype)


# Below this many rows (a verify block of 8 included), CPU products take the paths of linear().
CPU_FEW_ROWS = 9


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for a few rows (decode, verify and draft blocks): on CUDA the Triton GEMV
    where it is faster than cuBLAS (common.model.gemv); on CPU, bf16, one row: PyTorch's GEMM path
    is compute-bound and its GEMV kernel (torch.mv) reads the weights ~1.3x faster; on CPU, fp32,
    1 to 8 rows: W @ x.T where this CPU's BLAS runs x @ W.T's few-row cases far slower
    (cpu_fp32_transposed), with one row computed as two; on CPU, otherwise 2 to 64 rows: through
    a copy of the weight packed once (common.model.cpu_packed)."""
    if x.device.type == "cpu" and x.dim() == 2:
        if x.shape[0] < CPU_FEW_ROWS:
            if x.dtype == torch.bfloat16 and x.shape[0] == 1:
                y = torch.mv(weight, x[0]).unsqueeze(0)
                return y if bias is None else y + bias
            if x.dtype == torch.float32 and cpu_fp32_transposed():
                rows = x if x.shape[0] > 1 else torch.cat([x, x])
                y = (weight @ rows.t()).t()[:x.shape[0]].contiguous()
                return y if bias is None else y + bias
        y = cpu_packed.linear(x, weight, bias)
        if y is not None:
            return y
    return gemv.linear(x, weight, bias)


CPU_FP32_TRANSPOSED_ENV = "PDFLASH_CPU_FP32_TRANSPOSED"  # "1" / "0": cpu_fp32_transposed() without timing


@functools.cache
def cpu_fp32_transposed() -> bool:
    """Whether this CPU computes fp32 products of a few rows much faster as W @ x.T than as x @ W.T
    (F.linear). It depends on the BLAS and the CPU: on a 2-core AMD EPYC VM the LM head (49152 x
    576) at two rows took 25 ms through F.linear and 4.6 ms as W @ x.T; on a 2-core Intel Xeon VM
    with AMX 2.4 ms against 7.3 ms, and 2.3 against 7.3 ms at one row. Timed once per process on a
    product of that kind (about 70 ms); only a clear win (1.5x) leaves F.linear.

    On a busy machine that timing is noise, and ranks of one instance that chose differently would
    hold replicated products that differ by rounding (the MLA latent each TP rank writes into its
    own cache, in steps of under CPU_FEW_ROWS rows): a transfer's checksums, read from one rank's
    copy on each side, then disagree. So the worker ranks of a parallel instance take the choice
    of the process that starts them (WorkerSpec) through CPU_FP32_TRANSPOSED_ENV ("1" or "0"),
    which pins it in any process."""
    forced = os.environ.get(CPU_FP32_TRANSPOSED_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16384, 576, generator=g), torch.randn(2, 576, generator=g)

    def best(f: Callable[[], torch.Tensor]) -> float:
        f()  # warm-up
        return min(timeit.repeat(f, number=1, repeat=5))

    return best(lambda: torch.nn.functional.linear(x, w)) > 1.5 * best(lambda: (w @ x.t()).t().contiguous())


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # q, k and v in one matmul: one weight read and one kernel launch instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if meta.static is not None and fused.rope_fusable(qkv, cfg.head_dim):  # decode / verify on CUDA
            norms = (self.q_norm.weight, self.k_norm.weight, cfg.rms_eps) if cfg.qk_norm else None
            q = fused.rope_write_kv(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, kv_layer, meta.write_slots, norms)
            return linear(meta.static.attend(q, kv_layer).reshape(T, cfg.q_size), self.o_proj.weight)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = qkv[:, :cfg.q_size + cfg.kv_size].split([cfg.q_size, cfg.kv_size], dim=-1)
            q = apply_rope(self.q_norm(q.view(T, cfg.num_heads, cfg.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(k.view(T, cfg.num_kv_heads, cfg.head_dim)), cos, sin)
        else:  # q and k heads side by side in one rotation
            qk = apply_rope(qkv[:, :cfg.q_size + cfg.kv_size].view(T, -1, cfg.head_dim), cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        out = paged_attention(q, k, v, kv_layer, meta)
        return linear(out.reshape(T, cfg.q_size), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.weight
        act = gemv.linear_silu_mul(x, gate_up) if x.is_cuda else fused.silu_mul(linear(x, gate_up))
        return linear(act, self.down_proj.weight)

    @staticmethod
    def hf_weights(tensors: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
        """Parameters (names relative to the module) from Hugging Face tensors under `src`."""
        return {"gate_up_proj.weight": torch.cat([tensors[src + "gate_proj.weight"], tensors[src + "up_proj.weight"]]),
                "down_proj.weight": tensors[src + "down_proj.weight"]}


Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks; other architectures bring their own
    `attention` and `mlp` (MLA, MoE). With tensor parallelism `cfg` holds this rank's share of the heads and MLP width: q/k/v
    and gate/up are column slices, o_proj and down_proj row slices, so each rank's attention
    and MLP outputs are partial sums that `reduce` (an all-reduce) completes."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce, attention: nn.Module | None = None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.reduce = reduce
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg) if mlp is None else mlp

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos, sin, kv_layer, meta
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) -> (h', delta'): the residual stream is h + delta. The feed-forward output
        is returned unadded and the next layer adds it in its input norm's kernel, so that each
        residual add shares a kernel with a norm (one launch less per layer on CUDA; the same
        sums, rounded where the plain path rounds them)."""
        h, x = self.input_layernorm.add_forward(h, delta)
        a = self.reduce(self.self_attn(x, cos, sin, kv_layer, meta))
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h, self.reduce(self.mlp(x))


class Transformer(nn.Module):
    """forward() returns the final-normed hidden states of the rows in `meta.logit_rows` and,
    if asked, the residual stream after each layer in `capture_layers` (all rows).

    A pipeline stage holds `cfg.num_layers` layers starting at global layer `first_layer` and
    runs embed / run_layers / final_norm piece by piece (common.parallel.stage); capture layers are
    global indices either way."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce = no_reduce, first_layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.first_layer = first_layer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, reduce, first_layer + i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Filled by init_rope() once the module sits on its device (it may be built on "meta").
        self.rope_cos = self.rope_sin_signed = torch.empty(0)
        self._rope_cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def make_layer(self, cfg: ModelConfig, reduce: Reduce, layer: int) -> nn.Module:
        """Decoder layer number `layer` of the whole model (architectures differ per layer)."""
        return DecoderLayer(cfg, reduce)

    def init_rope(self, device: torch.device) -> None:
        self.rope_cos, self.rope_sin_signed = rope_cos_sin(self.cfg, device)
        self._rope_cast = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight).float()

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttnMeta,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        h, captured = self.run_layers(self.embed_tokens(input_ids), kv_cache, meta, capture_layers)
        return self.final_norm(h, meta), captured

    def run_layers(self, h: torch.Tensor, kv_cache: torch.Tensor, meta: AttnMeta,
                   capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The residual stream h [T, hidden] through this module's layers (kv_cache holds
        exactly those layers)."""
        cos_table, sin_table = self.rope_tables(h.dtype)
        cos, sin = cos_table[meta.positions], sin_table[meta.positions]
        captured: dict[int, torch.Tensor] = {}
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, kv_cache[i], meta)
            if self.first_layer + i in capture_layers:
                h, delta = h + delta, None
                captured[self.first_layer + i] = h
        return (h if delta is None else h + delta), captured

    def rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables in the model's dtype, cast once (the same values a cast per step
        gives, without its two kernels per step)."""
        if dtype not in self._rope_cast:
            self._rope_cast[dtype] = self.rope_cos.to(dtype), self.rope_sin_signed.to(dtype)
        return self._rope_cast[dtype]

    def final_norm(self, h: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        if meta.logit_rows is not None:
            h = h[meta.logit_rows]
        return self.norm(h)

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors (this module's layers numbered from 0)."""
        own = {}
        for i in range(self.cfg.num_layers):
            own |= {f"layers.{i}.{name}": t for name, t in self.layer_hf_weights(i, tensors).items()}
        own["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        own["norm.weight"] = tensors["model.norm.weight"]
        if self.lm_head is not None:
            own["lm_head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        missing, unexpected = self.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def layer_hf_weights(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer i's parameters (names relative to it), fusing q/k/v and gate/up as it stores them."""
        cfg = self.cfg
        own = {}
        p = f"model.layers.{i}."
        a = p + "self_attn."
        own["self_attn.qkv_proj.weight"] = torch.cat(
            [tensors[a + "q_proj.weight"], tensors[a + "k_proj.weight"], tensors[a + "v_proj.weight"]])
        if cfg.attn_bias:
            own["self_attn.qkv_proj.bias"] = torch.cat(
                [tensors[a + "q_proj.bias"], tensors[a + "k_proj.bias"], tensors[a + "v_proj.bias"]])
        if cfg.qk_norm:
            own["self_attn.q_norm.weight"] = tensors[a + "q_norm.weight"]
            own["self_attn.k_norm.weight"] = tensors[a + "k_norm.weight"]
        own["self_attn.o_proj.weight"] = tensors[a + "o_proj.weight"]
        own |= {f"mlp.{k}": t for k, t in MLP.hf_weights(tensors, p + "mlp.").items()}
        own["input_layernorm.weight"] = tensors[p + "input_layernorm.weight"]
        own["post_attention_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"]
        return own
