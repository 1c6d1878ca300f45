"""auto's GEMV choices kept between processes (common.model.cache), so that only the first
start on a kind of GPU times the products: each choice times every block shape inside a CUDA
graph, which at start-up takes tens of seconds for a model's shapes.

One JSON file per GPU name, torch and Triton versions and digest of the GEMV code (a change to
the kernel or its candidates starts a new file): {product key: choice}. Processes started
together may each time a product and write it; the file is replaced whole, so a reader sees one
of the versions, and a lost entry is timed again by the next start."""
from __future__ import annotations

import hashlib
import json
import os
import re

from common.model.cache import CACHE_ROOT

FOLDER = os.path.join(CACHE_ROOT, "gemv")


def path_for(device_name: str, versions: str, code: bytes) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{device_name}-{versions}")
    return os.path.join(FOLDER, f"{name}-{hashlib.sha256(code).hexdigest()[:16]}.json")


def load(path: str) -> dict[str, str]:
    """The kept choices, or none where the file is missing or unreadable."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(kept, dict) else {}


def keep(path: str, key: str, choice: str) -> None:
    """Add one choice to the file (nothing happens where the cache cannot be written)."""
    kept = load(path) | {key: choice}
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(kept, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
