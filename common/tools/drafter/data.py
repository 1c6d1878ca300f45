"""Self-distillation data for the drafter: the target answers prompts, we keep the token ids.

A data folder holds meta.json (what a sequence depends on) and shards, one JSONL file per
source and SHARD_PROMPTS prompts: `chat-0003.jsonl` holds the answers to chat prompts
3072..4095. A line is one finished sequence, written as soon as the target finishes it:

  {"i": 17, "k": 0, "t": 0.0, "prompt_len": 58, "finish": "stop", "ids": [prompt..., response...]}

or a prompt that cannot be asked ({"i": 17, "k": 0, "skipped": "why"}). i = prompt index in its
source, k = 0 for the greedy answer and 1.. for sampled ones, t = the sampling temperature.
Generation resumes: it reads the shards, keeps what is there (a torn last line from a killed
run is dropped) and generates only the missing (source, i, k). More prompts, samples or
sources extend the folder; settings that change what a sequence is must match meta.json.

Generation keeps the engine full (batched CUDA-graph decode on a GPU): requests are added in
batches as others finish, stage-1 sources (prompts the target writes) first, then the shards of
the other sources in turn, so that a run stopped by its time limit still holds a mix; within a
shard the greedy answers come before the sampled ones, so that most steps decode one kind.

Several processes may generate into one folder at once (`Part`): process k of n asks the
prompts i with i % n == k and appends only to its own shard files (`chat-0003.1of4.jsonl`), so
no file has two writers; every process reads every file.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from common.engine.decoder import BATCH_SIZES
from common.engine.engine import CHUNK_SIZE, Engine
from common.engine.request import Request
from common.engine.sampling import InvalidRequest
from common.model import gemv
from common.model.cache import write_json
from common.model.tokenizer import IncrementalDecoder, Tokenizer
from common.runner.model_runner import ModelRunner
from common.tools.drafter.sources import Prompt, Source

SHARD_PROMPTS = 1024
MIN_WRITTEN_CHARS = 16
NOTE_EVERY_S = 30.0  # a progress line this often when there is no progress bar


@dataclass(frozen=True)
class Part:
    """Which prompts a generating process asks, of the n processes sharing a data folder."""

    k: int = 0
    n: int = 1

    def owns(self, i: int) -> bool:
        return i % self.n == self.k

    @property
    def suffix(self) -> str:
        """What this process's shard file names carry ("" for a process alone)."""
        return "" if self.n == 1 else f".{self.k}of{self.n}"


@dataclass(frozen=True)
class GenSettings:
    """What a sequence depends on (checked against meta.json when a folder is reused)."""

    model: str
    prompts: str  # file name
    prompts_sha256: str  # content, so that a copy of the files on another machine still matches
    prompt_field: str
    shots: int  # few-shot examples per prompt (the fewshot source)
    gen_max_new_tokens: int
    sample_temperatures: list[float]
    sample_top_p: float
    seed: int


@dataclass
class Sequence:
    source: str
    i: int  # prompt index in its source
    k: int  # 0 = greedy answer, >0 = sampled answer
    prompt_len: int
    ids: np.ndarray  # int32 [prompt + response]
    finish: str = "stop"
    temperature: float = 0.0

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len:].tolist()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_prompts(path: str, field: str = "question", limit: int | None = None) -> list[dict]:
    """The objects of a JSONL prompt file (each must hold `field`), at most `limit`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} not found")
    rows: list[dict] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if field not in obj:
                raise ValueError(f"{path}:{n}: no field {field!r} (fields: {sorted(obj)})")
            rows.append(obj)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"no prompts in {path!r}")
    return rows


class DataStore:
    """The shards of one data folder: what is there, and appending what is made."""

    def __init__(self, folder: str, settings: GenSettings, part: Part = Part()):
        self.folder, self.settings, self.part = folder, settings, part
        os.makedirs(folder, exist_ok=True)
        meta_path = os.path.join(folder, "meta.json")
        want = json.loads(json.dumps(asdict(settings)))
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
            if diff:
                raise ValueError(f"data folder {folder!r} was generated with other settings "
                                 f"(folder vs now: {diff}); use another --data/--out or delete it")
        elif not write_json(meta_path, want):  # whole, in one rename: other processes may be reading it
            raise OSError(f"cannot write {meta_path!r}")
        self.records: dict[tuple[str, int, int], Sequence | str] = {}  # str: why it was skipped
        for path in _shards(folder):
            good, torn = _read_shard(path, self.records)
            # A torn last line is a killed run's, or another process's line being written: only
            # in a file this store appends to is it dropped, so that appends start on a line.
            if torn and _shard_name(path)[1] == part.suffix:
                with open(path, "w") as f:
                    f.writelines(good)
        self._files: dict[str, object] = {}

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self.records

    def sequences(self, sources: list[Source]) -> list[Sequence]:
        """The finished sequences of these sources' keys, in (source, i, k) order."""
        out = []
        for src in sources:
            for i, k in src.keys:
                rec = self.records.get((src.name, i, k))
                if isinstance(rec, Sequence):
                    out.append(rec)
        return out

    def written(self, source: str, i: int, tok: Tokenizer) -> str | None:
        """What stage-1 source `source` wrote for prompt i, if usable: finished (not cut off by
        the token limit) and not trivially short."""
        rec = self.records.get((source, i, 1))
        if not isinstance(rec, Sequence) or rec.finish != "stop":
            return None
        text = tok.decode([t for t in rec.response_ids if t not in tok.eos_token_ids]).strip()
        return text if len(text) >= MIN_WRITTEN_CHARS else None

    def add(self, seq: Sequence) -> None:
        self.records[(seq.source, seq.i, seq.k)] = seq
        self._write(seq.source, seq.i, {"i": seq.i, "k": seq.k, "t": seq.temperature, "prompt_len": seq.prompt_len,
                                        "finish": seq.finish, "ids": seq.ids.tolist()})

    def skip(self, source: str, i: int, k: int, why: str) -> None:
        self.records[(source, i, k)] = why
        self._write(source, i, {"i": i, "k": k, "skipped": why})

    def _write(self, source: str, i: int, obj: dict) -> None:
        name = f"{source}-{i // SHARD_PROMPTS:04d}{self.part.suffix}.jsonl"
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(os.path.join(self.folder, name), "a")
        f.write(json.dumps(obj) + "\n")

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


def _shards(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*-[0-9][0-9][0-9][0-9].jsonl")) +
                  glob.glob(os.path.join(folder, "*-[0-9][0-9][0-9][0-9].[0-9]*of[0-9]*.jsonl")))


def _shard_name(path: str) -> tuple[str, str]:
    """A shard's source and Part suffix: ("chat", ".1of4") for `chat-0003.1of4.jsonl`, ("chat", "")
    for `chat-0003.jsonl`."""
    stem, dot, suffix = os.path.basename(path).removesuffix(".jsonl").partition(".")
    return stem.rsplit("-", 1)[0], dot + suffix


def _read_shard(path: str, records: dict) -> tuple[list[str], bool]:
    """Add a shard's records; returns its whole lines and whether a torn last line followed them."""
    source = _shard_name(path)[0]
    good = []
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                return good, True
            good.append(line if line.endswith("\n") else line + "\n")
            key = (source, obj["i"], obj["k"])
            if "skipped" in obj:
                records[key] = obj["skipped"]
            else:
                records[key] = Sequence(source, obj["i"], obj["k"], obj["prompt_len"],
                                        np.asarray(obj["ids"], dtype=np.int32), obj["finish"], obj["t"])
    return good, False


def check_pool(folder: str, settings: GenSettings) -> None:
    """Another data folder (another --seed's data, say) to train on as well must hold the same
    model's answers to the same prompt file, so that prompt i of the file (and --eval-prompts'
    held-out prompts) means the same question in both."""
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"--pool {folder!r}: no meta.json there (not a data folder of dflash train)")
    with open(meta_path) as f:
        meta = json.load(f)
    for key in ("model", "prompts_sha256", "prompt_field"):
        if meta.get(key) != getattr(settings, key):
            raise ValueError(f"--pool {folder!r} holds other data: {key} {meta.get(key)!r}, "
                             f"this run's {getattr(settings, key)!r}")


def pooled_sequences(folder: str) -> list[Sequence]:
    """Every finished sequence of a data folder (check_pool first), read without writing to it:
    another run may still be generating there."""
    records: dict[tuple[str, int, int], Sequence | str] = {}
    for path in _shards(folder):
        _read_shard(path, records)
    return [rec for _, rec in sorted(records.items()) if isinstance(rec, Sequence)]


@dataclass(frozen=True)
class Job:
    source: Source
    i: int
    k: int


def pending(sources: list[Source], store: DataStore) -> list[Job]:
    """The missing (source, i, k) of the store's part, shard by shard across the sources (a mix
    at any point), within a shard the greedy answers before the sampled ones: the engine's batch
    then holds one kind most of the time, and a batch of greedy rows only decodes without the
    sampler's noise and top-p sort (about 3 ms of a full batch's 5 ms step on an H100)."""
    jobs = [Job(src, i, k) for src in sources for i, k in src.keys
            if store.part.owns(i) and (src.name, i, k) not in store]
    # stable: source order, then (i, k)
    return sorted(jobs, key=lambda job: (job.i // SHARD_PROMPTS, job.k > 0))


def generate(runner: ModelRunner, tok: Tokenizer, sources: list[Source], store: DataStore, *, max_running: int,
             chunk_size: int = CHUNK_SIZE, time_limit: float | None = None, since: float | None = None,
             progress: bool = True, first: Callable[[str, int], bool] = lambda name, i: False) -> dict:
    """Generate every missing sequence of `sources` into `store`: first the greedy answers to the
    prompts first(source, i) names (the held-out check's: a generation cut by its time limit must
    still leave it answers to read), then the sources that write prompts, then the rest.
    time_limit counts from now, engine building included, or from
    `since` (a time.time() of the command's start: the processes of --gen-workers stop together).
    Returns stats (tokens/s over the whole run, prefill included).

    No product's kernel is timed here (gemv.kept_only): the batch runs at up to max_running rows,
    where every product is cuBLAS's, and only its last steps have the few rows the Triton GEMV
    serves. On a fresh H100 the engine that timed them took about 100 s of a 300 s run to build
    (2026-12-06), far more than they save in it; choices kept on disk are still taken."""
    stats = {"reused": sum(store.part.owns(s.i) for s in store.sequences(sources)),
             "generated": 0, "skipped": 0, "gen_tokens": 0, "gen_seconds": 0.0, "stopped": "done"}
    start = time.perf_counter()
    late = 0.0 if since is None else time.time() - since
    sizes = tuple(sorted({*BATCH_SIZES, *(n for n in (128, 256, 512) if n <= max_running)}))
    with gemv.kept_only():
        engine = Engine(runner, tok.eos_token_ids, max_running=max_running, batch_sizes=sizes, chunk_size=chunk_size)
        deadline = None if time_limit is None else start + time_limit - late
        writers, answerers = [s for s in sources if s.writes], [s for s in sources if not s.writes]
        for stage, wanted in ((answerers, lambda job: job.k == 0 and first(job.source.name, job.i)),
                              (writers, None), (answerers, None)):
            todo = [job for job in pending(stage, store) if wanted is None or wanted(job)]
            if todo and not _run(engine, tok, stage, todo, store, stats, deadline, progress):
                stats["stopped"] = "time limit"
                break
    store.close()
    stats["gen_seconds"] = round(time.perf_counter() - start, 2)
    stats["gen_tok_per_s"] = round(stats["gen_tokens"] / max(stats["gen_seconds"], 1e-9), 1)
    return stats


def _run(engine: Engine, tok: Tokenizer, sources: list[Source], todo: list[Job], store: DataStore, stats: dict,
         deadline: float | None, progress: bool) -> bool:
    """Drive the engine over these jobs of `sources`; False if the deadline stopped it."""
    from tqdm import tqdm

    jobs = iter(todo)
    s = store.settings
    temps = tuple(s.sample_temperatures)
    in_flight: dict[str, Job] = {}
    asked: dict[tuple[str, int], Prompt | None] = {}  # this shard's prompts, each tokenized once
    shard = -1
    refill_below = max(1, engine.max_running * 3 // 4)  # prefill in batches, not one prompt per step
    exhausted, t0, tokens0 = False, time.perf_counter(), stats["gen_tokens"]
    last_note = t0
    with tqdm(total=len(todo), desc=f"generate {'+'.join(x.name for x in sources)}", unit="seq",
              disable=not progress, mininterval=2) as bar:
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return False
            if not exhausted and engine.num_requests < refill_below:
                while engine.num_requests < engine.max_running:
                    job = next(jobs, None)
                    if job is None:
                        exhausted = True
                        break
                    if job.i // SHARD_PROMPTS != shard:  # the last shard's prompts are asked no more
                        asked, shard = {}, job.i // SHARD_PROMPTS
                    key = (job.source.name, job.i)
                    if key not in asked:
                        asked[key] = job.source.prompt(job.i)
                    if not _add(engine, tok, job, asked[key], store, temps, s, in_flight, stats):
                        bar.update(1)
            if not engine.has_work:
                break
            finished = 0
            for out in engine.step():
                stats["gen_tokens"] += len(out.new_ids)
                if out.finished:
                    job, req = in_flight.pop(out.req.rid), out.req
                    store.add(Sequence(job.source.name, job.i, job.k, req.prompt_len,
                                       np.asarray(req.prompt_ids + req.output_ids, dtype=np.int32),
                                       req.finish_reason or "length", req.params.temperature))
                    finished += 1
            if finished:
                store.flush()
                stats["generated"] += finished
                bar.update(finished)
                # This stage's tokens over this stage's time (the totals span every stage).
                rate = f"{(stats['gen_tokens'] - tokens0) / (time.perf_counter() - t0):,.0f} tok/s"
                bar.set_postfix_str(rate, refresh=False)
                if not progress and time.perf_counter() - last_note > NOTE_EVERY_S:  # logs, not a terminal
                    last_note = time.perf_counter()
                    who = f" (part {store.part.k} of {store.part.n})" if store.part.n > 1 else ""
                    print(f"generate{who}: {stats['generated']} sequences, {stats['gen_tokens']:,} tokens; "
                          f"{'+'.join(x.name for x in sources)} at {rate}", flush=True)
    return True


def _add(engine: Engine, tok: Tokenizer, job: Job, prompt: Prompt | None, store: DataStore,
         temps: tuple[float, ...], s: GenSettings, in_flight: dict[str, Job], stats: dict) -> bool:
    """Queue one job; False if it cannot be asked (recorded as skipped, or left for later)."""
    src = job.source
    if prompt is None:
        if (f"{src.name}-q", job.i, 1) not in store:
            return False  # stage 1 did not get there (time limit): ask on a later run
        store.skip(src.name, job.i, job.k, "its written prompt is unusable")
        stats["skipped"] += 1
        return False
    params = src.params(job.i, job.k, s.gen_max_new_tokens, temps, s.sample_top_p, s.seed, prompt.stop)
    rid = f"{src.name}:{job.i}:{job.k}"
    req = Request(rid, prompt.ids, params, decoder=IncrementalDecoder(tok, params.stop) if params.stop else None)
    try:
        engine.add(req)
    except InvalidRequest as e:  # e.g. longer than the context window
        store.skip(src.name, job.i, job.k, str(e))
        stats["skipped"] += 1
        return False
    in_flight[rid] = job
    return True


def data_stats(seqs: list[Sequence]) -> dict:
    resp = np.array([s.response_len for s in seqs]) if seqs else np.zeros(1)
    by_source: dict[str, int] = {}
    for s in seqs:
        by_source[s.source] = by_source.get(s.source, 0) + s.response_len
    return {
        "sequences": len(seqs),
        "greedy_sequences": sum(not s.sampled for s in seqs),
        "prompt_tokens": int(sum(s.prompt_len for s in seqs)),
        "response_tokens": int(resp.sum()),
        "response_tokens_by_source": by_source,
        "mean_response_tokens": round(float(resp.mean()), 1),
        "finished_by_stop": round(sum(s.finish == "stop" for s in seqs) / max(len(seqs), 1), 3),
    }
