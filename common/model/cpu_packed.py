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
inference mode, where no caller changes weights). The copies are a second copy of the weights a
process multiplies with (the embedded model and its drafter: about 0.6 GB), so a process keeps
at most PDFLASH_CPU_PACKED_MB of them (default 4096; 0: none), packing weights in the order they
are first used; a weight past the budget keeps F.linear. Its products then round differently
from a process that packed it (within fp32 rounding; a pipeline test of the embedded model, whose
stages compare at 1e-5, saw 1.2e-5 when one side was past a 1 GB cap). The packed path has no
autograd: products that record gradients take F.linear.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 2, 64
BUDGET_ENV, DEFAULT_BUDGET_MB = "PDFLASH_CPU_PACKED_MB", 4096


@dataclass
class _Packed:
    weight: weakref.ref
    state: tuple  # what the copy was packed from: _state(weight) then
    packed: torch.Tensor | None  # None: past the budget
    nbytes: int  # the weight's bytes, as the packed copy's estimate (0 when not packed)


_packs: dict[int, _Packed] = {}  # id(weight) -> its packed copy
_held = 0  # bytes of the packed copies in _packs
_told = False  # that the budget was reached
# A weight's last reference, and so its entry's removal, may go on another thread (the engine
# runs on its own).
_lock = threading.RLock()  # reentrant: a collection inside _packed may drop a weight on this thread


@functools.cache
def budget() -> int:
    """Bytes of packed copies a process may keep (PDFLASH_CPU_PACKED_MB)."""
    text = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET_MB))
    try:
        mb = int(text)
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"{BUDGET_ENV}={text!r}: expected a whole number of MB, 0 or more")
    return mb << 20


def available() -> bool:
    """Whether this torch has oneDNN's packed products (x86 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _dtypes() -> tuple[torch.dtype, ...]:
    """fp32, and bf16 where oneDNN computes it on this CPU (torch's own compiler asks the same)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


_AVAILABLE = available()
DTYPES = _dtypes() if _AVAILABLE else ()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) through the weight's packed copy, for 2-D x of MIN_ROWS to
    MAX_ROWS rows on the CPU in DTYPES; None where this path does not apply."""
    if not (_AVAILABLE and x.device.type == "cpu" and x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 2 and weight.numel() > 0
            and (bias is None or bias.dtype == x.dtype)):
        return None
    tracked = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
        return None  # the packed product has no autograd
    packed = _packed(weight)
    if packed is None:
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None if bias is None else bias.contiguous(),
                                              "none", [], "")


def _state(weight: torch.Tensor) -> tuple:
    """What a packed copy stays valid for: the weight's storage, shape and dtype (`.data =` and
    Module.to() swap them in place) and its version counter (in-place ops; an inference tensor
    has none). Writes through `.data` (another version counter) are not seen."""
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), weight.shape, weight.dtype, version


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    global _held, _told
    key, state = id(weight), _state(weight)
    with _lock:
        entry = _packs.get(key)
        if entry is not None and entry.weight() is weight and entry.state == state:
            return entry.packed
        if entry is not None:  # a dead weight's, or this one's before it changed: dropped before packing again
            _held -= entry.nbytes
            del _packs[key]
        nbytes = weight.numel() * weight.element_size()
        packed = None
        if _held + nbytes <= budget():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
            _held += nbytes
        elif budget() and not _told:
            logger.info("%s reached (%d MB of packed weights): the weights not packed yet keep F.linear",
                        BUDGET_ENV, _held >> 20)
            _told = True
        _packs[key] = _Packed(weakref.ref(weight, _forget(key)), state, packed, nbytes if packed is not None else 0)
        return packed


def _forget(key: int) -> Callable[[weakref.ref], None]:
    def drop(ref: weakref.ref) -> None:
        global _held
        with _lock:
            entry = _packs.get(key)
            if entry is not None and entry.weight is ref:  # not a newer weight's, at the same address
                _held -= entry.nbytes
                del _packs[key]
    return drop
