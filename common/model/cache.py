"""Where pdflash keeps what it can rebuild, so that it is built once per machine: models
converted from GGUF (weights as safetensors, the tokenizer as Hugging Face files), the step
costs measured for the speculation policy and the GEMV kernels' choices.
`$XDG_CACHE_HOME/pdflash`, else `~/.cache/pdflash`; deleting it costs only the time to rebuild."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

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


@contextlib.contextmanager
def building(final: str) -> Iterator[None]:
    """Hold the lock of the folder `final` is built in: processes started together (a stack's
    services, test workers) wait for the first one's build and read it, instead of each spending
    the same seconds of CPU on it. One lock per folder, not per build: builds are rare, and
    nothing is left behind per build. Not reentrant: never nest two for one folder. Where the
    cache cannot be written, no lock is held."""
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        lock = open(os.path.join(os.path.dirname(final), ".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_json(path: str, obj: object) -> bool:
    """Replace the file at `path` with `obj` in one rename, so that a reader sees the old or the
    new version whole. Returns False, leaving nothing behind, if the cache cannot be written."""
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
        return True
    except (OSError, TypeError, ValueError):
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False
