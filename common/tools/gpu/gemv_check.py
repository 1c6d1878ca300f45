"""gpu-check part `gemv`: the decode product kernels (common.model.gemv, and its tensor-core
kernel for a few bf16 rows, common.model.mma) on the GPU.

For each projection of a decoder layer (qkv, o, gate/up with SiLU x up, down) and the LM head, at
the embedded and the Llama-3-8B shapes, fp32 at M = 1 and 8 rows and bf16 at M = 1, 8, 16 and 32:
  check   every Triton launch shape that can compute it (gemv's blocks up to 8 rows, mma's tiles
          in bf16) against cuBLAS's F.linear (and fused.silu_mul after it): fp32 within 1e-5 of
          the largest output, bf16 within 2^-7 (a rounding step) of it
  graph   microseconds per product inside a CUDA graph of at least 50 products (no launch
          costs), the weight read from enough copies to stream past the L2 cache, as a decode
          step streams its layers' weights: cuBLAS and every launch shape; the fastest of each
          kernel, and the fraction of the copy bandwidth (common.tools.bench.floor, measured at
          the start) each reaches: weight bytes / time / copy bandwidth
  plain   cuBLAS and the fastest Triton shape launched one after another (launch costs included)
  auto    what PDFLASH_GEMV=auto picks for the shape (its timing: gemv.timings)
Then per decoder layer (its four products; not the LM head), shape, dtype and M: the sums of
cuBLAS, the fastest gemv and mma shapes, the fastest of all and auto's pick, in graphs.
"""
from __future__ import annotations

import statistics

import torch

from common.model import gemv, mma
from common.model.shapes import SHAPES
from common.tools.bench.floor import memory_bandwidth

STREAM_BYTES = 256 << 20  # weight copies per timing: several times the H200's 60 MB L2
GRAPH_PRODUCTS = 50
REPLAYS = 20
ROWS = {torch.float32: (1, 8), torch.bfloat16: (1, 8, 16, 32)}


def _products(shape: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, silu_mul) of one layer's projections."""
    cfg = SHAPES[shape]
    products = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False),
                "o": (cfg.hidden_size, cfg.q_size, False),
                "gate_up+silu": (2 * cfg.intermediate_size, cfg.hidden_size, True),
                "down": (cfg.hidden_size, cfg.intermediate_size, False),
                "lm_head": (cfg.vocab_size, cfg.hidden_size, False)}
    return products


def _launch_shapes(M: int, dtype: torch.dtype) -> tuple[gemv.Blocks | mma.Tiles, ...]:
    """Every Triton launch shape that can compute M rows of dtype."""
    return ((gemv.CANDIDATES if M <= gemv.MAX_ROWS else ())
            + (mma.CANDIDATES if dtype in mma.DTYPES and M <= mma.MAX_ROWS else ()))


def _err(x: torch.Tensor, w: torch.Tensor, silu_mul: bool, choice: gemv.Choice) -> float:
    """max |Triton - cuBLAS| / max |cuBLAS|."""
    ref = gemv.run(x, w, None, silu_mul, None).float()
    return ((gemv.run(x, w, None, silu_mul, choice).float() - ref).abs().max() / ref.abs().max()).item()


