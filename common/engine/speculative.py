"""One DFlash speculative decode step for a batch: propose, verify, accept, commit.

For a request with n tokens in its target cache and last committed token t (not yet cached):

  1. propose   drafter: block [t, MASK x (B-1)] -> drafts d1..d(B-1)
  2. verify    target: one forward over [t, d1..d(B-1)] at positions n..n+B-1, capturing the
               drafter's layers; c_j = the target's own choice after t, d1..dj (argmax, or a
               sample keyed by (seed, output position) exactly as plain decoding draws it)
  3. accept    k = longest prefix with d_j == c_j; commit d1..dk and the bonus c_(k+1).
               Because each committed token is the target's own choice given the same prefix,
               the output equals plain decoding token for token (up to float rounding).
  4. commit    token by token through the usual stop checks (EOS, stop ids, max_new_tokens);
               a stop inside the block drops the rest.
  5. caches    target KV keeps positions n..n+k (t and the accepted drafts): truncate to n+k+1;
               the same k+1 rows of captured states extend the draft KV.
"""
from __future__ import annotations

import torch

from common.engine.proposer import Proposer
from common.engine.request import Request
from common.engine.sampling import sample
from common.runner.model_runner import ModelRunner


def speculative_step(runner: ModelRunner, proposer: Proposer, reqs: list[Request],
                     eos_token_ids: tuple[int, ...]) -> list[list[int]]:
    """Advance every request by 1..B tokens. Returns the tokens committed for each."""
    B = proposer.block_size
    last = [r.output_ids[-1] for r in reqs]
    drafts = proposer.propose([r.draft_cache for r in reqs], last)                      # 1
    blocks = [[t, *d] for t, d in zip(last, drafts)]
    out = runner.extend([r.cache for r in reqs], blocks, all_logits=True,                # 2
                        capture_layers=proposer.capture_layers)
    rows_params = [r.params for r in reqs for _ in range(B)]
    rows_steps = [len(r.output_ids) + j for r in reqs for j in range(B)]
    choices = sample(out.logits, rows_params, rows_steps)

    committed: list[list[int]] = []
    context_rows: list[torch.Tensor] = []
    for i, req in enumerate(reqs):
        c = choices[i * B:(i + 1) * B]
        k = 0                                                                            # 3
        while k < B - 1 and drafts[i][k] == c[k]:
            k += 1
        new = []
        for tok in [*drafts[i][:k], c[k]]:                                               # 4
            req.append_token(tok, eos_token_ids)
            new.append(tok)
            if req.finished:
                break
        req.spec.record(min(k, len(new)) if req.finished else k)
        committed.append(new)
        n = req.cache.length - B                                                         # 5
        runner.truncate(req.cache, n + k + 1)
        context_rows.append(torch.arange(i * B, i * B + k + 1))
    proposer.append_context([r.draft_cache for r in reqs], out.captured, context_rows)
    return committed
