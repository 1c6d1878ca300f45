"""CPU products of a few rows through weights that oneDNN packed once.

On a CPU, F.linear of a few rows reorders the weight into its kernel's layout on every call;
a decode or verify step's weights come from memory each time, and the reorder costs about as
much as the product. Packed once, the product reads the packed copy only. On a 2-core Intel
Xeon VM (AMX), 30 weights of each shape in turn, as a step reads them (ms per product):

| product | 1 row | 4 rows | 8 rows | 32 rows |
|---|---|---|---|---|
| gate/up 3072 x 576, F.linear / packed | 0.24 / 0.27 | 0.48 / 0.34 | 0.60 / 0.36 | 0.84 / 0.62 |
| LM head 49152 x 576 (one weight) | 2.24 / 2.31 | 4.59 / 2.85 | 7.48 / 3.34 | 9.45 / 7.05 |

One row stays with F.linear (or linear()'s other one-row paths), where packing gains nothing
and the small products lose; past MAX_ROWS the two are within noise of each other. A step of
the embedded model at one row with a verify block of 4 fell from 1.9 to 1.6 plain steps.

A packed copy is kept per weight while the weight lives, and made again if the weight changes
in place (its version counter; an inference tensor has none, and can change only inside
inference mode, where no caller changes weights). The packed path has no autograd: products
that record gradients take F.linear.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

MIN_ROWS, MAX_ROWS = 2, 64
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _Packed:
    weight: weakref.ref
    version: int | None
    packed: torch.Tensor


_packs: dict[int, _Packed] = {}  # id(weight) -> its packed copy


def available() -> bool:
    """Whether this torch has oneDNN's packed products (x86 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) through the weight's packed copy, for 2-D x of MIN_ROWS to
    MAX_ROWS rows on the CPU in fp32 or bf16; None where this path does not apply."""
    if not (_AVAILABLE and x.device.type == "cpu" and x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and (bias is None or bias.dtype == x.dtype)):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _packed(weight), bias, "none", [], "")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    version = None if weight.is_inference() else weight._version
    entry = _packs.get(key)
    if entry is None or entry.weight() is not weight or entry.version != version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        entry = _packs[key] = _Packed(weakref.ref(weight, _forget(key)), version, packed)
    return entry.packed


def _forget(key: int):
    def drop(ref: weakref.ref) -> None:
        entry = _packs.get(key)
        if entry is not None and entry.weight is ref:  # not a newer weight's, at the same address
            del _packs[key]
    return drop
