"""Architecture description of a decoder-only model: dense (Llama, Qwen2, Qwen3 families),
DeepSeek-V3 style (MLA attention over a latent KV cache, MoE feed-forward; Kimi-K2, Moonlight) or
Kimi-Linear style (KDA linear-attention layers with a recurrent state between MLA layers)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); absent for most models."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency scaling ("rope_type": "yarn") as DeepSeek-V3 configs give it."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # with mscale_all_dim: the cos/sin factor is yarn_mscale(mscale) / yarn_mscale(mscale_all_dim)
    mscale_all_dim: float = 0.0  # nonzero: the softmax scale is multiplied by yarn_mscale(mscale_all_dim) ** 2
    attention_factor: float | None = None  # given explicitly: the cos/sin factor
    truncate: bool = True  # round the correction range to whole dimensions


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention: the cache holds per token the normalised latent (kv_lora_rank)
    and one rotated key shared by all heads (qk_rope_head_dim)."""

    q_lora_rank: int | None  # None: q comes from the hidden state in one projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times the YaRN mscale squared when the config asks
    # False (Kimi-Linear, "NoPE"): the rope slice of q and k exists but is never rotated.
    rope: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek-V3 routed experts: sigmoid scores, top-k chosen on score + correction bias within
    the best `topk_groups` of `num_groups` expert groups, weights from the unbiased scores."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # of each routed expert
    # The shared experts as one MLP, n_shared_experts times as wide as a routed expert (split
    # over TP, while routed experts split over TP / EP: RankLayout.local_config)
    shared_intermediate_size: int
    first_dense_layers: int  # layers [0, first_dense_layers) keep a dense MLP
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # Expert parallelism (common.runner.layout): a rank holds experts [first_expert,
    # first_expert + local_experts) and routes over all of them; None = every expert.
    first_expert: int = 0
    local_experts: int | None = None

    @property
    def held_experts(self) -> range:
        return range(self.first_expert, self.first_expert + (self.local_experts or self.num_experts))


