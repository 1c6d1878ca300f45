"""auto's GEMV choices kept between processes (common.model.cache), so that only the first
start on a kind of GPU times the products: each choice times every contender inside a CUDA
graph, which at start-up takes about a minute for a model's shapes.

One JSON file per GPU name, torch and Triton versions and digest of the code that computes and
times the products (a change there starts a new file): {product: choice}. Processes add their
choices one at a time (the cache's lock), so none is lost."""
from __future__ import annotations

import hashlib
import json
import os
import re

import torch

from common.model.cache import CACHE_ROOT, building, write_json

FOLDER = os.path.join(CACHE_ROOT, "gemv")


def path_for(device_name: str, versions: str, code: bytes) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{device_name}-{versions}")
    return os.path.join(FOLDER, f"{name}-{hashlib.sha256(code).hexdigest()[:16]}.json")


def key_name(silu_mul: bool, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> str:
    """How a product is named in the file, e.g. 'silu_mul rows=4 n=3072 k=576 float32'."""
    return f"{'silu_mul' if silu_mul else 'linear'} rows={rows} n={n} k={k} {str(dtype).removeprefix('torch.')}" \
           f"{' bias' if bias else ''}"


def load(path: str) -> dict[str, str]:
    """The kept choices, or none where the file is missing or unreadable."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict):
        return {}
    return {k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, str)}


def keep(path: str, key: str, choice: str) -> None:
    """Add one choice to the file (nothing happens where the cache cannot be written)."""
    with building(path):
        write_json(path, load(path) | {key: choice})
