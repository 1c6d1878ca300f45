"""Architecture description of a dense decoder-only model (Llama, Qwen2, Qwen3 families)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); absent for most models."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama", "qwen2", "qwen3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attn_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, name: str) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r}: pdflash serves llama, qwen2 and qwen3 dense models")
        heads = cfg["num_attention_heads"]
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        scaling = None
        if rs.get("rope_type", rs.get("type")) == "llama3":
            scaling = RopeScaling(rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                                  rs["original_max_position_embeddings"])
        theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rope_theta=float(theta),
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            attn_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            name=name,
        )
