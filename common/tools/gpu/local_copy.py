"""gpu-check part `local-copy`: the local transport's CUDA path alone, without the services or
Mooncake. A second process (D) allocates a shareable buffer on the GPU and sends its region the way
Bootstrap carries it (protobuf); this process (P) opens it by CUDA IPC and copies entries into it,
small ones (gathered) and large ones (sliced); D reads back exactly the bytes expected. Then the
time of a 2K-token room's copy as pd makes it on one GPU: 94 MB in 60 merged entries, and 122,880
entries of one head's token row (fp32, head dim 64) (a TP split that differs between P and D)."""
from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp

from common.kv.shared import BufferMemory
from common.transfer.local import LocalWriter, Spans, copy_entries
from common.transfer.plan import TransferEntry
from common.transfer.wire import region_from_proto, region_to_proto
from protos import pdflash_pb2 as pb

SIZE = 1 << 22
TIMEOUT_S = 120


def _decode_side(to_p, from_p) -> None:
    memory = BufferMemory(shareable=True)
    torch.ones(1000, device="cuda")  # the buffer need not start its allocation
    buf = memory.zeros((SIZE,), torch.uint8, torch.device("cuda"))
    to_p.put([region_to_proto(r).SerializeToString() for r in memory.regions])
    expected = from_p.get()
    torch.cuda.synchronize()
    to_p.put(bool(torch.equal(buf.cpu(), expected)))


def local_copy() -> dict:
    ctx = mp.get_context("spawn")
    to_p, from_p = ctx.Queue(), ctx.Queue()
    d = ctx.Process(target=_decode_side, args=(to_p, from_p), daemon=True)
    d.start()
    try:
        (region,) = [region_from_proto(pb.SharedRegion.FromString(b)) for b in to_p.get(timeout=TIMEOUT_S)]
        memory = BufferMemory()
        src = memory.zeros((SIZE,), torch.uint8, torch.device("cuda"))
        src.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda"))
        writer = LocalWriter(memory, torch.device("cuda", torch.cuda.current_device()))
        if not writer.open("d", [region]):
            raise RuntimeError("the decode process's CUDA buffer did not open here (see the log)")
        small = [TransferEntry(src.data_ptr() + i * 512, region.base_addr + i * 1024 + 256, 256) for i in range(200)]
        large = [TransferEntry(src.data_ptr() + SIZE // 2 + k * (1 << 18), region.base_addr + SIZE // 2 + k * (1 << 18),
                               1 << 18) for k in range(4)]
        expected = torch.zeros(SIZE, dtype=torch.uint8)
        host = src.cpu()
        for e in small + large:
            s, t = e.src_addr - src.data_ptr(), e.dst_addr - region.base_addr
            expected[t:t + e.length] = host[s:s + e.length]
        moved = writer.write("d", small) + writer.write("d", large)
        from_p.put(expected)
        same = to_p.get(timeout=TIMEOUT_S)
    finally:
        d.join(TIMEOUT_S)
    return {"bytes": moved, "decode_sees_them": same, "timings_ms": _timings()}


def _timings() -> dict:
    """Milliseconds per copy within one process (the same kernels as between two)."""
    n = 100 << 20
    a, b = torch.zeros(n, dtype=torch.uint8, device="cuda"), torch.zeros(n, dtype=torch.uint8, device="cuda")
    src, dst = Spans.of([(a.data_ptr(), n, a)]), Spans.of([(b.data_ptr(), n, b)])
    part = (94 << 20) // 60
    cases = {"94MB_in_60_entries": [TransferEntry(a.data_ptr() + i * part, b.data_ptr() + i * part, part)
                                    for i in range(60)],
             "122880_entries_of_256B": [TransferEntry(a.data_ptr() + i * 256, b.data_ptr() + i * 768, 256)
                                        for i in range(2048 * 60)]}
    out = {}
    for name, entries in cases.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            copy_entries(entries, src, dst)  # synchronizes
            times.append(1e3 * (time.perf_counter() - start))
        out[name] = min(times[1:])
    return out
