"""Which module computes a config's architecture."""
from __future__ import annotations

from common.model.config import ModelConfig
from common.model.deepseek import DeepseekTransformer
from common.model.kimi_linear import KimiLinearTransformer
from common.model.transformer import Transformer


def model_class(cfg: ModelConfig) -> type[Transformer]:
    if cfg.kda is not None:
        return KimiLinearTransformer
    return Transformer if cfg.mla is None else DeepseekTransformer
