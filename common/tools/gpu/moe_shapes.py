"""The `moe-shapes` part of `pdflash gpu-check`: MoE and KDA models decoding in CUDA graphs, and
their decode step against its memory floor (graphs against eager: the `moe-graphs` part).

  experts  the grouped expert path against the dense one (both captured by graphs), on the
           device, in each dtype torch._grouped_mm supports there (random inputs, a small shape)
  floor    `pdflash bench engine --shape deepseek-v2-lite` and `--shape kimi-linear-48b`, bf16,
           batch 1, 8 and 32 (floor_<shape>.json): step against the floor of the bytes it reads;
           Kimi-Linear cut to its first layers if the whole model does not fit, eager if a graph
           cannot be captured (the rows say which)
  memory   weights, KV bytes per token and state bytes per request of both, and a 16K-token
           prompt's total (arithmetic)

Writes moe_shapes.json and moe_shapes.md to the output folder. `small` runs every piece on the
small shapes (the floor too), on the CPU when there is no GPU, so that a GPU run is not the
code's first.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from common.model.moe import MoE, grouped_mm_supported
from common.model.shapes import SHAPES, RandomWeights, fill_random_
from common.runner.model_runner import DTYPES
from common.tools.bench.engine import FloorRow, floor_table
from common.tools.bench.memory import request_memory
from common.tools.bench.report import md_table

SMALL = {"deepseek-v2-lite": "deepseek-small", "kimi-linear-48b": "kimi-linear-small"}
CUT_LAYERS = 14  # Kimi-Linear's first 14 layers (MLA at 3, 7, 11) if the whole model does not fit
MEMORY_TOKENS = 16384


def experts_check(device: str) -> list[dict]:
    """Max |grouped - dense| of a MoE layer's routed experts over 37 tokens, per dtype."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if not grouped_mm_supported(torch.device(device).type, dtype):
            rows.append({"dtype": str(dtype).removeprefix("torch."), "grouped_mm": False})
            continue
        moe = fill_random_(MoE(SHAPES["deepseek-small"]).to(device=device, dtype=dtype), RandomWeights(seed=1, std=0.2))
        x = torch.randn(37, moe.down.shape[1], generator=torch.Generator().manual_seed(0)).to(device, dtype)
        with torch.inference_mode():
            experts, weights = moe.route(x)
            want = moe.run_dense(x, experts, weights).float()
            got = moe.run_grouped(x, experts, weights).float()
        rows.append({"dtype": str(dtype).removeprefix("torch."), "grouped_mm": True,
                     "max_abs_err": (got - want).abs().max().item(), "max_abs": want.abs().max().item()})
    return rows


def floor_rows(out_dir: str, device: str, shape: str, small: bool) -> dict:
    """bench engine's floor rows of `shape` (its small stand-in if `small`), retried cut to
    CUT_LAYERS layers if it runs out of memory and eagerly if a graph fails."""
    from common.tools import cli

    name = SMALL[shape] if small else shape
    path = os.path.join(out_dir, f"floor_{name}.json")
    argv = ["bench", "engine", "--device", device, "--shape", name, "--dtype", "bf16", "--batches", "1,8,32",
            "--out", path] + (["--decode-prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1", "--warmup", "0"]
                              if small else ["--decode-prompt-tokens", "128", "--new-tokens", "32", "--repeats", "2",
                                             "--warmup", "1"])
    attempts = [[]] + ([["--layers", str(CUT_LAYERS)]] if SHAPES[name].kda is not None else [])
    attempts.append(attempts[-1] + ["--no-cuda-graphs"])
    errors: list[str] = []
    for extra in attempts:
        try:
            if cli.main(argv + extra) != 0:
                raise RuntimeError("bench engine exited non-zero")
            with open(path) as f:
                return json.load(f) | {"retries": errors}
        except Exception as e:  # each failed attempt is reported with the rows
            errors.append(f"{' '.join(extra) or 'as is'}: {type(e).__name__}: {e}"[:500])
            print(f"floor {name}: {errors[-1]}", flush=True)
        finally:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    raise RuntimeError(f"floor {name}: every attempt failed: {errors}")


def moe_shapes(out_dir: str, small: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "small": small,
                    "experts": [], "floor": {}, "errors": []}

    def attempt(what: str, fn: Callable[[], object]) -> object | None:
        """fn's result; a failure is recorded and the next piece goes on."""
        print(f"moe-shapes: {what}", flush=True)
        try:
            return fn()
        except Exception:
            result["errors"].append(f"{what}: {traceback.format_exc()[-1500:]}")
            print(result["errors"][-1], file=sys.stderr, flush=True)
            return None

    result["experts"] = attempt(f"grouped experts against dense on {device}", lambda: experts_check(device)) or []
    for shape in ("deepseek-v2-lite", "kimi-linear-48b"):
        name = SMALL[shape] if small else shape
        rows = attempt(f"floor of {name}", lambda: floor_rows(out_dir, device, shape, small))
        if rows:
            result["floor"][name] = rows
    result["memory"] = {shape: request_memory(SHAPES[shape], DTYPES["bf16"].itemsize, MEMORY_TOKENS).lines()
                        for shape in ("deepseek-v2-lite", "kimi-linear-48b")}
    result["lines"] = summary_lines(result)
    with open(os.path.join(out_dir, "moe_shapes.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "moe_shapes.md"), "w") as f:
        f.write(markdown(result))
    return result


def summary_lines(result: dict) -> list[str]:
    lines = []
    for r in result["experts"]:
        lines.append(f"experts  {r['dtype']}: " + (f"max |grouped - dense| {r['max_abs_err']:.2e} (values up to "
                                                   f"{r['max_abs']:.2f})" if r["grouped_mm"] else "no grouped mm"))
    for shape, f in result["floor"].items():
        for r in f["floor"]:
            lines.append(f"floor    {r['shape']} batch {r['batch']:2}: step {r['step_ms']:.3f} ms, floor "
                         f"{r['floor_ms']:.3f} ms, x{r['x_floor']:.2f} ({r['layers']} of {r['model_layers']} layers, "
                         f"graphs {'on' if r['cuda_graphs'] else 'off'})")
        lines += [f"floor    {shape} retried: {e}" for e in f.get("retries", [])]
    lines += [f"ERROR    {e.strip().splitlines()[0]} ... {e.strip().splitlines()[-1]}" for e in result["errors"]]
    return lines


def markdown(result: dict) -> str:
    parts = [f"# moe-shapes on {result['device']}" + (" (small shapes)" if result["small"] else ""), ""]
    parts += ["## Grouped experts against dense", "",
              md_table(["dtype", "grouped mm", "max abs err", "max abs value"],
                       [[r["dtype"], "yes" if r["grouped_mm"] else "no", f"{r.get('max_abs_err', float('nan')):.2e}",
                         f"{r.get('max_abs', float('nan')):.2f}"] for r in result["experts"]]), ""]
    for shape, f in result["floor"].items():
        rows = [FloorRow(**{k: v for k, v in r.items() if k != "x_floor"}) for r in f["floor"]]
        parts += [f"## Decode step against its floor: {shape}", "",
                  f"Memory bandwidth {f['memory_bandwidth_gbs']:.0f} GB/s.", "", floor_table(rows), ""]
        parts += [f"Retried: {e}" for e in f.get("retries", [])]
    for e in result["errors"]:
        parts += ["Failed:", "```", e.strip(), "```", ""]
    parts += ["## Memory (bf16)", ""]
    for lines in result["memory"].values():
        parts += ["```", *lines, "```", ""]
    return "\n".join(parts)
