"""gpu-check part `gemv`: the decode GEMV kernels (common.model.gemv) on the GPU.

For each projection of a decoder layer (qkv, o, gate/up with SiLU x up, down; and the embedded
model's LM head) at the embedded and the Llama-3-8B shapes, M = 1, 4, 8 and 16 rows, fp32 and bf16:
  check   every Triton block shape (tl.dot's included) against cuBLAS's F.linear (and fused.silu_mul after it):
          fp32 within 1e-5 of the largest output, bf16 within 2^-7 (a rounding step) of it
          (auto checks the same before it times a shape, and leaves out one that fails)
  graph   microseconds per product inside a CUDA graph of at least 50 products (no launch
          costs), the weight read from enough copies to stream past the L2 cache, as a decode
          step streams its layers' weights (gemv.timings): cuBLAS, and the fastest Triton block
          shape
  plain   the same products launched one after another (launch costs included)
  auto    what PDFLASH_GEMV=auto picks for the shape, from a second draw of gemv.timings, and
          what that pick costs over the best in the first draw
"""
from __future__ import annotations


import torch

from common.model import gemv
from common.model.cuda_timing import us_per_op
from common.model.shapes import SHAPES
from common.runner.graphs import GraphCache

STREAM_BYTES = 256 << 20  # weight copies for the plain timing: several times the H200's 60 MB L2


def _products(shape: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, silu_mul) of one layer's projections."""
    cfg = SHAPES[shape]
    products = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False),
                "o": (cfg.hidden_size, cfg.q_size, False),
                "gate_up+silu": (2 * cfg.intermediate_size, cfg.hidden_size, True),
                "down": (cfg.hidden_size, cfg.intermediate_size, False)}
    if shape == "embedded":  # the 8B shape's LM head would dwarf its layer
        products["lm_head"] = (cfg.vocab_size, cfg.hidden_size, False)
    return products


def _builds(x: torch.Tensor, w: torch.Tensor, silu_mul: bool, blocks: gemv.Blocks) -> bool:
    try:
        gemv.run(x, w, None, silu_mul, blocks)
    except Exception:  # as gemv.timings: compile, ptxas and resource errors share no base class
        return False
    return True


def _plain_us_per_product(xs: list[torch.Tensor], ws: list[torch.Tensor], silu_mul: bool,
                          blocks: gemv.Blocks | None) -> float:
    """Median microseconds per product of max(GRAPH_PRODUCTS, copies) products launched one after
    another (launch costs included), cycling through the weight copies."""
    n = max(gemv.GRAPH_PRODUCTS, len(ws))

    def products() -> None:
        for i in range(n):
            gemv.run(xs[i % len(xs)], ws[i % len(ws)], None, silu_mul, blocks)

    return us_per_op(products, n, graph=False)