@dataclass(frozen=True)
class KdaConfig:
    """Kimi Delta Attention layers (common.model.kda): `layers` (0-based, of the whole model)
    hold a fixed-size recurrent state per request instead of paged KV; the others are MLA."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int  # key and value width of a head (K = V)
    conv_size: int  # short causal convolution width W on q, k and v

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def recurrent_elems(self) -> int:
        """fp32 elements of one layer's recurrent state [H, K, V] for one request."""
        return self.num_heads * self.head_dim * self.head_dim

    @property
    def conv_elems(self) -> int:
        """Elements of one layer's convolution windows (the last W - 1 inputs of q, k and v)."""
        return 3 * self.proj_size * (self.conv_size - 1)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama", "qwen2", "qwen3", "deepseek_v3", "kimi_linear"
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
    rope_scaling: RopeScaling | YarnScaling | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    name: str = "model"
    # DeepSeek-V3 family. With MLA, num_kv_heads is 1 and head_dim the query/key head width
    # (nope + rope): decode attends like multi-query attention over one latent "head".
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    kda: KdaConfig | None = None  # Kimi-Linear: these layers are KDA, the rest MLA

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers (0-based, of this config's layers) that keep paged KV: all but the KDA ones."""
        kda = set(self.kda.layers) if self.kda is not None else set()
        return tuple(i for i in range(self.num_layers) if i not in kda)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions of a head that RoPE rotates."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def kv_planes(self) -> int:
        """Planes of the KV cache: K and V, or the one latent plane of MLA."""
        return 2 if self.mla is None else 1

    @property
    def cache_head_dim(self) -> int:
        """Elements per cached token and head: head_dim, or latent + rope key for MLA."""
        return self.head_dim if self.mla is None else self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    @property
    def kv_elems_per_token(self) -> int:
        """KV cache elements one token takes over all layers (of the whole model)."""
        return len(self.kv_layers) * self.kv_planes * self.num_kv_heads * self.cache_head_dim

    def state_bytes_per_request(self, dtype_bytes: int) -> int:
        """Bytes of KDA state one request holds over all layers: recurrent fp32, conv windows in
        the model's dtype (`dtype_bytes` per element). 0 without KDA layers."""
        if self.kda is None:
            return 0
        return len(self.kda.layers) * (4 * self.kda.recurrent_elems + dtype_bytes * self.kda.conv_elems)

    @classmethod
    def from_hf(cls, cfg: dict, name: str) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type == "deepseek_v3":
            return _deepseek_v3(cfg, name)
        if model_type == "kimi_linear":
            return _kimi_linear(cfg, name)
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r}: pdflash serves llama, qwen2 and qwen3 "
                             f"dense models, deepseek_v3 (MLA + MoE) and kimi_linear (KDA + MLA + MoE)")
        heads = cfg["num_attention_heads"]
        rs = _rope_params(cfg)
        scaling = None
        if rs.get("rope_type", rs.get("type")) == "llama3":
            scaling = RopeScaling(rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                                  rs["original_max_position_embeddings"])
        theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
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
            eos_token_ids=eos_ids(cfg),
            name=name,
        )


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _rope_params(cfg: dict) -> dict:
    """Older configs say rope_scaling (and rope_theta beside it), newer ones rope_parameters."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _unsupported_moe_fields(cfg: dict) -> list[str]:
    """What the DeepSeek-V3 family's configs (Kimi-Linear's too) may ask that this code does not
    implement: each is refused by name rather than silently ignored."""
    unsupported = []
    if cfg.get("quantization_config"):
        unsupported.append(f"quantization_config ({cfg['quantization_config'].get('quant_method')}): "
                           "give dequantized bf16/fp32 weights")
    if cfg.get("attention_bias"):
        unsupported.append("attention_bias: true")
    if cfg.get("moe_layer_freq", 1) != 1:
        unsupported.append(f"moe_layer_freq {cfg['moe_layer_freq']} (only 1: every layer from first_k_dense_replace on is MoE)")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    return unsupported


def _deepseek_v3(cfg: dict, name: str) -> ModelConfig:
    """DeepSeek-V3 / Kimi-K2 / Moonlight (`DeepseekV3ForCausalLM`). Fields this code does not
    implement are refused by name rather than silently ignored."""
    unsupported = _unsupported_moe_fields(cfg)
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        unsupported.append(f"topk_method {cfg.get('topk_method')!r} / scoring_func {cfg.get('scoring_func')!r} "
                           "(only noaux_tc routing on sigmoid scores)")
    if not cfg.get("rope_interleave", True):
        unsupported.append("rope_interleave: false (the weights are read as DeepSeek lays out its rope dims)")
    rs = _rope_params(cfg)
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        unsupported.append(f"rope type {rope_type!r} (only default and yarn)")
    if unsupported:
        raise ValueError(f"deepseek_v3 config of {name!r} uses what pdflash does not support yet: " + "; ".join(unsupported))

    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rope) ** -0.5
    scaling = None
    if rope_type == "yarn":
        scaling = YarnScaling(factor=float(rs["factor"]), original_max_position=rs["original_max_position_embeddings"],
                              beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                              mscale=float(rs.get("mscale") or 0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0),
                              attention_factor=rs.get("attention_factor"), truncate=rs.get("truncate", True))
        if scaling.mscale_all_dim:  # as DeepSeek's reference code and transformers do
            scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    heads = cfg["num_attention_heads"]
    experts = cfg.get("n_routed_experts") or 0
    moe = None
    if experts:
        moe = MoeConfig(num_experts=experts, experts_per_token=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["moe_intermediate_size"],
                        shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                        first_dense_layers=cfg.get("first_k_dense_replace") or 0,
                        num_groups=cfg.get("n_group") or 1, topk_groups=cfg.get("topk_group") or 1,
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
        if experts % moe.num_groups or moe.topk_groups > moe.num_groups:
            raise ValueError(f"{experts} experts do not form {moe.num_groups} groups of which {moe.topk_groups} are chosen")
    return ModelConfig(
        arch="deepseek_v3",
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=1,
        head_dim=nope + rope,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rope_theta=float(cfg.get("rope_theta", rs.get("rope_theta", 10000.0))),
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        rope_scaling=scaling,
        eos_token_ids=eos_ids(cfg),
        name=name,
        mla=MlaConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=cfg["v_head_dim"], softmax_scale=scale),
        moe=moe,
    )


def _kimi_linear(cfg: dict, name: str) -> ModelConfig:
    """Kimi-Linear (`KimiLinearForCausalLM`): KDA and NoPE MLA layers, MoE from
    first_k_dense_replace on. Read as the model's own repository writes config.json
    (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, `num_experts`, ...) or as
    transformers saves it (`layer_types`, `linear_num_heads`, ...); where both are given they must
    agree. transformers' precedence is kept: `linear_attn_config` sizes over `linear_*` fields,
    `layer_types` over the layer lists. What this code does not implement is refused by name."""
    lin = cfg.get("linear_attn_config") or {}
    n = cfg["num_hidden_layers"]
    unsupported = _unsupported_moe_fields(cfg)
    if cfg.get("mla_use_nope", True) is not True:
        unsupported.append("mla_use_nope: false (Kimi-Linear's MLA is NoPE; rotated MLA is deepseek_v3)")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        unsupported.append(f"moe_router_activation_func {cfg['moe_router_activation_func']!r} (only sigmoid)")
    # Kimi-K3's extras on the same model_type (a lower-bounded gate, a full-rank output gate).
    for key in ("gate_lower_bound", "lower_bound", "safe_gate", "use_full_rank_gate"):
        if lin.get(key):
            unsupported.append(f"linear_attn_config.{key}: {lin[key]!r}")

    from_lists = None
    if "kda_layers" in lin and "full_attn_layers" in lin:
        from_lists = ["?"] * n
        for layer in lin["full_attn_layers"]:
            from_lists[layer - 1] = "full_attention"  # 1-based in the checkpoint's config
        for layer in lin["kda_layers"]:
            from_lists[layer - 1] = "linear_attention"
    types = cfg.get("layer_types") or from_lists
    if types is None:
        unsupported.append("no layer layout: give layer_types or linear_attn_config.kda_layers/full_attn_layers")
    elif len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        unsupported.append(f"layer types {types} (want {n} of linear_attention / full_attention)")
    elif from_lists is not None and list(types) != from_lists:
        unsupported.append(f"layer_types {types} disagree with linear_attn_config's kda_layers / full_attn_layers")
    first_dense = cfg.get("first_k_dense_replace", 1)  # transformers' default
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is not None:
        first_dense = mlp_types.count("dense")
        if list(mlp_types) != ["dense"] * first_dense + ["sparse"] * (n - first_dense):
            unsupported.append(f"mlp_layer_types {mlp_types} (only dense layers first, then MoE)")
    if unsupported:
        raise ValueError(f"kimi_linear config of {name!r} uses what pdflash does not support yet: " + "; ".join(unsupported))

    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    experts = cfg.get("num_experts", cfg.get("n_routed_experts")) or 0
    moe = None
    if experts:
        per_token = cfg.get("num_experts_per_token", cfg.get("num_experts_per_tok"))
        shared = cfg.get("num_shared_experts", cfg.get("n_shared_experts", 1))
        groups = cfg.get("num_expert_group", cfg.get("n_group")) or 1
        moe = MoeConfig(num_experts=experts, experts_per_token=per_token,
                        intermediate_size=cfg["moe_intermediate_size"],
                        shared_intermediate_size=cfg["moe_intermediate_size"] * shared,
                        first_dense_layers=first_dense, num_groups=groups, topk_groups=cfg.get("topk_group") or 1,
                        norm_topk_prob=bool(cfg.get("moe_renormalize", cfg.get("norm_topk_prob", True))),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.446)))
        if experts % moe.num_groups or moe.topk_groups > moe.num_groups:
            raise ValueError(f"{experts} experts do not form {moe.num_groups} groups of which {moe.topk_groups} are chosen")
    kda = KdaConfig(layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                    num_heads=lin.get("num_heads", cfg.get("linear_num_heads", 32)),
                    head_dim=lin.get("head_dim", cfg.get("linear_head_dim", 128)),
                    conv_size=lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
    return ModelConfig(
        arch="kimi_linear",
        num_layers=n,
        hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=1,
        head_dim=nope + rope,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rope_theta=0.0,  # NoPE: nothing is rotated
        rms_eps=cfg.get("rms_norm_eps", 1e-5),
        max_position=cfg.get("model_max_length", cfg.get("max_position_embeddings", 1048576)),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        eos_token_ids=eos_ids(cfg),
        name=name,
        mla=MlaConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=cfg["v_head_dim"], softmax_scale=(nope + rope) ** -0.5,
                      rope=False),
        moe=moe,
        kda=kda,
    )
