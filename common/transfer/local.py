"""Local transfer: a plan's entries copied straight from this process's buffers into the buffers of
a D rank on the same host, opened here (CPU: its memory file; CUDA: its IPC handle, device to
device), instead of through Mooncake's TCP. The plan (common/transfer/plan.py) is the same and was
bounds-checked against both sides' buffers; here every entry is also checked against the memory
actually opened before any byte moves.

Copies are coalesced: entries of a plan come in runs per buffer; a run of large entries (whole
pages, merged) is one slice copy each, a run of small ones (a head range token by token) one
batched gather from the source and scatter into the destination, in rows of the largest size
that divides every offset and length.

Each P rank decides for each D rank: it opens D's regions only when they are on its own host
(`host_id`, sent with every region: the ranks of P and of D may be spread over hosts), and falls
back to Mooncake when a region does not open (another container, no peer access, a D that
restarted).
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.kv.shared import MEMFD_PREFIX, BufferMemory, SharedRegion, host_id
from common.transfer.mooncake import TransferError
from common.transfer.plan import TransferEntry

logger = logging.getLogger(__name__)

SLICE_MIN_BYTES = 64 << 10  # a run of entries this large on average is copied entry by entry
GATHER_BYTES = 64 << 20  # at most this much is gathered at a time (the scratch it needs)
_MEMFD_NAME = re.compile(re.escape(MEMFD_PREFIX) + r"[0-9a-f]{16}")
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class Spans:
    """Flat byte views of some buffers, by the address their owner knows them at."""

    bases: np.ndarray  # sorted, int64 (addresses fit: user space is below 2**63)
    lengths: np.ndarray
    views: list[torch.Tensor]  # uint8, one per base

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int, torch.Tensor]]) -> "Spans":
        pairs = sorted(pairs, key=lambda p: p[0])
        return cls(np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64),
                   [p[2] for p in pairs])

    def locate(self, side: str, addrs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which view, offset in it) of each entry; TransferError if one is not wholly inside one."""
        which = np.searchsorted(self.bases, addrs, side="right") - 1
        inside = which >= 0
        offsets = addrs - self.bases[np.maximum(which, 0)]
        inside &= offsets + lengths <= self.lengths[np.maximum(which, 0)]
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise TransferError(f"local copy: {side} entry at {int(addrs[i]):#x} + {int(lengths[i])} bytes is not "
                                "inside any buffer open here")
        return which, offsets


class LocalWriter:
    """One process's local writes: out of the tensors of `memory` (this rank's buffers) into the
    buffers of D ranks opened on `device`, each D rank known by its Mooncake session."""

    def __init__(self, memory: BufferMemory, device: torch.device):
        self.memory = memory
        self.device = device
        self._open: dict[str, tuple[tuple[SharedRegion, ...], Spans]] = {}  # session -> its regions, opened
        self._refused: dict[str, tuple[SharedRegion, ...]] = {}  # session -> regions that did not open
        self._lock = threading.Lock()  # rooms write from threads of their own: open each D once

    def open(self, session: str, regions: Sequence[SharedRegion]) -> bool:
        """Whether D rank `session`'s `regions` are open here, opening them the first time (a D
        that restarted sends new ones: they replace the old). False, logged once, if they do not
        open (or are on another host): the caller writes over Mooncake instead."""
        with self._lock:
            return self._open_locked(session, tuple(regions))

    def _open_locked(self, session: str, key: tuple[SharedRegion, ...]) -> bool:
        if session in self._open and self._open[session][0] == key:
            return True
        if any(r.host != host_id() for r in key):  # not a failure: that D rank is elsewhere
            return False
        if self._refused.get(session) == key:
            return False
        # A D that died (and restarted under another session) keeps its memory alive while it is
        # mapped here: let it go.
        for gone in [s for s, (regions, _) in self._open.items() if not all(_alive(r.pid) for r in regions)]:
            del self._open[gone]
        try:
            spans = Spans.of([(r.base_addr, r.length, open_region(r, self.device)) for r in key])
        except Exception as e:  # whatever the reason, Mooncake still reaches that D
            logger.warning("decode %s: its buffers do not open here (%s); writing to it over Mooncake", session, e)
            self._refused[session] = key
            self._open.pop(session, None)
            return False
        self._open[session] = (key, spans)
        self._refused.pop(session, None)
        logger.info("decode %s: %d buffers open here; writing to it by local copy", session, len(key))
        return True

    def write(self, session: str, entries: Sequence[TransferEntry]) -> int:
        """Copy every entry from our buffers into `session`'s (opened first); returns the bytes
        copied, or raises TransferError, before any byte moves if an entry falls outside."""
        if session not in self._open:
            raise TransferError(f"local copy to {session}: its buffers are not open here")
        src = Spans.of([(t.data_ptr(), t.numel() * t.element_size(), _flat(t)) for t in self.memory.tensors])
        try:
            return copy_entries(entries, src, self._open[session][1])
        except TransferError:
            raise
        except Exception as e:  # a failed copy fails the room like a failed Mooncake write
            raise TransferError(f"local copy of {len(entries)} entries to {session} failed: {e}") from e