def gemv_check() -> list[dict]:
    rows = []
    with torch.inference_mode():
        for shape in ("embedded", "llama3-8b"):
            for name, (N, K, silu_mul) in _products(shape).items():
                for dtype in (torch.float32, torch.bfloat16):
                    copies = -(-STREAM_BYTES // (N * K * dtype.itemsize))
                    g = torch.Generator(device="cuda").manual_seed(N + K)
                    ws = [torch.randn(N, K, device="cuda", generator=g).div_(K ** 0.5).to(dtype) for _ in range(copies)]
                    for M in (1, 4, 8, 16):
                        xs = [torch.randn(M, K, device="cuda", generator=g).to(dtype) for _ in range(4)]
                        rows.append(_case(shape, name, silu_mul, xs, ws, dtype))
                    del ws
    return rows


def _case(shape: str, name: str, silu_mul: bool, xs: list[torch.Tensor], ws: list[torch.Tensor],
          dtype: torch.dtype) -> dict:
    M, (N, K) = xs[0].shape[0], ws[0].shape
    tol = gemv.tolerance(dtype)
    graph = gemv.timings(xs[0], ws[0], None, silu_mul)  # leaves out the blocks this GPU cannot build
    # Every shape that builds here, those auto left out for their errors too.
    errs = {str(b): gemv.error(xs[0], ws[0], None, silu_mul, b) for b in gemv.CANDIDATES
            if b.runs(dtype) and (b in graph or _builds(xs[0], ws[0], silu_mul, b))}
    best = min((b for b in graph if b is not None), key=graph.__getitem__, default=None)
    if best is None:
        raise RuntimeError(f"gemv: no Triton block shape builds on this GPU for {name} (see the warnings above)")
    drawn = gemv.timings(xs[0], ws[0], None, silu_mul)  # another draw, as auto takes it
    auto = min(drawn, key=drawn.__getitem__)
    return {"shape": shape, "product": name, "dtype": str(dtype).removeprefix("torch."), "M": M, "N": N, "K": K,
            "max_rel_err": max(errs.values()), "ok": max(errs.values()) <= tol, "tolerance": tol,
            "cublas_graph_us": graph[None], "triton_graph_us": graph[best], "triton_blocks": str(best),
            "cublas_plain_us": _plain_us_per_product(xs, ws, silu_mul, None),
            "triton_plain_us": _plain_us_per_product(xs, ws, silu_mul, best),
            "graph_us_per_blocks": {str(b): t for b, t in graph.items()},
            "auto_us": {str(b): t for b, t in drawn.items()}, "auto": gemv.blocks_name(auto),
            "auto_loss_us": graph[auto] - min(graph.values())}


SPLIT_REPEATS = 200


def split_repeats() -> list[dict]:
    """gpu-check part `gemv-split`: each split-K block shape (gemv.Blocks with a span) at the
    embedded layer's products, 8 and 16 rows, fp32 and bf16, run SPLIT_REPEATS times one after
    another and as many CUDA-graph replays: every result must equal the first bit for bit
    (whichever program of a column block arrives last, it sums the partials in one order), and
    the arrival counters must be back at zero."""
    rows = []
    with torch.inference_mode():
        for name, (N, K, silu_mul) in _products("embedded").items():
            if name == "lm_head":
                continue
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator(device="cuda").manual_seed(N + K)
                w = torch.randn(N, K, device="cuda", generator=g).div_(K ** 0.5).to(dtype)
                for M in (8, 16):
                    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
                    for blocks in gemv.CANDIDATES:
                        if blocks.span and blocks.runs(dtype) and blocks.splits(K) > 1:
                            rows.append(_repeats(name, silu_mul, x, w, blocks))
    return rows


def _repeats(name: str, silu_mul: bool, x: torch.Tensor, w: torch.Tensor, blocks: gemv.Blocks) -> dict:
    first = gemv.run(x, w, None, silu_mul, blocks).clone()
    eager = sum(torch.equal(gemv.run(x, w, None, silu_mul, blocks), first) for _ in range(SPLIT_REPEATS))
    graphs, replayed = GraphCache(enabled=True), 0
    for _ in range(SPLIT_REPEATS):
        out = graphs.run("product", lambda: gemv.run(x, w, None, silu_mul, blocks))  # captured on the first
        replayed += torch.equal(out, first)
        out.zero_()  # the next replay must write it again
    zero = gemv.split_counters_at_zero(x.device)
    return {"product": name, "dtype": str(x.dtype).removeprefix("torch."), "M": x.shape[0], "blocks": str(blocks),
            "splits": blocks.splits(x.shape[1]), "eager_same": eager, "graph_same": replayed,
            "repeats": SPLIT_REPEATS, "counters_zero": zero,
            "ok": eager == replayed == SPLIT_REPEATS and zero}


def split_summary_lines(rows: list[dict]) -> list[str]:
    return [f"gemv-split {r['product']:12} {r['dtype']:8} M={r['M']:<2} {r['blocks']:22} {r['splits']:2} splits: "
            f"same as the first {r['eager_same']}/{r['repeats']} eager, {r['graph_same']}/{r['repeats']} graph "
            f"replays; counters zero {r['counters_zero']}  {'ok' if r['ok'] else 'FAIL'}" for r in rows]


def summary_lines(rows: list[dict]) -> list[str]:
    if not rows:  # the part did not run
        return []
    lines = [f"gemv     {'shape':9} {'product':12} {'dtype':8} M   {'N x K':>11}  check     graph us: cuBLAS Triton"
             f"   plain us: cuBLAS Triton  auto"]
    for r in rows:
        check = f"{'ok' if r['ok'] else 'FAIL'} {r['max_rel_err']:.0e}"
        lines.append(f"gemv     {r['shape']:9} {r['product']:12} {r['dtype']:8} {r['M']:<2}  {r['N']:>5}x{r['K']:<5}  "
                     f"{check:9} {r['cublas_graph_us']:14.2f} {r['triton_graph_us']:6.2f}"
                     f" {r['cublas_plain_us']:16.2f} {r['triton_plain_us']:6.2f}  {r['auto']} (+{r['auto_loss_us']:.2f})")
    layers: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["product"] != "lm_head":
            layers.setdefault((r["shape"], r["dtype"], r["M"]), []).append(r)
    for (shape, dtype, M), rs in layers.items():  # what a decoder layer's four products take, in graphs
        cublas, triton = sum(r["cublas_graph_us"] for r in rs), sum(r["triton_graph_us"] for r in rs)
        lines.append(f"gemv     one {shape} layer, {dtype}, M={M}: cuBLAS {cublas:.1f} us, Triton {triton:.1f} us "
                     f"(x{cublas / triton:.2f})")
    return lines
