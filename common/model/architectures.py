"""Which module computes a config's architecture, and building it without weights."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from common.model.config import ModelConfig
from common.model.deepseek import DeepseekTransformer
from common.model.kimi_linear import KimiLinearTransformer
from common.model.transformer import Reduce, Transformer


def model_class(cfg: ModelConfig) -> type[Transformer]:
    if cfg.kda is not None:
        return KimiLinearTransformer
    return Transformer if cfg.mla is None else DeepseekTransformer


def build_on_meta(cfg: ModelConfig, reduce: Reduce, **kwargs) -> Transformer:
    """The model for `cfg` on the meta device, its parameters not initialised (to_empty and the
    weights, or fill_random_, give them their memory and values)."""
    with torch.device("meta"), _no_random_init():
        return model_class(cfg)(cfg, reduce, **kwargs)


def to_empty(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """nn.Module.to_empty (after .to(dtype) where a dtype is given: floating-point tensors only),
    allocating with torch.empty: to_empty's empty_like of a meta tensor goes through torch's
    reference implementations, which import sympy, a second of CPU per process."""
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share stays shared

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                                      device=device)
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b)
    return model


# nn.Linear, nn.Embedding and the like draw their initial weights in __init__. On the meta device
# that draws nothing, but torch's reference implementations of those ops import torch._dynamo
# (and with it sympy and the inductor): 2-4 s of CPU in every process that builds a model.
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor
