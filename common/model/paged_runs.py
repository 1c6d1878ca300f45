"""CPU attention over a paged KV cache that reads each row's keys where they lie.

The plain torch path of `static_attention` gathers every row's pages into one padded tensor per
layer and step. At long contexts on a CPU that copy costs more than the attention itself: at 8 rows
x 8K keys (embedded model, fp32) one layer took 44 ms gathered and 14-16 ms read in place.

A row's pages are runs of consecutive pages: a request takes its budget's pages at once, one run
from a fresh pool, a few from pages that finished requests gave back. Each run is a slice of the
cache, so the flash kernel attends over it without a copy and returns its log-sum-exp; the runs'
outputs are then merged by those weights. The runs, and the causal masks of those that hold a
block's own tokens, depend only on the step's page table and lengths, so one `RunPlan` serves every
layer of a step.

Prefill chunks and other batches of the general path (`attention.build_attn_meta`) are read the same
way on a CPU (`Extend`): each request's new tokens attend to each other with the kernel's causal
mask and to the runs of its cached keys without one (gathered into one read where the runs are
short); no padded queries, no mask tensor, no gather beyond the new tokens' own K/V. Per layer, four
prompts of 2K tokens took 193 ms padded and masked, 97 ms so; eight chunks of 512 after 1,536 cached
tokens 102 -> 78 ms; 32 prompts of 150 tokens 12.1 -> 12.2 ms.

In a static step, reading in place costs one kernel call per run and row, and a merge per row with
several runs, where gathering makes one batched call. `plan()` reads in place where that measured
faster: one row; several rows, if they are `LONG_ROW` keys long or their gather would take
`GATHER_BYTES`, and their runs are `SHORT_RUN` keys long on average. Elsewhere it returns None and
the caller gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Per layer on a 2-core Xeon, fp32, embedded model, gathered -> in place, T = 1 / 16 (a decode step /
# a verify block): 8 rows of 2K keys 3.4 -> 2.9 / 5.9 -> 6.5 ms, of 4K 8.1 -> 6.4 / 14.9 -> 13.5 ms;
# 16 rows of 1K 3.0 -> 3.7 / 6.2 -> 8.7 ms. One row: 1K keys 0.49 -> 0.11 / 0.51 -> 0.32 ms.
LONG_ROW = 2048  # keys the longest row reads
# Larger allocations are mapped afresh each time (glibc's largest mmap threshold is 32 MiB), and
# every page of a gather that size faults: 32 rows of 2K keys (57 MB) 46.5 -> 15.5 / 59.6 -> 32.1 ms.
GATHER_BYTES = 32 << 20
# Several rows of shorter runs than this on average cost more in kernel calls and merges than a
# gather: 8 rows of 4K keys, T = 1 / 8, in runs of 64 keys 7.7 -> 14.0 / 10.4 -> 21.3 ms, of 256
# 6.9 -> 5.2 / 9.0 -> 8.7 ms. One row reads in place faster even in runs of 16 keys (1.0 -> 0.5 ms).
SHORT_RUN = 256  # keys

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # as F.sdpa's, plus the log-sum-exp


@dataclass
class Run:
    slot: int  # the run's first cache slot (page * page_size + offset)
    keys: int  # how many consecutive slots it holds
    mask: torch.Tensor | None  # [1, 1, T, keys] additive causal mask; None: every query sees every key
    blind: torch.Tensor | None  # [T] bool: queries that see none of its keys (their log-sum-exp is set to -inf)

    def read(self, qb: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, scale: float | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _flash(qb, k_slots[self.slot:self.slot + self.keys], v_slots[self.slot:self.slot + self.keys], scale,
                        mask=self.mask)
        if self.blind is not None:  # the kernel leaves lse 0 and o 0 there: weigh them 0
            lse = lse.masked_fill(self.blind, float("-inf"))
            o = o.masked_fill(self.blind[:, None], 0.0)
        return o, lse


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
            out[b] = _combine([run.read(qv[b:b + 1], k_slots, v_slots, scale) for run in runs])
        return out.view(-1, q.shape[1], d)


@dataclass
class Extend:
    """One request of a general batch: its new tokens are q's rows [row, row + count)."""
    row: int
    count: int
    cached: list[tuple[int, int]]  # (first slot, keys) of each run of its cached keys, read in place
    # Its cached slots instead, where its runs are too short to read one by one (SHORT_RUN).
    scattered: torch.Tensor | None = None


