"""End-to-end integrity of a KV handoff: CRC32 per (buffer, layer, k/v, page) over the tokens a
room actually holds. P computes it over what it sent, D over what it received; both walk the
room's pages in token order, so the lists must be equal whatever the two sides' page numbers."""
from __future__ import annotations

import zlib

import torch


def page_checksums(kv: torch.Tensor, pages: list[int], num_tokens: int) -> list[int]:
    """kv [layer, k/v, page, token, head, dim]; pages in token order."""
    page_size = kv.shape[3]
    sums = []
    cpu = kv if kv.device.type == "cpu" else None
    for i, page in enumerate(pages[: -(-num_tokens // page_size)]):
        used = min(page_size, num_tokens - i * page_size)
        block = (cpu if cpu is not None else kv)[:, :, page, :used]
        data = block.contiguous().cpu().view(torch.uint8).numpy()
        for layer in range(kv.shape[0]):
            for plane in range(kv.shape[1]):
                sums.append(zlib.crc32(data[layer, plane].tobytes()))
    return sums


def room_checksums(tensors: dict[str, torch.Tensor], pages: dict[str, list[int]], num_tokens: int) -> list[int]:
    """Checksums of every paged buffer of a room, buffers in name order."""
    return [c for name in sorted(pages) for c in page_checksums(tensors[name], pages[name], num_tokens)]
