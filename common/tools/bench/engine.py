"""`pdflash bench engine`: prefill and decode tok/s of our runner vs transformers' generate().

Both sides run in this process on the same prompt ids, greedy, in the same dtype, with EOS
ignored so every request makes exactly --new-tokens tokens. Ours runs through the Engine (the
code path the services drive: chunked prefill, batched paged decode, sampling, stop checks).

  prefill tok/s  = prompt tokens / time to the first token (one --prefill-tokens prompt)
  decode tok/s   = B * (new_tokens - 1) / decode time at batch B; decode time runs from the
                   first token (end of prefill) to the last, i.e. new_tokens - 1 forward steps.
                   transformers' first token is timed with a logits processor, called right
                   after each forward. Decode runs at each --decode-prompt-tokens context
                   (default 48 and 700: after a short prompt, and after a 700-token one).

Each number is the best of --repeats timed runs (medians go to the JSON) after --warmup
untimed ones; the two sides alternate run by run, so load from elsewhere on a shared machine
hits both alike.

Floor check: our decode step time (decode time / (new_tokens - 1), through the Engine) against
    floor = weight bytes one step reads / device memory bandwidth (common.model.shapes),
the bandwidth measured in the same run. Decode rows of the comparison carry it; `--shape NAME`
runs it alone on random weights of that shape (llama3-8b: 32 layers, hidden 4096, 32/8 heads,
MLP 14336, vocab 128256; deepseek-v2-lite and kimi-linear-48b: MLA, MoE and KDA layers, see
common.model.shapes), and on CUDA the comparison is followed by the llama3-8b check unless
--no-floor. `--random-weights` runs the comparison on random weights in the embedded model's
shape: no model file needed, and the tokens mean nothing.

For MoE shapes the floor counts only the routed experts a step's tokens chose (distinct per
layer, counted in an eager rerun of the same decode steps), and for KDA layers adds each
request's recurrent state, read and written once a step. `--layers N` keeps the first N layers
(same per-layer shapes and KDA/MLA pattern) for a model that does not fit; rows then say so and
give per-layer times. `--memory-only` prints, without timing anything, the weights, the KV bytes
per token, the state bytes per request and one --memory-tokens prompt's total for --shape.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.model.config import ModelConfig
from common.model.shapes import SHAPES, RandomWeights, first_layers, random_token_ids, random_weights
from common.model.tokenizer import Tokenizer
from common.model.source import resolve_model
from common.model.weights import load_weights
from common.runner.model_runner import DTYPES, ModelRunner
from common.service.loader import add_model_args
from common.tools.bench.floor import ChosenExperts, memory_bandwidth, step_weight_bytes
from common.tools.bench.memory import request_memory
from common.tools.bench.report import md_table

# Varied English text; repeated and cut to the token counts needed.
_TEXT = (
    "The history of the city begins with a small fishing village on the northern bank of the river. "
    "Over three centuries it grew into a trading port, then an industrial centre, and finally the "
    "capital of the province. Its merchants sold wool, salt and timber to partners across the sea, "
    "and the money they brought home paid for bridges, schools and a cathedral that took ninety "
    "years to finish. In the nineteenth century the railway arrived, and with it factories, "
    "tenements and a population that doubled every twenty years. Engineers drained the marshes to "
    "the east, built a sewer system that is still in use, and laid out wide avenues lined with "
    "plane trees. The twentieth century brought two wars, a long economic decline and, after the "
    "docks closed, a slow reinvention as a centre for universities, hospitals and software firms. "
    "Today visitors come for the museums, the old market hall and the walk along the river, where "
    "the warehouses have become flats, galleries and restaurants. "
)


@dataclass
class Row:
    dtype: str
    metric: str  # "prefill" or "decode"
    batch: int
    prompt_tokens: int  # per request
    new_tokens: int  # per request (1 for prefill: time to the first token)
    ours_tok_s: float  # best run
    hf_tok_s: float
    ours_median_tok_s: float
    hf_median_tok_s: float
    cpu_pressure: float | None = None  # Linux PSI "some" avg10 right after the case: load from elsewhere
    ours_step_ms: float | None = None  # decode rows: our best step time
    floor_ms: float | None = None  # decode rows: weight bytes / memory bandwidth

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.hf_tok_s


@dataclass
class FloorRow:
    shape: str
    dtype: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    step_ms: float  # best run: decode time / (new_tokens - 1)
    median_step_ms: float
    floor_ms: float  # (weight bytes + state bytes) / memory bandwidth
    weight_bytes: int  # weights one step reads (MoE: the chosen routed experts only)
    kv_read_bytes: int  # KV one step reads, mid-run (not in the floor; small at short contexts)
    cuda_graphs: bool
    layers: int = 0  # layers run (--layers may cut the model)
    model_layers: int = 0  # layers of the whole model
    experts_read: float | None = None  # MoE: distinct routed experts a step reads, summed over layers
    state_bytes: int = 0  # KDA: recurrent states and windows read and written per step

    @property
    def x_floor(self) -> float:
        return self.step_ms / self.floor_ms


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise ValueError(f"{what} must list positive integers, got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per request in decode runs")
    p.add_argument("--prefill-tokens", type=int, default=700, help="prompt length of the prefill run")
    p.add_argument("--decode-prompt-tokens", default="48,700",
                   help="prompt length(s) of the decode requests, comma-separated (the context decode runs on)")
    p.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,8; 1,8,32 on cuda)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per number (best reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per number first")
    p.add_argument("--quiet-below", type=float, default=None, metavar="PCT",
                   help="shared machines: before each timed pair, wait until CPU pressure from other "
                        "processes (Linux PSI avg10) is below PCT%%")
    p.add_argument("--random-weights", action="store_true",
                   help="compare on random weights in the embedded model's shape (no model file or tokenizer)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="only the floor check, on random weights of this shape (default dtype bf16)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --shape: keep only the first N layers (same per-layer shapes and KDA/MLA pattern)")
    p.add_argument("--memory-only", action="store_true",
                   help="with --shape: print weights, KV bytes per token and state bytes per request; time nothing")
    p.add_argument("--memory-tokens", type=int, default=16384, help="prompt length of --memory-only's per-request total")
    p.add_argument("--no-floor", action="store_true", help="cuda: skip the llama3-8b floor check after the comparison")
    p.add_argument("--out", default="bench-out/engine.json")
    add_model_args(p, kv_pages=0)  # 0: sized for the largest run
    # Both dtypes unless one is asked for.
    p.set_defaults(dtype=None)
    for action in p._actions:
        if action.dest == "dtype":
            action.help = "fp32 or bf16 (default: both)"


def run(args: argparse.Namespace) -> int:
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be at least 2 (decode time spans new_tokens - 1 steps)")
    if (args.layers is not None or args.memory_only) and args.shape is None:
        raise ValueError("--layers and --memory-only need --shape")
    if args.memory_only:
        return _memory(args)
    cuda = torch.device(args.device).type == "cuda"
    batches = _ints(args.batches or ("1,8,32" if cuda else "1,8"), "--batches")
    contexts = _ints(args.decode_prompt_tokens, "--decode-prompt-tokens")
    bandwidth = memory_bandwidth(args.device)
    how = "read + write of a 1 GiB copy" if cuda else "read by a 1 GiB matrix-vector product"
    print(f"{args.device} memory bandwidth {bandwidth / 1e9:.1f} GB/s ({how})", flush=True)
    pressure_before = _cpu_pressure()
    result = {
        "device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": _hf_version(), "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if cuda else None, "memory_bandwidth_gbs": bandwidth / 1e9,
        "cuda_graphs": cuda and not args.no_cuda_graphs,
        "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens,
        "decode_prompt_tokens": contexts, "batches": batches, "repeats": args.repeats, "warmup": args.warmup,
        "quiet_below": args.quiet_below,
    }
    if args.shape is None:
        result |= _compare(args, batches, contexts, bandwidth)
    floor_shapes = [args.shape] if args.shape else (["llama3-8b"] if cuda and not args.no_floor else [])
    floor = [r for shape in floor_shapes for r in _floor(args, shape, batches, contexts[0], bandwidth)]
    if floor:
        print()
        print(floor_table(floor))
    result["floor"] = [asdict(r) | {"x_floor": r.x_floor} for r in floor]
    # share of time some task waited for a CPU (Linux PSI, avg over 60 s): load from elsewhere
    result["cpu_pressure_some_avg60"] = {"before": pressure_before, "after": _cpu_pressure()}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nsaved {args.out}")
    return 0


def _compare(args: argparse.Namespace, batches: list[int], contexts: list[int], bandwidth: float) -> dict:
    """Ours against transformers' generate(), every case in each dtype; returns JSON fields."""
    # fp32 first: the transformers model is converted in place to each dtype in turn.
    dtypes = [args.dtype] if args.dtype else ["fp32", "bf16"]
    longest = max(contexts + [args.prefill_tokens])
    if args.random_weights:
        cfg = SHAPES["embedded"]
        tensors = random_weights(cfg, torch.float32, "cpu")
        stream = random_token_ids(cfg, longest + max(batches) * 7)
        hf_fp32 = _random_hf(cfg, tensors)
        eos = cfg.eos_token_ids
        print("random weights in the embedded model's shape (no model file): speed only, the tokens mean nothing")
    else:
        src = resolve_model(args.model)
        cfg, tensors = load_weights(src)
        tok = Tokenizer(src, cfg.eos_token_ids)
        stream = _token_stream(tok, longest + max(batches) * 7)
        hf_fp32 = _load_hf(src)
        eos = tok.eos_token_ids
    if longest + args.new_tokens > cfg.max_position:
        raise ValueError(f"prompts of {longest} tokens + {args.new_tokens} new exceed the context ({cfg.max_position})")
    prefill_prompt = stream[: args.prefill_tokens]
    # Request i starts i*7 tokens into the text: different prompts of equal length (no HF padding).
    prompts = {n: [stream[7 * i:7 * i + n] for i in range(max(batches))] for n in contexts}

    cases = [("prefill", 1, len(prefill_prompt), 1)] + [
        ("decode", b, n, args.new_tokens) for n in contexts for b in batches]
    rows: list[Row] = []
    for dtype in dtypes:
        need = max(b * (n + new) for _, b, n, new in cases)
        pages = args.kv_pages or -(-need // args.page_size) + max(batches)
        runner = ModelRunner(cfg, tensors, dtype=dtype, device=args.device, num_pages=pages,
                             page_size=args.page_size, enforce_eager=args.no_cuda_graphs)
        floor_ms = 1e3 * step_weight_bytes(runner.model) / bandwidth
        hf = hf_fp32.to(device=args.device, dtype=DTYPES[dtype])
        ours = _OursTimer(runner, eos)
        theirs = _HfTimer(hf, eos, args.device)
        for metric, b, n, new in cases:
            batch = [prefill_prompt] if metric == "prefill" else prompts[n][:b]
            # prefill: time to the first token; decode: from the first token to the last
            part = 0 if metric == "prefill" else 1
            t_ours, t_hf = _time_sides([lambda: ours.run(batch, new)[part], lambda: theirs.run(batch, new)[part]],
                                       args.warmup, args.repeats, args.quiet_below)
            work = n if metric == "prefill" else b * (new - 1)
            step = None if metric == "prefill" else 1e3 * min(t_ours) / (new - 1)
            rows.append(Row(dtype, metric, b, n, new, work / min(t_ours), work / min(t_hf),
                            work / statistics.median(t_ours), work / statistics.median(t_hf),
                            _cpu_pressure("avg10"), step, None if step is None else floor_ms))
            print(_fmt(rows[-1]), flush=True)
        del runner, hf, ours, theirs

    print()
    print(table(rows))
    return {"model": cfg.name, "weights": "random" if args.random_weights else "model",
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}


def _memory(args: argparse.Namespace) -> int:
    """--memory-only: the shape's memory by arithmetic (common.tools.bench.memory)."""
    dtype = args.dtype or "bf16"
    cfg = SHAPES[args.shape] if args.layers is None else first_layers(SHAPES[args.shape], args.layers)
    mem = request_memory(cfg, DTYPES[dtype].itemsize, args.memory_tokens)
    print(f"{dtype}:")
    print("\n".join(mem.lines()))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "dtype": dtype} | asdict(mem) | {"prompt_kv_bytes": mem.prompt_kv_bytes,
                                                                            "prompt_bytes": mem.prompt_bytes}, f, indent=2)
        print(f"\nsaved {args.out}")
    return 0


def _floor(args: argparse.Namespace, shape: str, batches: list[int], context: int,
           bandwidth: float) -> list[FloorRow]:
    """Our decode step on random weights of `shape` at each batch size, against the floor."""
    whole = SHAPES[shape]
    cfg = whole if args.layers is None else first_layers(whole, args.layers)
    dtype = args.dtype or "bf16"
    new = args.new_tokens
    pages = -(-max(batches) * (context + new) // args.page_size) + max(batches)
    print("\n".join(request_memory(cfg, DTYPES[dtype].itemsize, args.memory_tokens).lines()))
    print(f"{shape}: drawing random {dtype} weights on {args.device} ({cfg.num_layers} of {whole.num_layers} layers)",
          flush=True)
    runner = ModelRunner(cfg, RandomWeights(), dtype=dtype, device=args.device, num_pages=pages,
                         page_size=args.page_size, enforce_eager=args.no_cuda_graphs, state_slots=max(batches))
    ours = _OursTimer(runner, ())
    prompts = [random_token_ids(cfg, context, seed=i) for i in range(max(batches))]
    rows = []
    for b in batches:
        (times,) = _time_sides([lambda: ours.run(prompts[:b], new)[1]], args.warmup, args.repeats, args.quiet_below)
        experts = _experts_read(runner, prompts[:b], new) if cfg.moe is not None else None
        weight_bytes = step_weight_bytes(runner.model, experts)
        state_bytes = 2 * b * cfg.state_bytes_per_request(runner.dtype.itemsize)  # read, then written
        kv_bytes = b * (context + new // 2) * _kv_bytes_per_token(cfg, runner.kv.element_size())
        rows.append(FloorRow(shape, dtype, b, context, new, 1e3 * min(times) / (new - 1),
                             1e3 * statistics.median(times) / (new - 1),
                             1e3 * (weight_bytes + state_bytes) / bandwidth, weight_bytes, kv_bytes,
                             runner.use_graphs, cfg.num_layers, whole.num_layers, experts, state_bytes))
        r = rows[-1]
        read = "" if experts is None else (f", {experts / (cfg.num_layers - cfg.moe.first_dense_layers):.1f} of "
                                           f"{cfg.moe.num_experts} routed experts per layer")
        print(f"{shape} {dtype} batch {b:3}: step {r.step_ms:7.3f} ms   floor {r.floor_ms:7.3f} ms   "
              f"x{r.x_floor:.2f}   per layer {r.step_ms / r.layers:.3f} / {r.floor_ms / r.layers:.3f} ms   "
              f"({weight_bytes / 1e9:.2f} GB of weights{read}, {state_bytes / 1e9:.3f} GB state, "
              f"{kv_bytes / 1e9:.3f} GB KV)", flush=True)
    return rows


def _experts_read(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """Distinct routed experts a decode step of these prompts reads, summed over the MoE layers:
    counted over the decode steps of one more run of the timed work, eagerly (forward hooks do
    not run inside CUDA graphs)."""
    graphs, runner.use_graphs = runner.use_graphs, False
    try:
        engine = Engine(runner, ())
        reqs = [Request(uuid.uuid4().hex, p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                for p in prompts]
        with ChosenExperts(runner.model) as chosen:
            for _ in engine.run(reqs):
                chosen.active = all(r.output_ids for r in reqs)  # prefill done: the steps after decode
    finally:
        runner.use_graphs = graphs
    return chosen.per_step


def _kv_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    return cfg.kv_elems_per_token * element_size


# ---- the two sides ---------------------------------------------------------------------------

class _OursTimer:
    def __init__(self, runner: ModelRunner, eos: tuple[int, ...]):
        self.engine = Engine(runner, eos)

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """Returns (seconds to the first tokens, seconds from there to the end)."""
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        reqs = [Request(uuid.uuid4().hex, p, params) for p in prompts]
        t0 = time.perf_counter()
        t1 = None
        for _ in self.engine.run(reqs):
            if t1 is None and all(r.output_ids for r in reqs):
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        assert all(len(r.output_ids) == new_tokens for r in reqs)
        return t1 - t0, t2 - t1


class _HfTimer:
    def __init__(self, model, eos: tuple[int, ...], device: str):
        self.model, self.eos, self.device = model, list(eos), device

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        from transformers import LogitsProcessorList

        first: list[float] = []

        def stamp(input_ids, scores):  # called after each forward, before choosing the token
            if not first:
                if scores.is_cuda:  # the prefill kernels are only queued: wait, as our side does
                    torch.cuda.synchronize()
                first.append(time.perf_counter())
            return scores

        ids = torch.tensor(prompts, device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=self.eos, pad_token_id=self.eos[0],
                                  logits_processor=LogitsProcessorList([stamp]))
        t2 = time.perf_counter()
        assert out.shape[1] == ids.shape[1] + new_tokens
        return first[0] - t0, t2 - first[0]


def _random_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """transformers' Llama with the same random weights as ours."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                         rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.max_position,
                         tie_word_embeddings=cfg.tie_embeddings)
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        raise ValueError(f"random weights do not fit transformers' Llama: missing {missing}, unexpected {unexpected}")
    model.generation_config.do_sample = False
    return model.eval()


def _load_hf(src):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": src.gguf_file} if src.kind == "gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32, **kwargs)
    # Generation defaults from the checkpoint (sampling, repetition penalty...) must not apply.
    model.generation_config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if hasattr(model.generation_config, name):
            setattr(model.generation_config, name, None)
    return model.eval()


# ---- helpers ---------------------------------------------------------------------------------

def _token_stream(tok: Tokenizer, n: int) -> list[int]:
    ids = tok.encode(_TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def _time_sides(sides, warmup: int, repeats: int, quiet_below: float | None) -> list[list[float]]:
    """Seconds of each side's runs. The sides alternate, so a burst of load from elsewhere hits
    them alike."""
    for _ in range(warmup):
        for side in sides:
            side()
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(max(1, repeats)):
        _wait_quiet(quiet_below)
        for side, t in zip(sides, times):
            t.append(side())
    return times


def _wait_quiet(below: float | None, limit_s: float = 900) -> None:
    """On a shared machine, wait (up to limit_s) until others' CPU pressure drops below `below`%:
    with two cores, another busy process makes both sides' OpenMP regions stall for whole
    scheduler slices, and tok/s falls 10-30x."""
    deadline = time.monotonic() + limit_s
    while below is not None and time.monotonic() < deadline:
        p = _cpu_pressure("avg10")
        if p is None or p < below:
            return
        time.sleep(5)


def _cpu_pressure(window: str = "avg60") -> float | None:
    """% of time some task waited for a CPU (Linux PSI); high = others loaded the machine."""
    try:
        with open("/proc/pressure/cpu") as f:
            fields = dict(kv.split("=") for kv in f.readline().split()[1:])
        return float(fields[window])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def _fmt(r: Row) -> str:
    what = (f"{r.prompt_tokens}-token prompt" if r.metric == "prefill"
            else f"batch {r.batch}, {r.prompt_tokens}+{r.new_tokens} tokens")
    step = "" if r.ours_step_ms is None else f"   step {r.ours_step_ms:.3f} ms (floor {r.floor_ms:.3f})"
    return (f"{r.dtype:5} {r.metric:8} {what:28} ours {r.ours_tok_s:8.1f} tok/s   "
            f"transformers {r.hf_tok_s:8.1f} tok/s   x{r.ratio:.2f}{step}   (cpu pressure {r.cpu_pressure})")


def floor_table(rows: list[FloorRow]) -> str:
    return md_table(["shape", "dtype", "batch", "prompt + new tokens", "step ms", "floor ms", "step / floor", "CUDA graphs",
                     "layers", "step / floor ms per layer", "GB read: weights + state"],
                    [[r.shape, r.dtype, str(r.batch), f"{r.prompt_tokens} + {r.new_tokens}", f"{r.step_ms:.3f}",
                      f"{r.floor_ms:.3f}", f"{r.x_floor:.2f}x", "yes" if r.cuda_graphs else "no",
                      f"{r.layers} of {r.model_layers}", f"{r.step_ms / r.layers:.3f} / {r.floor_ms / r.layers:.3f}",
                      f"{r.weight_bytes / 1e9:.3f} + {r.state_bytes / 1e9:.3f}"] for r in rows])


def table(rows: list[Row]) -> str:
    return md_table(["dtype", "metric", "batch", "prompt + new tokens", "pdflash tok/s", "transformers tok/s", "ratio",
                     "ratio of medians"],
                    [[r.dtype, r.metric, str(r.batch), f"{r.prompt_tokens} + {r.new_tokens}", f"{r.ours_tok_s:.1f}",
                      f"{r.hf_tok_s:.1f}", f"{r.ratio:.2f}x", f"{r.ours_median_tok_s / r.hf_median_tok_s:.2f}x"]
                     for r in rows])