def extend_requests(starts: list[int], counts: list[int], page_tables: list[list[int]], page_size: int) -> list[Extend]:
    """Each request of a general batch (`starts[i]` tokens cached, `counts[i]` new ones after them,
    the new tokens of all requests in q one request after another)."""
    requests, row = [], 0
    for start, n, pages in zip(starts, counts, page_tables):
        runs = [(slot, keys) for slot, _, keys in spans(pages, 0, start, page_size)]
        if not n:  # nothing to attend (and the kernel does not take empty queries)
            pass
        elif len(runs) > 1 and start < SHORT_RUN * len(runs):
            requests.append(Extend(row, n, [], torch.cat([torch.arange(slot, slot + keys) for slot, keys in runs])))
        else:
            requests.append(Extend(row, n, runs))
        row += n
    return requests


def attend_extend(q: torch.Tensor, kv_layer: torch.Tensor, write_slots: torch.Tensor, requests: list[Extend],
                  scale: float | None) -> torch.Tensor:
    """q [T, Hq, d] -> [T, Hq, d]: each request's new tokens (their K/V already in the cache at
    `write_slots`) over each other, causally, and over its cached keys."""
    heads, d = kv_layer.shape[-2:]
    k_slots = kv_layer[0].view(-1, heads, d)
    v_slots = kv_layer[1].view(-1, heads, d)
    out = torch.empty(q.shape[0], q.shape[1], d, dtype=q.dtype, device=q.device)
    for r in requests:
        qb = q[r.row:r.row + r.count].transpose(0, 1)[None]  # [1, Hq, n, d]
        new = write_slots[r.row:r.row + r.count]
        # The kernel's causal mask is aligned to the top left: right for queries and keys that are
        # the same tokens, so the new tokens attend to each other on their own.
        parts = [_flash(qb, k_slots[new], v_slots[new], scale, causal=True)]
        if r.scattered is not None:
            parts.append(_flash(qb, k_slots[r.scattered], v_slots[r.scattered], scale))
        parts += [_flash(qb, k_slots[slot:slot + n], v_slots[slot:slot + n], scale) for slot, n in r.cached]
        out[r.row:r.row + r.count] = _combine(parts)
    return out


def _flash(qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
           mask: torch.Tensor | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """qb [1, Hq, n, d] over keys and values [keys, Hkv, d] (slices of the cache's slots, or the
    slots gathered): the output [1, Hq, n, d] and its log-sum-exp [1, Hq, n]."""
    return _FLASH(qb, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                  scale=scale)


def _combine(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One row's attention over its parts' keys [n, Hq, d], from each part's output and
    log-sum-exp: the parts' outputs weighed by their share of the softmax's sum."""
    if len(parts) == 1:
        return parts[0][0][0].transpose(0, 1)
    outs, lses = zip(*parts)
    w = torch.softmax(torch.stack(lses)[:, 0], 0)  # [R, Hq, n], fp32
    o = (torch.stack(outs)[:, 0].float() * w[..., None]).sum(0)
    return o.transpose(0, 1).to(outs[0].dtype)


def plan(page_table: torch.Tensor, kv_len: torch.Tensor, kv_start: torch.Tensor | None, T: int,
         causal: bool, kv_layer: torch.Tensor) -> RunPlan | None:
    """The runs of a static step on the CPU, or None where gathering is the better way (or the
    only one: on a GPU, where reading the table would also break a CUDA graph's capture)."""
    if page_table.device.type != "cpu":
        return None
    rows, width = page_table.shape
    page_size, key_bytes = kv_layer.shape[2], kv_layer[0, 0, 0].numel() * kv_layer.element_size()
    lens = kv_len.tolist()
    if rows > 1 and max(lens) < LONG_ROW and rows * width * page_size * key_bytes < GATHER_BYTES:
        return None
    starts = kv_start.tolist() if kv_start is not None else [0] * rows
    # Tokens past a request's budget may have lengths past its table (their keys land in its last
    # column, the scratch page, and they are never committed): read what the table holds.
    reach = width * page_size
    by_row = [spans(table, lo, min(hi, reach), page_size) for table, lo, hi in zip(page_table.tolist(), starts, lens)]
    assert all(by_row), "a row reads no key"
    if rows > 1 and sum(n for row in by_row for _, _, n in row) < SHORT_RUN * sum(map(len, by_row)):
        return None
    return RunPlan([[_run(slot, pos, n, hi, T, causal, kv_layer.dtype) for slot, pos, n in row]
                    for row, hi in zip(by_row, lens)], T)


def spans(table: list[int], lo: int, hi: int, page_size: int) -> list[tuple[int, int, int]]:
    """(first slot, first key position, keys) of each run of consecutive slots holding keys [lo, hi)."""
    out = []
    pos = lo
    while pos < hi:
        page = pos // page_size
        end = page + 1
        while end * page_size < hi and table[end] == table[end - 1] + 1:
            end += 1
        stop = min(end * page_size, hi)
        out.append((table[page] * page_size + pos % page_size, pos, stop - pos))
        pos = stop
    return out


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
