"""`pdflash generate`: one prompt, in-process, no services."""
from __future__ import annotations

import argparse
import dataclasses
import json
import uuid

from common.engine.engine import Engine
from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.model.tokenizer import IncrementalDecoder, Tokenizer
from common.model.source import resolve_model
from common.service.loader import ModelOptions, add_model_args, load_model, load_proposer, spec_config
from common.service.spec_args import add_spec_args


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"text", "output_ids", "meta_info"}')
    add_model_args(p, kv_pages=0)
    add_spec_args(p)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed)
    if not args.prompt:
        raise ValueError("the prompt is empty")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    opts = ModelOptions.from_args(args)
    # One request: size the pool for it alone (a verify block past its end included) unless told
    # otherwise, from the prompt's tokens, so that a prompt too long for the model is refused
    # before any cache is allocated for it.
    probe = Tokenizer(resolve_model(args.model))
    ids = probe.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else probe.encode(args.prompt)
    pages = args.kv_pages or -(-(len(ids) + args.max_new_tokens + 64) // args.page_size) + 1
    runner, tok = load_model(dataclasses.replace(opts, kv_pages=pages))
    engine = Engine(runner, tok.eos_token_ids, proposer=load_proposer(args, runner), spec=spec_config(args))
    req = Request(uuid.uuid4().hex, ids, params, IncrementalDecoder(tok, params.stop))
    text = []
    for outputs in engine.run([req]):
        for out in outputs:
            text.append(out.text)
            if not args.json:
                print(out.text, end="", flush=True)
    if args.json:
        print(json.dumps({"text": "".join(text), "output_ids": req.output_ids, "meta_info": meta_info(req)}))
    else:
        print()
    return 0