def _us_per_product(xs: list[torch.Tensor], ws: list[torch.Tensor], silu_mul: bool, choice: gemv.Choice,
                    graph: bool) -> float:
    """Median microseconds per product over REPLAYS runs of max(GRAPH_PRODUCTS, copies) products,
    cycling through the weight copies."""
    n = max(GRAPH_PRODUCTS, len(ws))

    def products() -> None:
        for i in range(n):
            gemv.run(xs[i % len(xs)], ws[i % len(ws)], None, silu_mul, choice)

    products()  # compile, cuBLAS handles
    run = products
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            products()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            products()
        run = g.replay
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def gemv_check() -> list[dict]:
    rows = []
    copy_gbs = memory_bandwidth("cuda") / 1e9
    with torch.inference_mode():
        for shape in ("embedded", "llama3-8b"):
            for name, (N, K, silu_mul) in _products(shape).items():
                for dtype, row_counts in ROWS.items():
                    copies = -(-STREAM_BYTES // (N * K * dtype.itemsize))
                    g = torch.Generator(device="cuda").manual_seed(N + K)
                    ws = [torch.randn(N, K, device="cuda", generator=g).div_(K ** 0.5).to(dtype) for _ in range(copies)]
                    for M in row_counts:
                        xs = [torch.randn(M, K, device="cuda", generator=g).to(dtype) for _ in range(4)]
                        rows.append(_case(shape, name, silu_mul, xs, ws, dtype) | {"copy_gbs": copy_gbs})
                    del ws
    return rows


def _case(shape: str, name: str, silu_mul: bool, xs: list[torch.Tensor], ws: list[torch.Tensor],
          dtype: torch.dtype) -> dict:
    M, (N, K) = xs[0].shape[0], ws[0].shape
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    shapes = _launch_shapes(M, dtype)
    errs = {str(c): _err(xs[0], ws[0], silu_mul, c) for c in shapes}
    graph = {c: _us_per_product(xs, ws, silu_mul, c, graph=True) for c in (None, *shapes)}
    best = min(shapes, key=graph.__getitem__)
    fastest = {kind: min((c for c in shapes if isinstance(c, kind)), key=graph.__getitem__, default=None)
               for kind in (gemv.Blocks, mma.Tiles)}
    cold = gemv.timings(xs[0], ws[0], None, silu_mul)
    auto = min(cold, key=cold.__getitem__)
    per_kind = {}
    for kind, c in zip(("gemv", "mma"), fastest.values()):
        per_kind[f"{kind}_graph_us"] = None if c is None else graph[c]
        per_kind[f"{kind}_blocks"] = None if c is None else str(c)
    return {"shape": shape, "product": name, "dtype": str(dtype).removeprefix("torch."), "M": M, "N": N, "K": K,
            "weight_bytes": N * K * dtype.itemsize, "max_rel_err": max(errs.values()),
            "worst": max(errs, key=errs.__getitem__), "ok": max(errs.values()) <= tol, "tolerance": tol,
            "cublas_graph_us": graph[None], "triton_graph_us": graph[best], "triton_blocks": str(best), **per_kind,
            "cublas_plain_us": _us_per_product(xs, ws, silu_mul, None, graph=False),
            "triton_plain_us": _us_per_product(xs, ws, silu_mul, best, graph=False),
            "graph_us_per_blocks": {"cublas" if c is None else str(c): t for c, t in graph.items()},
            "auto_us": {"cublas" if c is None else str(c): 1e3 * t for c, t in cold.items()},
            "auto": "cublas" if auto is None else str(auto), "auto_graph_us": graph[auto]}


def _of_copy(r: dict, us: float | None, weight_bytes: int | None = None) -> str:
    """The fraction of the copy bandwidth that reading the weight in `us` reaches."""
    if us is None:
        return "   -"
    return f"{(weight_bytes or r['weight_bytes']) / (us * 1e-6) / (r['copy_gbs'] * 1e9):4.0%}"


def summary_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [f"gemv     copy bandwidth {rows[0]['copy_gbs']:.0f} GB/s; graph us per product (fraction of the copy "
             f"bandwidth); gemv and mma: the fastest launch shape of each",
             f"gemv     {'shape':9} {'product':12} {'dtype':8} {'M':>2} {'N x K':>12}  {'check':9} "
             f"{'cuBLAS':>14} {'gemv':>14} {'mma':>14}   plain us: cuBLAS Triton  auto"]

    def us(r: dict, key: str) -> str:
        return "     -        " if r[key] is None else f"{r[key]:7.2f} ({_of_copy(r, r[key])})"

    for r in rows:
        check = f"{'ok' if r['ok'] else 'FAIL'} {r['max_rel_err']:.0e}"
        lines.append(f"gemv     {r['shape']:9} {r['product']:12} {r['dtype']:8} {r['M']:2} {r['N']:>6}x{r['K']:<5}  "
                     f"{check:9} {us(r, 'cublas_graph_us')} {us(r, 'gemv_graph_us')} {us(r, 'mma_graph_us')}"
                     f" {r['cublas_plain_us']:16.2f} {r['triton_plain_us']:6.2f}  {r['auto']}")
    layers: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["product"] != "lm_head":
            layers.setdefault((r["shape"], r["dtype"], r["M"]), []).append(r)
    for (shape, dtype, M), rs in layers.items():  # what a decoder layer's four products take, in graphs
        weight_bytes = sum(r["weight_bytes"] for r in rs)
        parts = []
        for label, key in (("cuBLAS", "cublas_graph_us"), ("gemv", "gemv_graph_us"), ("mma", "mma_graph_us"),
                           ("best", "triton_graph_us"), ("auto", "auto_graph_us")):
            if any(r[key] is None for r in rs):
                continue
            total = sum(r[key] for r in rs)
            parts.append(f"{label} {total:.1f} ({_of_copy(rs[0], total, weight_bytes).strip()})")
        lines.append(f"gemv     one {shape} layer, {dtype}, M={M}, us: " + ", ".join(parts))
    return lines
