"""The memory a process's transfer buffers (KV, draft KV, state) are allocated from, so that a
process on the same host can open them and copy a room's bytes straight in
(common/transfer/local.py) instead of going through Mooncake's TCP.

`BufferMemory(shareable=True)` (a decode instance that offers local transfer) allocates:
- on the CPU, each tensor in an anonymous memory file (memfd) mapped here; the other process maps
  the same file through /proc/<pid>/fd/<fd>. Nothing is left behind when the process dies,
  however it dies: the file goes with its last mapping;
- on CUDA, an ordinary allocation, whose CUDA IPC handle (torch's, as torch.multiprocessing
  shares a CUDA tensor) the other process opens.
A `SharedRegion` says how to open one tensor, and on which host (`host_id`): D sends them in
Bootstrap, each rank its own (the ranks of an instance may be spread over hosts). Without `shareable`
the tensors are plain ones, still listed (`tensors`): a sender copies out of them by address.
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
from dataclasses import dataclass
from functools import cache

import torch

MEMFD_PREFIX = "pdflash-"


@cache
def host_id() -> str:
    """This host as both sides see it: the kernel's boot id (one per running kernel, so not
    shared by two machines) and the host name (a container's own unless it shares the host's)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: never local
        return ""
    return f"{boot}/{socket.gethostname()}"


@dataclass(frozen=True)
class CudaIpcHandle:
    """What `torch.UntypedStorage._new_shared_cuda` takes (after the device), as
    `storage._share_cuda_()` gave it."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class SharedRegion:
    """One tensor of a process, for another process on the same host: `base_addr` and `length`
    as the owner's buffer descriptions name it (the plan's dst addresses fall inside), and where
    its memory is: a memfd (`fd`, `name`) or a CUDA IPC handle (`cuda`), of process `pid` on host
    `host` (host_id(): a process elsewhere never tries to open it)."""

    base_addr: int
    length: int
    pid: int = 0
    fd: int = 0
    name: str = ""  # the memfd's name: the opener checks /proc/<pid>/fd/<fd> is that file
    cuda: CudaIpcHandle | None = None
    host: str = ""


class BufferMemory:
    def __init__(self, shareable: bool = False):
        self.shareable = shareable
        self.tensors: list[torch.Tensor] = []  # every tensor allocated here, in order
        self.regions: list[SharedRegion] = []  # shareable: how another process opens each
        self._maps: list[mmap.mmap] = []  # keep the CPU mappings (and their files) alive

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not self.shareable or nbytes == 0:
            t = torch.zeros(shape, dtype=dtype, device=device)
        elif device.type == "cuda":
            t = torch.zeros(shape, dtype=dtype, device=device)
            self.regions.append(_cuda_region(t))
        else:
            t, region = self._memfd_zeros(shape, dtype, nbytes)
            self.regions.append(region)
        self.tensors.append(t)
        return t

    def _memfd_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> tuple[torch.Tensor, SharedRegion]:
        # The random name lets the opener tell this file from whatever else /proc/<pid>/fd/<fd>
        # may be by then (another process with our pid, a reused descriptor).
        name = MEMFD_PREFIX + secrets.token_hex(8)
        fd = os.memfd_create(name)  # kept open for our lifetime: /proc/<pid>/fd/<fd> names it
        os.ftruncate(fd, nbytes)  # zero pages, taken as they are first written
        mapped = mmap.mmap(fd, nbytes)
        self._maps.append(mapped)
        t = torch.frombuffer(mapped, dtype=torch.uint8).view(dtype).view(shape)
        return t, SharedRegion(t.data_ptr(), nbytes, pid=os.getpid(), fd=fd, name=name, host=host_id())


def _cuda_region(t: torch.Tensor) -> SharedRegion:
    (_device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = t.untyped_storage()._share_cuda_()
    ipc = CudaIpcHandle(bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset), bytes(event),
                        bool(event_sync))
    return SharedRegion(t.data_ptr(), t.numel() * t.element_size(), pid=os.getpid(), cuda=ipc, host=host_id())
