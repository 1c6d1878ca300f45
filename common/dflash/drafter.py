"""The DFlash drafter: a few Llama-style layers that denoise a block of MASK tokens into draft
tokens, conditioned on the target's hidden states.

  fused context  = RMSNorm(fc(concat(hidden after each capture layer)))     [tokens, H]
  draft KV       = per draft layer, k/v projections of the fused context   (paged, grows as
                   tokens are committed; this is what P ships to D beside the target KV)
  block          = [last committed token, MASK x (B-1)], embedded with the target's embedding
  each layer     : Q from the block; K/V from context + block; bidirectional inside the block
  draft tokens   = argmax of the target's LM head over the final-normed block positions 1..B-1
  refine passes  = (drafters trained with --refine) the block again, its positions 1..j now the
                   drafts of the last pass, where j is how many leading drafts the drafter is
                   at least refine_threshold sure of; positions past j are drafted again. The
                   drafts are independent guesses in one pass; a refine pass conditions the
                   rest of the block on its confident start.

The drafter owns neither the embedding nor the LM head: both are the target's.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.transformer import MLP, RMSNorm, apply_rope, linear

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafters", "smollm2-135m-instruct-dflash")


def shipped_drafter_path(model: str | None) -> str:
    """The drafter shipped for the embedded default model; other models need --draft-model."""
    if model not in (None, "", "default"):
        raise ValueError("--spec dflash with a model of your own needs --draft-model "
                         "(train one with `pdflash dflash train`)")
    if not os.path.isfile(os.path.join(SHIPPED, "config.json")):
        raise FileNotFoundError(f"the shipped drafter is missing from this installation ({SHIPPED})")
    return SHIPPED


def draft_dtype(choice: str, target: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the drafter runs in (--draft-dtype). Its drafts are only proposals, checked by the
    target, so its precision moves the accept length, never the output. auto: bf16 beside an fp32
    target where bf16 products are native (CUDA; CPUs with AVX512-BF16 or AMX), else the
    target's. The drafters are trained in bf16 and shipped in bf16; in bf16 its products read half
    the bytes (CUDA) or run 1.8-3.6x faster (a 2-core AVX512-BF16 VM, 7 to 120 rows)."""
    named = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if choice != "auto":
        if choice not in named:
            raise ValueError(f"--draft-dtype {choice!r}: expected auto or one of {', '.join(named)}")
        return named[choice]
    device = torch.device(device)
    native = device.type == "cuda" or (device.type == "cpu" and _cpu_has_bf16())
    return torch.bfloat16 if target == torch.float32 and native else target


def _cpu_has_bf16() -> bool:
    cpu = torch.cpu  # the checks are private to torch.cpu; a torch without them: fp32
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def default_capture_layers(target_layers: int, n: int = 5) -> tuple[int, ...]:
    """The DFlash rule: n target layers spread over the depth, round(1 + i*(L-4)/(n-1))."""
    return tuple(round(1 + i * (target_layers - 4) / (n - 1)) for i in range(n))


@dataclass(frozen=True)
class DrafterConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    capture_layers: tuple[int, ...]
    block_size: int = 16
    mask_token_id: int = 0
    sliding_window: int | None = None  # draft context window in tokens (None = all)
    max_position: int = 8192
    target_hidden_size: int = 0  # 0 = hidden_size
    refine_passes: int = 0  # passes after the first (a drafter trained for them: dflash train --refine)
    refine_threshold: float = 0.5  # a draft is kept, and given to the next pass, from this probability

    def __post_init__(self) -> None:
        if self.refine_passes < 0 or not 0.0 < self.refine_threshold < 1.0:
            raise ValueError(f"drafter refine passes {self.refine_passes} (>= 0) and threshold "
                             f"{self.refine_threshold} (between 0 and 1, exclusive)")

    @classmethod
    def for_target(cls, target: ModelConfig, num_layers: int = 2, **overrides) -> "DrafterConfig":
        kv_heads, head_dim = target.num_kv_heads, target.head_dim
        if target.mla is not None:
            # An MLA target's one latent "head" of nope + rope width describes its cache, not an
            # attention shape to copy: the drafter stays a plain GQA model, with v_head_dim-wide
            # heads and a KV head per query head (overridable, like everything here).
            kv_heads, head_dim = target.num_heads, target.mla.v_head_dim
        base = dict(num_layers=num_layers, hidden_size=target.hidden_size, num_heads=target.num_heads,
                    num_kv_heads=kv_heads, head_dim=head_dim,
                    intermediate_size=target.intermediate_size, rope_theta=target.rope_theta,
                    rms_eps=target.rms_eps, capture_layers=default_capture_layers(target.num_layers),
                    max_position=target.max_position, target_hidden_size=target.hidden_size)
        base.update(overrides)
        return cls(**base)

    @property
    def as_model_config(self) -> ModelConfig:
        """The draft layers are Llama layers with q/k norm; this lets them reuse common.model.transformer."""
        return ModelConfig(arch="qwen3", num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, vocab_size=1, rope_theta=self.rope_theta,
                           rms_eps=self.rms_eps, max_position=self.max_position, tie_embeddings=True,
                           qk_norm=True)


class DraftAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, 2 * cfg.kv_size, bias=False)  # shared by context and block
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of tokens x [T, H] at the positions of cos/sin."""
        k, v = linear(x, self.kv_proj.weight).view(x.shape[0], 2, self.cfg.num_kv_heads, self.cfg.head_dim).unbind(1)
        return apply_rope(self.k_norm(k), cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = linear(x, self.q_proj.weight).view(x.shape[0], self.cfg.num_heads, self.cfg.head_dim)
        return apply_rope(self.q_norm(q), cos, sin)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (normed, rotated) and V of block tokens x [T, H]."""
        return self.q(x, cos, sin), *self.kv(x, cos, sin)


class DraftLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        mcfg = cfg.as_model_config
        self.fc = nn.Linear(len(cfg.capture_layers) * (cfg.target_hidden_size or cfg.hidden_size), cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(mcfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---- context ---------------------------------------------------------------------------
    def fuse(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """Captured target hidden states (layer -> [T, H]) -> fused context [T, H]."""
        return self.fuse_features(torch.cat([captured[layer] for layer in self.cfg.capture_layers], dim=-1))

    def fuse_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The capture layers' hidden states side by side [T, layers x H] -> fused context [T, H]."""
        return self.hidden_norm(linear(feats.to(self.fc.weight.dtype), self.fc.weight))

    # Under pipeline parallelism no stage holds every captured layer. fc(concat(h_i)) is the sum
    # over capture layers of h_i times fc's column block i, so each stage adds its layers' blocks
    # to a running sum [T, H] (fp32, rounded once at the end, as one matmul would be) and only
    # that sum travels down the pipeline; the last stage normalises it.
    def fc_part(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """fc over the capture layers present in `captured` only, in fp32."""
        width = self.cfg.target_hidden_size or self.cfg.hidden_size
        w = self.fc.weight
        return sum(F.linear(captured[layer].to(w.dtype), w[:, i * width:(i + 1) * width]).float()
                   for i, layer in enumerate(self.cfg.capture_layers) if layer in captured)

    def fuse_sum(self, fc_sum: torch.Tensor) -> torch.Tensor:
        """The fused context from the summed fc_part of every stage."""
        return self.hidden_norm(fc_sum.to(self.fc.weight.dtype))

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The draft KV of context tokens: (K, V) [T, kv_heads, d] for every draft layer."""
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    # ---- one pass over blocks --------------------------------------------------------------
    def blocks(self, x: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [N, H]: embedded block tokens (all blocks flattened). attend(layer_idx, h) runs that
        layer's attention for the block's normed hidden states h [N, H] over context + block
        (DraftAttention.qkv gives its Q, K and V) and returns [N, Hq, d]. Returns the
        final-normed hidden states [N, H] (logits via the target's LM head)."""
        delta = None  # the feed-forward output, added in the next norm's kernel (as the target does)
        for i, layer in enumerate(self.layers):
            x, h = layer.input_layernorm.add_forward(x, delta)
            out = attend(i, h)
            x, h = layer.post_attention_layernorm.add_forward(x, linear(out.reshape(x.shape[0], -1),
                                                                         layer.self_attn.o_proj.weight))
            delta = layer.mlp(h)
        return self.norm.add_forward(x, delta)[1]

    def set_refine(self, setting: dict) -> None:
        """How this drafter drafts from now on: {refine_passes, refine_threshold} or a part of it
        (common.service.spec_args.refine_setting). The weights stay; proposers built later follow."""
        self.cfg = replace(self.cfg, **setting)

    # ---- files -----------------------------------------------------------------------------
    def save(self, folder: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"architecture": "dflash", **asdict(self.cfg)}, f, indent=2)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(folder, "model.safetensors"))

    @classmethod
    def load(cls, folder: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Drafter":
        from safetensors.torch import load_file

        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no drafter at {folder!r} (config.json missing)")
        with open(path) as f:
            raw = json.load(f)
        raw.pop("architecture", None)
        raw["capture_layers"] = tuple(raw["capture_layers"])
        model = cls(DrafterConfig(**raw))
        model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
        return model.to(device=device, dtype=dtype).eval()
