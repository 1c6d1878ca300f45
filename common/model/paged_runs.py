"""CPU attention over a paged KV cache that reads each row's keys where they lie.

The plain torch path of `static_attention` gathers every row's pages into one padded tensor per
layer and step. At long contexts on a CPU that copy costs more than the attention itself: at
8 rows x 8K keys (embedded model, fp32) one layer took 44 ms gathered and 16 ms read in place.

A row's pages are runs of consecutive pages: its prompt's pages come from the pool together, and
the pages decoding adds between other requests' are runs of one. Each run is a slice of the
cache, so the flash kernel attends over it without a copy and returns its log-sum-exp; the runs'
outputs are then merged by those weights. The runs, and the causal masks of those that hold a
block's own tokens, depend only on the step's page table and lengths, so one `RunPlan` serves
every layer of a step.

Reading in place costs one kernel call per run and row, and a merge per row with several runs,
where gathering makes one batched call. `plan()` reads in place where that measured faster: one
row; rows of `LONG_ROW` keys or more; a gather of `GATHER_BYTES` or more. Elsewhere it returns None
and the caller gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Per layer on a 2-core Xeon, fp32, embedded model, gathered -> in place, T = 1 / 16 (a decode step /
# a verify block): 8 rows of 2K keys 3.4 -> 2.9 / 5.9 -> 6.5 ms, of 4K 8.1 -> 6.4 / 14.9 -> 13.5 ms;
# 16 rows of 1K 3.0 -> 3.7 / 6.2 -> 8.7 ms. One row: 1K keys 0.49 -> 0.11 / 0.51 -> 0.32 ms.
LONG_ROW = 2048  # keys a row's table spans
# Larger allocations are mapped afresh each time (glibc's largest mmap threshold is 32 MiB), and
# every page of a gather that size faults: 32 rows of 2K keys (57 MB) 46.5 -> 15.5 / 59.6 -> 32.1 ms.
GATHER_BYTES = 32 << 20

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class Run:
    slot: int  # the run's first cache slot (page * page_size + offset)
    keys: int  # how many consecutive slots it holds
    mask: torch.Tensor | None  # [1, 1, T, keys] additive causal mask; None: every query sees every key
    blind: torch.Tensor | None  # [T] bool: queries that see none of its keys (their log-sum-exp is set to -inf)


@dataclass
class RunPlan:
    rows: list[list[Run]]  # each row's runs, in key order
    T: int

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q [rows * T, Hq, d] -> [rows * T, Hq, d]; kv_layer [2, pages, page_size, Hkv, d]."""
        heads, d = kv_layer.shape[-2:]
        k_slots = kv_layer[0].view(-1, heads, d)
        v_slots = kv_layer[1].view(-1, heads, d)
        qv = q.view(len(self.rows), self.T, q.shape[1], d).transpose(1, 2)  # [rows, Hq, T, d]
        out = torch.empty(len(self.rows), self.T, q.shape[1], d, dtype=q.dtype, device=q.device)
        for b, runs in enumerate(self.rows):
            parts, lses = [], []
            for run in runs:
                k = k_slots[run.slot:run.slot + run.keys].view(1, run.keys, heads, d).transpose(1, 2)
                v = v_slots[run.slot:run.slot + run.keys].view(1, run.keys, heads, d).transpose(1, 2)
                o, lse = _FLASH(qv[b:b + 1], k, v, attn_mask=run.mask, scale=scale)
                if run.blind is not None:
                    lse = lse.masked_fill(run.blind, float("-inf"))  # the kernel leaves 0 there
                parts.append(o)
                lses.append(lse)
            out[b] = parts[0][0].transpose(0, 1) if len(parts) == 1 else _merge(parts, lses)
        return out.view(-1, q.shape[1], d)


def _merge(parts: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Runs' outputs [1, Hq, T, d] and log-sum-exps [1, Hq, T] -> the row's output [T, Hq, d]."""
    w = torch.softmax(torch.stack(lses)[:, 0], 0)  # [R, Hq, T], fp32
    o = (torch.stack(parts)[:, 0].float() * w[..., None]).sum(0)
    return o.transpose(0, 1).to(parts[0].dtype)


def plan(page_table: torch.Tensor, kv_len: torch.Tensor, kv_start: torch.Tensor | None, T: int,
         causal: bool, kv_layer: torch.Tensor) -> RunPlan | None:
    """The runs of a static step on the CPU, or None where gathering is the better way (or the
    only one: on a GPU, where reading the table would also break a CUDA graph's capture)."""
    if page_table.device.type != "cpu" or _FLASH is None:
        return None
    rows, width = page_table.shape
    page_size, key_bytes = kv_layer.shape[2], kv_layer[0, 0, 0].numel() * kv_layer.element_size()
    row_keys = width * page_size
    if rows > 1 and row_keys < LONG_ROW and rows * row_keys * key_bytes < GATHER_BYTES:
        return None
    lens = kv_len.tolist()
    starts = kv_start.tolist() if kv_start is not None else [0] * rows
    # Tokens past a request's budget may have lengths past its table (their keys land in its last
    # column, the scratch page, and they are never committed): read what the table holds.
    return RunPlan([[_run(slot, pos, n, hi, T, causal, kv_layer.dtype)
                     for slot, pos, n in _spans(table, lo, min(hi, row_keys), page_size)]
                    for table, lo, hi in zip(page_table.tolist(), starts, lens)], T)


def _spans(table: list[int], lo: int, hi: int, page_size: int) -> list[tuple[int, int, int]]:
    """(first slot, first key position, keys) of each run of consecutive slots holding keys [lo, hi)."""
    spans = []
    pos = lo
    while pos < hi:
        page = pos // page_size
        end = page + 1
        while end * page_size < hi and table[end] == table[end - 1] + 1:
            end += 1
        stop = min(end * page_size, hi)
        spans.append((table[page] * page_size + pos % page_size, pos, stop - pos))
        pos = stop
    return spans


def _run(slot: int, pos: int, n: int, kv_len: int, T: int, causal: bool, dtype: torch.dtype) -> Run:
    """Query j of a causal block sees keys below kv_len - (T - 1 - j): only runs reaching past
    kv_len - T + 1 need a mask."""
    if not causal or T == 1 or pos + n <= kv_len - T + 1:
        return Run(slot, n, None, None)
    hi = kv_len - (T - 1 - torch.arange(T))
    hidden = (pos + torch.arange(n))[None, :] >= hi[:, None]
    mask = torch.zeros(T, n, dtype=dtype).masked_fill_(hidden, float("-inf"))[None, None]
    blind = hi <= pos
    return Run(slot, n, mask, blind if bool(blind.any()) else None)
