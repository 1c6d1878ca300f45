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

from common.engine import Engine
from common.loader import add_model_args
from common.request import Request
from common.runner import DTYPES, ModelRunner
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from common.weights import load_weights, resolve_model

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

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.hf_tok_s


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
    p.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per number (best reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per number first")
    p.add_argument("--quiet-below", type=float, default=None, metavar="PCT",
                   help="shared machines: before each timed pair, wait until CPU pressure from other "
                        "processes (Linux PSI avg10) is below PCT%%")
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
    batches = _ints(args.batches, "--batches")
    contexts = _ints(args.decode_prompt_tokens, "--decode-prompt-tokens")
    # fp32 first: the transformers model is converted in place to each dtype in turn.
    dtypes = [args.dtype] if args.dtype else ["fp32", "bf16"]
    src = resolve_model(args.model)
    cfg, tensors = load_weights(src)
    tok = Tokenizer(src, cfg.eos_token_ids)
    longest = max(contexts + [args.prefill_tokens])
    if longest + args.new_tokens > cfg.max_position:
        raise ValueError(f"prompts of {longest} tokens + {args.new_tokens} new exceed the context ({cfg.max_position})")
    stream = _token_stream(tok, longest + max(batches) * 7)
    prefill_prompt = stream[: args.prefill_tokens]
    # Request i starts i*7 tokens into the text: different prompts of equal length (no HF padding).
    prompts = {n: [stream[7 * i:7 * i + n] for i in range(max(batches))] for n in contexts}
    hf_fp32 = _load_hf(src)

    cases = [("prefill", 1, len(prefill_prompt), 1)] + [
        ("decode", b, n, args.new_tokens) for n in contexts for b in batches]
    pressure_before = _cpu_pressure()
    rows: list[Row] = []
    for dtype in dtypes:
        need = max(b * (n + new) for _, b, n, new in cases)
        pages = args.kv_pages or -(-need // args.page_size) + max(batches)
        runner = ModelRunner(cfg, tensors, dtype=dtype, device=args.device, num_pages=pages,
                             page_size=args.page_size)
        hf = hf_fp32.to(device=args.device, dtype=DTYPES[dtype])
        ours = _OursTimer(runner, tok.eos_token_ids)
        theirs = _HfTimer(hf, tok.eos_token_ids, args.device)
        for metric, b, n, new in cases:
            batch = [prefill_prompt] if metric == "prefill" else prompts[n][:b]
            # prefill: time to the first token; decode: from the first token to the last
            part = 0 if metric == "prefill" else 1
            t_ours, t_hf = _time_pair(lambda: ours.run(batch, new)[part], lambda: theirs.run(batch, new)[part],
                                      args.warmup, args.repeats, args.quiet_below)
            work = n if metric == "prefill" else b * (new - 1)
            rows.append(Row(dtype, metric, b, n, new, work / min(t_ours), work / min(t_hf),
                            work / statistics.median(t_ours), work / statistics.median(t_hf),
                            _cpu_pressure("avg10")))
            print(_fmt(rows[-1]), flush=True)
        del runner, hf, ours, theirs

    print()
    print(table(rows))
    result = {
        "model": cfg.name, "device": args.device, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": _hf_version(), "machine": platform.processor() or platform.machine(),
        "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens,
        "decode_prompt_tokens": contexts, "batches": batches, "repeats": args.repeats, "warmup": args.warmup,
        "quiet_below": args.quiet_below,
        # share of time some task waited for a CPU (Linux PSI, avg over 60 s): load from elsewhere
        "cpu_pressure_some_avg60": {"before": pressure_before, "after": _cpu_pressure()},
        "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nsaved {args.out}")
    return 0


# ---- the two sides ---------------------------------------------------------------------------

class _OursTimer:
    def __init__(self, runner: ModelRunner, eos: tuple[int, ...]):
        self.engine = Engine(runner, eos)

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """Returns (seconds to the first tokens, seconds from there to the end)."""
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        reqs = [Request(uuid.uuid4().hex, p, params) for p in prompts]
        t0 = time.perf_counter()
        for r in reqs:
            self.engine.add(r)
        while any(not r.output_ids for r in reqs):
            self.engine.step()
        t1 = time.perf_counter()
        while self.engine.has_work:
            self.engine.step()
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


def _time_pair(ours, theirs, warmup: int, repeats: int, quiet_below: float | None) -> tuple[list[float], list[float]]:
    """Alternate the two sides, so a burst of load from elsewhere hits both alike."""
    for _ in range(warmup):
        ours(), theirs()
    t_ours, t_theirs = [], []
    for _ in range(max(1, repeats)):
        _wait_quiet(quiet_below)
        t_ours.append(ours())
        t_theirs.append(theirs())
    return t_ours, t_theirs


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
    return (f"{r.dtype:5} {r.metric:8} {what:28} ours {r.ours_tok_s:8.1f} tok/s   "
            f"transformers {r.hf_tok_s:8.1f} tok/s   x{r.ratio:.2f}   (cpu pressure {r.cpu_pressure})")


def table(rows: list[Row]) -> str:
    lines = ["| dtype | metric | batch | prompt + new tokens | pdflash tok/s | transformers tok/s | ratio | ratio of medians |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.metric} | {r.batch} | {r.prompt_tokens} + {r.new_tokens} | {r.ours_tok_s:.1f} | "
                     f"{r.hf_tok_s:.1f} | {r.ratio:.2f}x | {r.ours_median_tok_s / r.hf_median_tok_s:.2f}x |")
    return "\n".join(lines)
