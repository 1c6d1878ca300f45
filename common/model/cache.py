"""Where pdflash keeps what it can rebuild, so that it is built once per machine: models
converted from GGUF (weights as safetensors, the tokenizer as Hugging Face files) and the step
costs measured for the speculation policy. `$XDG_CACHE_HOME/pdflash`, else `~/.cache/pdflash`;
deleting it costs only the time to rebuild."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

CACHE_ROOT = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdflash")


def source_key(path: str) -> str:
    """A name for what was built from this file: its path, size and modification time."""
    st = os.stat(path)
    digest = hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{os.path.splitext(os.path.basename(path))[0]}-{digest}"


def publish(build, final: str) -> bool:
    """Build a folder with build(tmp) and move it to `final` in one rename, so that a reader
    never sees half of it (processes started together may race: the first rename wins).
    Returns False, leaving nothing behind, if the cache cannot be written."""
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
    except OSError:
        return False
    try:
        build(tmp)
        os.rename(tmp, final)
        return True
    except OSError:
        return os.path.isdir(final)  # another process published it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
