"""gpu-check part `attention-launch`: the launch choices of the split-KV attention kernel
(common.model.static_attention.Launch) timed against the shipped one, and the best of them run
whole (issue 19: the 8B shape's batch-32 step, where attention reads its KV at a third of the
copy bandwidth).

Cases: the embedded and Llama-3-8B shapes, bf16, decode (T = 1) at batch 1, 8 and 32 over 160
tokens of context and at batch 1 and 32 over 2048, pages of 16 tokens, the page table as wide as
a CUDA graph's static table for an 8K context; each case reads enough layers' KV to stream past the
L2 cache; each launch's output is checked against the shipped one's. Two rounds: the split kernel's warps x pipeline stages x key block at the shipped program
target; then the best of those at other program targets, with the merge kernel's block of slices
fitted to the slices or not. The best is the lowest geometric mean of its times over the shipped
one's, no case more than SLOWER_LIMIT slower. A verify block (batch 8, T = 16) is timed for the
best and the shipped choice. Then the Llama-3-8B floor (`bench engine --shape llama3-8b`, bf16)
runs with the shipped and the best choice in turn, twice each, and the kernel check with the best.
"""
from __future__ import annotations

import itertools
import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from common.model import static_attention as sa
from common.model.cuda_timing import cycled_us_per_op
from common.model.shapes import SHAPES
from common.tools.gpu.checks import kernel_check
from common.tools.gpu.flashinfer_check import DTYPE, PAGE_SIZE, TOLERANCE, Pages, kv_copies

SHAPE_NAMES = ("embedded", "llama3-8b")
DECODE_CASES = ((1, 160), (8, 160), (32, 160), (1, 2048), (32, 2048))  # (batch, context)
VERIFY_CASE = (8, 160, 16)  # (batch, context, T)
TABLE_WIDTH = 8192 // PAGE_SIZE + 1
SLOWER_LIMIT = 1.05
ROUND_1 = [sa.Launch(num_warps=w, num_stages=s, block_n=n) for w, s, n in itertools.product((1, 2, 4), (1, 2, 3), (32, 64))]
TARGETS = (512, 1024, 2048, 4096)


class _Case:
    """One shape, batch, context and T: its KV pages (several layers' worth), queries, and the
    graph-timed microseconds of one attention call under the current sa.LAUNCH."""

    def __init__(self, shape: str, bs: int, context: int, T: int = 1):
        self.key = f"{shape} b{bs} ctx{context}" + (f" T{T}" if T > 1 else "")
        cfg = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(bs * 7 + context + T)
        self.copies = kv_copies(cfg, bs, context)
        self.pages = Pages(cfg, bs, context, self.copies, g, width=TABLE_WIDTH)
        self.T = T
        self.qs = [torch.randn(bs * T, cfg.num_heads, cfg.head_dim, device="cuda", generator=g).to(DTYPE)
                   for _ in range(4)]
        self.reference: torch.Tensor | None = None  # the shipped launch's output, timed first

    def check(self) -> str | None:
        """Why this launch's output is wrong (more than two bf16 roundings from the shipped one's)."""
        out = self.call(0).float()
        if self.reference is None:
            self.reference = out
            return None
        rel = (out - self.reference).abs().max().item() / max(self.reference.abs().max().item(), 1e-30)
        return None if rel <= TOLERANCE else f"{self.key}: output off by {rel:.1e} of its largest value"

    def call(self, i: int) -> torch.Tensor:
        p = self.pages
        return sa.static_attention_triton(self.qs[i % 4], p.layers[i % self.copies], p.page_table, p.kv_len, self.T)

    def us(self) -> float:
        return cycled_us_per_op([lambda i=i: self.call(i) for i in range(max(4, self.copies))])


