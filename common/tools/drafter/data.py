"""Self-distillation data for the drafter: the target answers prompts, we keep the token ids.

One JSONL file. Line 1 is a header with the generation settings; every other line is one
sequence, written as soon as the target finishes it:

  {"meta": {"model": ..., "prompts": ..., "gen_max_new_tokens": 256, ...}}
  {"i": 17, "k": 0, "prompt_len": 58, "finish": "stop", "ids": [prompt ids..., response ids...]}

i = index of the prompt in the prompt file, k = 0 for the greedy answer and 1..K for sampled
ones. The file is resumable: a second run reads it, keeps the finished (i, k) pairs and only
generates the missing ones (a torn last line from a killed run is dropped). The settings that
change what a sequence is (model, prompts, template, token cap, sampling) must match the header;
more prompts or more samples per prompt just extend the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import InvalidRequest, SamplingParams
from common.model.tokenizer import Tokenizer
from common.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class GenSettings:
    """What a sequence in the file depends on (checked against the header on resume)."""

    model: str
    prompts: str  # file name
    prompts_sha256: str  # content, so that a copy of the files on another machine still matches
    prompt_field: str
    chat_template: bool
    gen_max_new_tokens: int
    sample_temperature: float
    sample_top_p: float
    seed: int


@dataclass
class Sequence:
    i: int  # prompt index
    k: int  # 0 = greedy answer, >0 = sampled answer
    prompt_len: int
    ids: np.ndarray  # int32 [prompt + response]
    finish: str = "stop"

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_prompts(path: str, field: str = "question", limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file (one object per line, the prompt in `field`)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} not found")
    prompts: list[str] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if field not in obj:
                raise ValueError(f"{path}:{n}: no field {field!r} (fields: {sorted(obj)})")
            prompts.append(str(obj[field]))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"no prompts in {path!r}")
    return prompts


def load_sequences(path: str) -> tuple[dict | None, list[Sequence]]:
    """(header meta, sequences) of a data file; drops a torn last line (rewriting the file)."""
    if not os.path.isfile(path):
        return None, []
    meta, seqs, good, torn = None, [], [], False
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                torn = True
                break
            good.append(line if line.endswith("\n") else line + "\n")
            if "meta" in obj:
                meta = obj["meta"]
            else:
                seqs.append(Sequence(obj["i"], obj["k"], obj["prompt_len"],
                                     np.asarray(obj["ids"], dtype=np.int32), obj.get("finish", "stop")))
    if torn:
        with open(path, "w") as f:
            f.writelines(good)
    return meta, seqs


def _check_header(path: str, meta: dict | None, settings: GenSettings) -> None:
    if meta is None:
        return
    want = asdict(settings)
    diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if diff:
        raise ValueError(f"data file {path!r} was generated with other settings "
                         f"(file vs now: {diff}); use another --data/--out or delete it")


def generate(runner: ModelRunner, tok: Tokenizer, prompts: list[str], path: str, settings: GenSettings,
             *, samples_per_prompt: int = 0, max_running: int = 256, progress: bool = True) -> dict:
    """Make sure `path` holds a greedy answer (k=0) and `samples_per_prompt` sampled answers
    for every prompt, generating only what is missing. Returns generation stats."""
    from tqdm import tqdm

    meta, done = load_sequences(path)
    _check_header(path, meta, settings)
    have = {(s.i, s.k) for s in done}
    todo = [(i, k) for i in range(len(prompts)) for k in range(samples_per_prompt + 1) if (i, k) not in have]
    stats = {"reused": len(have), "generated": 0, "skipped_prompts": 0, "gen_tokens": 0, "gen_seconds": 0.0}
    if not todo:
        return stats
    engine = Engine(runner, tok.eos_token_ids, max_running=max_running)
    encoded: dict[int, list[int]] = {}
    keys: dict[str, tuple[int, int]] = {}
    for i, k in todo:
        if i not in encoded:
            encoded[i] = (tok.apply_chat_template([{"role": "user", "content": prompts[i]}])
                          if settings.chat_template else tok.encode(prompts[i]))
        greedy = k == 0
        params = SamplingParams(
            temperature=0.0 if greedy else settings.sample_temperature,
            top_p=1.0 if greedy else settings.sample_top_p,
            max_new_tokens=settings.gen_max_new_tokens,
            # A seed per (prompt, sample): a resumed run regenerates the same answers.
            seed=None if greedy else (settings.seed * 1_000_003 + i * 1009 + k) % (2**31))
        rid = f"{i}:{k}"
        try:
            engine.add(Request(rid, encoded[i], params))
        except InvalidRequest:  # prompt too long for the context window
            stats["skipped_prompts"] += 1
            continue
        keys[rid] = (i, k)
    first_write = meta is None
    start = time.perf_counter()
    with open(path, "a") as f, tqdm(total=len(keys), desc="generate", unit="seq", disable=not progress) as bar:
        if first_write:
            f.write(json.dumps({"meta": asdict(settings)}) + "\n")
        for outputs in engine.run():
            wrote = 0
            for out in outputs:
                stats["gen_tokens"] += len(out.new_ids)
                if not out.finished:
                    continue
                req = out.req
                i, k = keys[req.rid]
                f.write(json.dumps({"i": i, "k": k, "prompt_len": req.prompt_len, "finish": req.finish_reason,
                                    "ids": req.prompt_ids + req.output_ids}) + "\n")
                wrote += 1
            if wrote:
                f.flush()
                bar.update(wrote)
                stats["generated"] += wrote
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"{stats['gen_tokens'] / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)
    stats["gen_seconds"] = round(time.perf_counter() - start, 2)
    return stats


def data_stats(seqs: list[Sequence]) -> dict:
    resp = np.array([s.response_len for s in seqs]) if seqs else np.zeros(1)
    return {
        "sequences": len(seqs),
        "prompts": len({s.i for s in seqs}),
        "greedy_sequences": sum(s.k == 0 for s in seqs),
        "prompt_tokens": int(sum(s.prompt_len for s in seqs)),
        "response_tokens": int(resp.sum()),
        "mean_response_tokens": round(float(resp.mean()), 1),
        "finished_by_stop": round(sum(s.finish == "stop" for s in seqs) / max(len(seqs), 1), 3),
    }
