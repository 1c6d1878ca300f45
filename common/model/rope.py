"""YaRN rotary frequencies (DeepSeek-V3 and its long-context descendants).

YaRN keeps the fast-rotating dimensions as trained (extrapolation), divides the slow ones by
`factor` (interpolation) and ramps linearly between the two over the dimensions whose
wavelength falls between beta_fast and beta_slow rotations of the original context. cos/sin are
then multiplied by an attention factor; the softmax scale has its own mscale (common.model.config).
"""
from __future__ import annotations

import math

import torch

from common.model.config import YarnScaling, yarn_mscale


def yarn_inv_freq(dim: int, theta: float, ys: YarnScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] for rotate-half RoPE over `dim` dimensions, and the factor
    for cos/sin."""
    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(ys.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(ys.beta_fast), correction_dim(ys.beta_slow)
    if ys.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated = extrapolated / ys.factor
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)
    if ys.attention_factor is not None:
        factor = float(ys.attention_factor)
    elif ys.mscale and ys.mscale_all_dim:
        factor = yarn_mscale(ys.factor, ys.mscale) / yarn_mscale(ys.factor, ys.mscale_all_dim)
    else:
        factor = yarn_mscale(ys.factor)
    return inv_freq, factor
