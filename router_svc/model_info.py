"""What the router must know about the model, read from its config without loading weights:
the router validates requests (context length, token id range) but never runs the model."""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from common.model.config import ModelConfig
from common.model.source import ModelSource


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    vocab_size: int
    kv_values_per_token: int  # KV cache values one token takes over all layers (x dtype bytes)
    # Fixed-size state one request holds whatever its length (KDA layers: fp32 recurrent state,
    # convolution windows in the backend's dtype), by that dtype; 0 without such layers.
    state_bytes_per_request: dict[str, int] = field(default_factory=lambda: {"bfloat16": 0, "float32": 0})


def read_model_info(src: ModelSource) -> ModelInfo:
    if src.kind == "hf":
        with open(os.path.join(src.folder, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f), name=os.path.basename(src.folder.rstrip("/")))
        return ModelInfo(cfg.name, cfg.max_position, cfg.vocab_size, cfg.kv_elems_per_token,
                         {"bfloat16": cfg.state_bytes_per_request(2), "float32": cfg.state_bytes_per_request(4)})
    meta = read_gguf_metadata(src.path)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    heads_kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    return ModelInfo(
        name=os.path.splitext(src.gguf_file or "model")[0],  # as common.model.weights names it
        max_context=meta.get(f"{arch}.context_length", 4096),  # common.model.weights' default too
        vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
        # K and V per layer and KV head, as common.model.weights reads the same keys
        kv_values_per_token=meta[f"{arch}.block_count"] * 2 * heads_kv
        * meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads),
    )


# GGUF value types (gguf.GGUFValueType): scalar struct formats; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value header of a GGUF file, with each array given as its length only.

    Not gguf.GGUFReader: it builds numpy views of every array element and every tensor, about
    3 s for the embedded model's 49K-token vocabulary; skipping the arrays here takes ~50 ms.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF v2+ file")
        pos = 24

        def read(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def read_string() -> str:
            nonlocal pos
            n = read("<Q")
            pos += n
            return buf[pos - n:pos].decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype == _STRING:
                n = read("<Q")  # read first: `pos += read(...)` would add to the stale pos
                pos += n
            elif vtype == _ARRAY:
                item, count = read("<I"), read("<Q")
                if item in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[item])
                else:
                    for _ in range(count):
                        skip(item)
            else:
                pos += struct.calcsize(_SCALARS[vtype])

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, vtype = read_string(), read("<I")
            if vtype == _STRING:
                meta[key] = read_string()
            elif vtype == _ARRAY:
                start = pos
                read("<I")
                meta[key] = read("<Q")
                pos = start
                skip(vtype)
            else:
                meta[key] = read(_SCALARS[vtype])
        return meta