def _times(launch: sa.Launch, cases: list[_Case]) -> dict[str, float] | str:
    """Microseconds per case under `launch`, or why it could not run (a block that does not fit
    shared memory, say)."""
    sa.LAUNCH = launch
    try:
        wrong = [why for c in cases if (why := c.check())]
        return wrong[0] if wrong else {c.key: c.us() for c in cases}
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _score(times: dict[str, float], base: dict[str, float]) -> float:
    """Geometric mean of the time ratios; infinite where a case is more than SLOWER_LIMIT slower."""
    ratios = [times[k] / base[k] for k in base]
    if max(ratios) > SLOWER_LIMIT:
        return math.inf
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def attention_launch(floor: Callable[[str], dict]) -> dict:
    """`floor(name)`: the floor bench's JSON under the current sa.LAUNCH, saved as `name`."""
    shipped = sa.LAUNCH
    try:
        with torch.inference_mode():
            return _sweep(shipped, floor)
    finally:
        sa.LAUNCH = shipped


def _sweep(shipped: sa.Launch, floor: Callable[[str], dict]) -> dict:
    cases = [_Case(shape, bs, ctx) for shape in SHAPE_NAMES for bs, ctx in DECODE_CASES]
    base = _times(shipped, cases)
    if isinstance(base, str):
        raise RuntimeError(f"the shipped launch does not run: {base}")
    rows = [{"launch": asdict(shipped), "us": base, "score": 1.0}]
    _print(rows[-1])

    def time_each(launches: list[sa.Launch]) -> sa.Launch:
        """Time the launches not timed yet; the best of all timed so far."""
        for candidate in launches:
            if any(r["launch"] == asdict(candidate) for r in rows):
                continue
            times = _times(candidate, cases)
            rows.append({"launch": asdict(candidate)} | ({"error": times, "score": math.inf} if isinstance(times, str)
                                                         else {"us": times, "score": _score(times, base)}))
            _print(rows[-1])
        return sa.Launch(**min(rows, key=lambda r: r["score"])["launch"])

    best = time_each(ROUND_1)
    best = time_each([replace(best, target_programs=t, fit_merge=f) for t, f in itertools.product(TARGETS, (False, True))])
    verify = [_Case(shape, *VERIFY_CASE) for shape in SHAPE_NAMES]
    result = {"rows": rows, "shipped": asdict(shipped), "best": asdict(best),
              "verify_us": {"shipped": _times(shipped, verify), "best": _times(best, verify)}}
    print(f"attention-launch best {asdict(best)}; verify us shipped {result['verify_us']['shipped']} "
          f"best {result['verify_us']['best']}", flush=True)
    floors = []
    for i, (label, launch) in enumerate([("shipped", shipped), ("best", best)] * 2):
        sa.LAUNCH = launch
        try:
            rows_ = floor(f"floor-{label}-{i // 2}.json")["floor"]
            floors.append({"launch": label, "rows": [{k: r[k] for k in ("batch", "step_ms", "floor_ms", "x_floor")}
                                                     for r in rows_]})
        except Exception:
            floors.append({"launch": label, "error": traceback.format_exc()})
        print(f"attention-launch floor {label}: {floors[-1].get('rows', floors[-1].get('error'))}", flush=True)
    result["floors"] = floors
    sa.LAUNCH = best
    result["kernel_check_best"] = kernel_check("cuda", [torch.float32, torch.bfloat16])
    print("attention-launch kernel check with best: max err "
          + ", ".join(f"{r['dtype']} {r['max_abs_err']:.2e}" for r in result["kernel_check_best"]), flush=True)
    return result


def _print(row: dict) -> None:
    times = row.get("us")
    body = row.get("error") if times is None else " ".join(f"{v:7.2f}" for v in times.values())
    print(f"attention-launch {row['launch']} score {row['score']:.3f}: {body}", flush=True)


def summary_lines(result: dict) -> list[str]:
    floors = {}
    for f in result.get("floors", []):
        for r in f.get("rows", []):
            floors.setdefault((f["launch"], r["batch"]), []).append(r["x_floor"])
    lines = [f"attention-launch shipped {result['shipped']}", f"attention-launch best    {result['best']}"]
    for (label, batch), xs in sorted(floors.items()):
        lines.append(f"attention-launch floor {label:7} batch {batch:2}: " + " / ".join(f"x{x:.3f}" for x in xs))
    return lines