def copy_entries(entries: Sequence[TransferEntry], src: Spans, dst: Spans) -> int:
    """Copy (src_addr, dst_addr, length) entries between the two sides' views; returns the bytes.
    Every entry is located first: one outside the views fails the whole write before any copy."""
    if not entries:
        return 0
    s_addr = np.fromiter((e.src_addr for e in entries), np.int64, len(entries))
    d_addr = np.fromiter((e.dst_addr for e in entries), np.int64, len(entries))
    length = np.fromiter((e.length for e in entries), np.int64, len(entries))
    s_which, s_off = src.locate("source", s_addr, length)
    d_which, d_off = dst.locate("destination", d_addr, length)
    pair = s_which * len(dst.views) + d_which
    devices = set()
    for run in np.split(np.arange(len(entries)), np.flatnonzero(np.diff(pair)) + 1):
        s_view, d_view = src.views[s_which[run[0]]], dst.views[d_which[run[0]]]
        _copy_run(s_view, d_view, s_off[run], d_off[run], length[run])
        devices |= {v.device for v in (s_view, d_view) if v.is_cuda}
    for device in devices:  # the bytes are in D's memory before P tells D they are
        torch.cuda.synchronize(device)
    return int(length.sum())


def _copy_run(src: torch.Tensor, dst: torch.Tensor, s_off: np.ndarray, d_off: np.ndarray, length: np.ndarray) -> None:
    if length.mean() >= SLICE_MIN_BYTES:
        for a, b, n in zip(s_off.tolist(), d_off.tolist(), length.tolist()):
            dst[b:b + n].copy_(src[a:a + n])
        return
    # Rows of `unit` bytes: every entry is a whole number of rows on both sides.
    unit = int(np.gcd.reduce(np.concatenate([s_off, d_off, length])))
    word = next(w for w in _WORDS if unit % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
    src_rows, dst_rows = _rows(src, unit, word), _rows(dst, unit, word)
    counts = length // unit
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    s_idx = np.repeat(s_off // unit, counts) + within
    d_idx = np.repeat(d_off // unit, counts) + within
    step = max(1, GATHER_BYTES // unit)
    for i in range(0, len(s_idx), step):
        rows = src_rows.index_select(0, torch.from_numpy(s_idx[i:i + step]).to(src.device))
        dst_rows.index_copy_(0, torch.from_numpy(d_idx[i:i + step]).to(dst.device), rows.to(dst.device))


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _rows(flat: torch.Tensor, unit: int, word: int) -> torch.Tensor:
    return flat[: flat.numel() // unit * unit].view(_WORDS[word]).view(-1, unit // word)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def open_region(region: SharedRegion, device: torch.device) -> torch.Tensor:
    """A flat uint8 view of another process's tensor: its memory file mapped here, or its CUDA
    allocation opened on our `device` (copies then run there, reading or writing peer memory)."""
    if region.cuda is not None:
        if device.type != "cuda":
            raise TransferError("a CUDA buffer cannot be opened by a process without CUDA")
        return _open_cuda(region, device)
    return _open_memfd(region)


def _open_memfd(region: SharedRegion) -> torch.Tensor:
    if not _MEMFD_NAME.fullmatch(region.name):
        raise TransferError(f"not a buffer file of ours: {region.name!r}")
    path = f"/proc/{region.pid}/fd/{region.fd}"
    # The name is random and checked on the descriptor we map: whatever else the path may name
    # (another process, a reused descriptor) is never written.
    fd = os.open(path, os.O_RDWR)
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{region.name} (deleted)":
            raise TransferError(f"{path} is not the buffer file {region.name}")
        if os.fstat(fd).st_size < region.length:
            raise TransferError(f"{path} holds {os.fstat(fd).st_size} bytes, fewer than {region.length}")
        mapped = mmap.mmap(fd, region.length)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _open_cuda(region: SharedRegion, device: torch.device) -> torch.Tensor:
    h = region.cuda
    torch.cuda._lazy_init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(index, h.handle, h.storage_size, h.storage_offset,
                                                    h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
                                                    h.event_sync_required)
    if storage.nbytes() < region.length:
        raise TransferError(f"CUDA buffer holds {storage.nbytes()} bytes, fewer than {region.length}")
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[: region.length]
