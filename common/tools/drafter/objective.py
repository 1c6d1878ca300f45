"""The DFlash training objective for one batch of sequences, all anchors at once.

For every sequence s and anchor a (a random position in the response):
  block    = [token at a, MASK x (B-1)] at positions a .. a+B-1
  context  = fused target features of positions < a   (strictly before the anchor)
  attention: each block sees its context and itself (bidirectionally), never another block
  labels   : block position k (1..B-1) predicts the token at a+k; weight exp(-(k-1)/gamma);
             positions past the end of the sequence are ignored. With soft labels, part of
             each label's mass is the target's own next-token distribution there (its
             SOFT_TOP_K most likely tokens), not only its greedy token.
  refine   : (a share of the blocks) positions 1..j hold their labels instead of MASK, j drawn
             from 1..B-2, and only the positions after them are scored: what a refine pass
             sees when the drafts it is given are right (common.dflash.drafter).

Shapes: S sequences padded to L tokens, A anchors per sequence, B block size, N = S*A*B.
The target is frozen: its captured hidden states, embedding and LM head are constants here.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from common.dflash.drafter import Drafter
from common.kv.page_pool import OutOfPages
from common.kv.seq_cache import SeqCache
from common.runner.model_runner import ModelRunner
from common.tools.drafter.cross_entropy import token_cross_entropy

IGNORE = -100
SOFT_TOP_K = 16  # the target's most likely next tokens a soft label keeps per position
TOP_K_ROWS = 4096  # logit rows whose top tokens are found at once (a top-k over all of them takes GBs)
# Rows of logits per pass of the target's LM head: [rows, vocab] in fp32 is 1.5 GiB at 8,192 rows
# and 49,152 words.
LOGIT_ROWS = 8192
# A batch's padded length rounds up to a multiple of this. On CUDA the first step of each
# (sequences, length) shape costs extra (likely the attention kernel's plan per shape): a run's
# batches have hundreds of distinct longest sequences and a few dozen multiples of 32 (an estimate
# for the drafter README's one command: 355 and 27, for 1.1% more padded tokens).
PAD_MULTIPLE = 32
# Devices where capture runs the target as one dense causal pass (ModelRunner.forward_dense). On a
# CPU the cache path is as fast (4.9 s against 5.4 s dense for a test batch on 2 cores) and the
# tests exercise both.
DENSE_DEVICES = ("cuda",)


@dataclass
class Batch:
    ids: torch.Tensor  # [S, L] long, zero-padded to L = padded_length(longest) (on the training device)
    lengths: torch.Tensor  # [S] long
    prompt_lens: torch.Tensor  # [S] long
    sampled: torch.Tensor  # [S] bool: a sampled answer (labelled with the target's argmax)
    tokens: list[list[int]]  # unpadded ids, as the runner takes them
    keys: tuple[int, ...] = ()  # which sequence each row is, for a FeatureCache (empty: none)

    @property
    def size(self) -> int:
        return len(self.tokens)


def padded_length(longest: int) -> int:
    return -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE


def make_batch(seqs, device: torch.device | str = "cpu") -> Batch:
    """seqs: objects with .ids (int array), .prompt_len and .sampled (a sampled answer); each row
    is keyed by its object's identity (what a FeatureCache holds it by)."""
    lengths = [len(s.ids) for s in seqs]
    ids = np.zeros((len(seqs), padded_length(max(lengths))), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, : len(s.ids)] = s.ids
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return Batch(torch.from_numpy(ids).to(device), as_long(lengths), as_long([s.prompt_len for s in seqs]),
                 torch.tensor([s.sampled for s in seqs], device=device), [[int(t) for t in s.ids] for s in seqs],
                 tuple(id(s) for s in seqs))


def select_rows(batch: Batch, rows: list[int]) -> Batch:
    """The batch of these rows only, padded to their own longest."""
    at = torch.tensor(rows, device=batch.ids.device)
    length = padded_length(max(len(batch.tokens[r]) for r in rows))
    return Batch(batch.ids[at, :length], batch.lengths[at], batch.prompt_lens[at], batch.sampled[at],
                 [batch.tokens[r] for r in rows], tuple(batch.keys[r] for r in rows) if batch.keys else ())


def sample_anchors(batch: Batch, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors distinct anchors per sequence in [prompt_len, length-2] (an anchor
    needs at least one token after it). Returns anchors [S, A] and ok [S, A] (False = unused
    slot of a short response; its labels are all ignored)."""
    S, L = batch.ids.shape
    lengths, plens = batch.lengths.cpu(), batch.prompt_lens.cpu()
    t = torch.arange(L)[None, :]
    valid = (t >= plens[:, None]) & (t <= lengths[:, None] - 2)
    scores = torch.rand(S, L, generator=generator).masked_fill(~valid, -1.0)
    anchors = scores.topk(min(num_anchors, L), dim=1).indices.sort(dim=1).values
    ok = torch.gather(valid, 1, anchors)
    anchors = anchors.masked_fill(~ok, 0)
    dev = batch.ids.device
    return anchors.to(dev), ok.to(dev)


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int,
                         window: int | None = None) -> torch.Tensor:
    """Boolean mask [S, 1, A*B, ctx_len + A*B] (True = may attend) for queries = all blocks
    flattened, keys = [context positions 0..ctx_len-1, all blocks flattened]."""
    S, A = anchors.shape
    B = block_size
    a_q = anchors.repeat_interleave(B, dim=1)[:, :, None]  # [S, A*B, 1] anchor of each query
    t = torch.arange(ctx_len, device=anchors.device)[None, None, :]
    ctx = t < a_q
    if window is not None:
        ctx = ctx & (t >= a_q - window)
    blk_of = torch.arange(A * B, device=anchors.device) // B
    own = (blk_of[:, None] == blk_of[None, :]).expand(S, A * B, A * B)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


@dataclass
class Targets:
    """What the frozen target says about a batch, per position t of each sequence [S, L, ...]."""
    feats: dict[int, torch.Tensor]  # the residual stream after each capture layer [S, L, H]
    next_token: torch.Tensor | None = None  # its greedy choice for position t+1 [S, L]
    top_ids: torch.Tensor | None = None  # its SOFT_TOP_K most likely tokens for t+1 [S, L, K]
    top_probs: torch.Tensor | None = None  # their probabilities, renormalised over the K [S, L, K]


class Pass(NamedTuple):
    """Logits of one pass of the target: seq [R] and pos [R] say whose and where, logits [R, vocab] fp32."""
    seq: torch.Tensor
    pos: torch.Tensor
    logits: torch.Tensor


@torch.no_grad()
def capture(runner: ModelRunner, batch: Batch, layers: tuple[int, ...], argmax: bool = False,
            top_k: int = 0) -> Targets:
    """Run the frozen target over every sequence once: the residual stream after each capture
    layer, padded to [S, L, H] (ordinary tensors, usable under autograd), and if asked its
    greedy next token (sampled answers) and its top_k next tokens with their probabilities
    (every sequence) at the positions a label can read: prompt_len - 1 .. length - 1. Elsewhere
    they stay 0: no block starts in a prompt, and the LM head over every prompt token would cost
    more than the rest of the pass (a few-shot prompt is about 1,000 tokens, its answer 100).
    Where the runner can (plain attention, DENSE_DEVICES) one dense causal pass over the padded
    batch, else through the KV cache in groups that fit it. Past a sequence's end the features
    are the padding's own (dense) or 0 (cache): no block reads them."""
    S, L = batch.ids.shape
    dev = runner.device
    wanted = _logit_positions(batch, argmax, top_k)
    if runner.runs_dense and dev.type in DENSE_DEVICES:
        feats, passes = _dense_passes(runner, batch, layers, wanted)
    else:
        feats = {layer: torch.zeros(S, L, runner.cfg.hidden_size, dtype=runner.dtype, device=dev) for layer in layers}
        passes = _paged_passes(runner, batch, layers, wanted, feats)
    out_t = Targets(feats)
    if argmax:
        out_t.next_token = torch.zeros(S, L, dtype=torch.long, device=dev)
    if top_k:
        out_t.top_ids = torch.zeros(S, L, top_k, dtype=torch.long, device=dev)
        out_t.top_probs = torch.zeros(S, L, top_k, dtype=torch.float32, device=dev)
    for p in passes:
        if argmax:
            # Only sampled answers' labels read it; the greedy answers' own tokens are its choices.
            out_t.next_token[p.seq, p.pos] = p.logits.argmax(-1)
        for a in range(0, len(p.seq), TOP_K_ROWS) if top_k else ():  # in slices: fp32 top-k of all is GBs
            top = p.logits[a:a + TOP_K_ROWS].topk(top_k, dim=-1)
            at = p.seq[a:a + TOP_K_ROWS], p.pos[a:a + TOP_K_ROWS]
            out_t.top_ids[at] = top.indices
            out_t.top_probs[at] = top.values.softmax(-1)  # softmax over the K = renormalised
    return out_t


def _logit_positions(batch: Batch, argmax: bool, top_k: int) -> torch.Tensor:
    """[S, L] bool: where capture needs the target's logits (its docstring says why there)."""
    t = torch.arange(batch.ids.shape[1], device=batch.ids.device)[None, :]
    span = (t >= batch.prompt_lens[:, None] - 1) & (t < batch.lengths[:, None])
    if top_k:
        return span
    return span & batch.sampled[:, None] if argmax else torch.zeros_like(span)


def _dense_passes(runner: ModelRunner, batch: Batch, layers: tuple[int, ...], wanted: torch.Tensor
                  ) -> tuple[dict[int, torch.Tensor], Iterator[Pass]]:
    """One dense pass over the padded batch; the LM head in slices of LOGIT_ROWS rows."""
    seq, pos = wanted.nonzero(as_tuple=True)
    hidden, feats = runner.forward_dense(batch.ids, seq * batch.ids.shape[1] + pos, layers)
    slices = range(0, len(seq), LOGIT_ROWS)
    return feats, (Pass(seq[a:a + LOGIT_ROWS], pos[a:a + LOGIT_ROWS], runner.logits(hidden[a:a + LOGIT_ROWS]))
                   for a in slices)


def _paged_passes(runner: ModelRunner, batch: Batch, layers: tuple[int, ...], wanted: torch.Tensor,
                  feats: dict[int, torch.Tensor]) -> Iterator[Pass]:
    """Passes through the KV cache over groups of sequences that fit its pages and ask for at
    most LOGIT_ROWS rows of logits; fills feats as it goes."""
    dev = runner.device
    wanted_at = [w.nonzero()[:, 0].tolist() for w in wanted.cpu()]
    for rows in _groups_that_fit(runner, batch.tokens, [len(w) for w in wanted_at], LOGIT_ROWS):
        caches = [SeqCache() for _ in rows]
        starts = np.cumsum([0] + [len(batch.tokens[r]) for r in rows[:-1]]).tolist()
        logit_rows = [start + p for start, r in zip(starts, rows) for p in wanted_at[r]]
        try:
            for c, r in zip(caches, rows):
                runner.reserve(c, len(batch.tokens[r]))
            out = runner.extend(caches, [batch.tokens[r] for r in rows], capture_layers=layers, logit_rows=logit_rows)
        finally:
            for c in caches:
                runner.release(c)
        lens = torch.tensor([len(batch.tokens[r]) for r in rows], device=dev)
        row_of = torch.repeat_interleave(torch.tensor(rows, device=dev), lens)
        pos = torch.arange(len(row_of), device=dev) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        for layer in layers:
            # A copy into ordinary tensors: inference-mode tensors cannot enter autograd.
            feats[layer][row_of, pos] = out.captured[layer]
        if logit_rows:
            at_rows = torch.tensor(logit_rows, device=dev)
            yield Pass(row_of[at_rows], pos[at_rows], out.logits)


def _groups_that_fit(runner: ModelRunner, tokens: list[list[int]], logit_rows: list[int],
                     max_logit_rows: int) -> list[list[int]]:
    """Split the batch so that each group's KV fits in the runner's free pages and each group
    asks for at most max_logit_rows rows of logits (a sequence that asks more goes alone)."""
    free = runner.pool.num_free
    groups, cur, used, count = [], [], 0, 0
    for r, t in enumerate(tokens):
        need = runner.pool.pages_for(len(t))
        if need > free:
            raise OutOfPages(f"a sequence of {len(t)} tokens needs {need} KV pages; {free} are free")
        if cur and (used + need > free or count + logit_rows[r] > max_logit_rows):
            groups.append(cur)
            cur, used, count = [], 0, 0
        cur.append(r)
        used += need
        count += logit_rows[r]
    return groups + [cur] if cur else groups


def at_blocks(x: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [S, L] at every block position [S, A, B] (positions past L read its last column)."""
    pos = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).clamp(max=x.shape[1] - 1)
    return torch.gather(x, 1, pos.flatten(1)).view_as(pos)


def block_labels(batch: Batch, anchors: torch.Tensor, ok: torch.Tensor, block_size: int,
                 target_next: torch.Tensor | None = None, greedy_path: bool = False) -> torch.Tensor:
    """labels [S, A, B]: position k of the block of anchor a predicts the token at a+k (k >= 1);
    IGNORE at k = 0, past the sequence end and for unused anchors. Sampled answers are
    labelled with the target's own greedy choice at a+k given the sequence before it (what a
    T=0 verify would accept) instead of the sampled token. With greedy_path, a sampled answer's
    position k counts only while the sampled tokens a+1..a+k-1 are the target's greedy choices:
    after the first that is not, the label is the greedy choice after a prefix that greedy
    decoding never writes, and the drafter, which sees only MASKs there, cannot tell."""
    src = batch.ids
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [S, A, B]
    at = lambda x: at_blocks(x, anchors, block_size)
    keep = (pos < batch.lengths[:, None, None]) & ok[:, :, None]
    if target_next is not None and bool(batch.sampled.any()):
        # target_next[s, t] predicts position t+1; shift it so that src[s, t] labels position t.
        shifted = torch.cat([batch.ids[:, :1], target_next[:, :-1]], dim=1)
        src = torch.where(batch.sampled[:, None], shifted, batch.ids)
        if greedy_path:
            # on_path[s, a, j]: the token at a+j is the target's greedy choice (always, for greedy
            # answers); position k counts if j = 1..k-1 all are.
            on_path = at(batch.ids == shifted) | ~batch.sampled[:, None, None]
            keep[:, :, 2:] &= on_path[:, :, 1:-1].long().cumprod(-1).bool()
    labels = at(src)
    keep[:, :, 0] = False
    return labels.masked_fill(~keep, IGNORE)


def block_tokens(batch: Batch, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sequence's own tokens at every block position [S, A, B]."""
    return at_blocks(batch.ids, anchors, block_size)


def refine_prefix(labels: torch.Tensor, share: float, generator: torch.Generator, own: torch.Tensor) -> torch.Tensor:
    """given [S, A, B]: for about `share` of the blocks, positions 1..j (j uniform in 1..B-2) given
    to the drafter as their labels; no position of the other blocks. A start ends early where a
    label is missing or is not the sequence's own token `own` (a sampled answer labelled with the
    target's greedy choices, once it leaves them): every label after it follows the sequence's own
    tokens, so the start must be them too, as the drafts a refine pass is given are."""
    S, A, B = labels.shape
    j = torch.randint(1, B - 1, (S, A), generator=generator) * (torch.rand(S, A, generator=generator) < share)
    k = torch.arange(B)[None, None, :]
    given = ((k >= 1) & (k <= j[:, :, None])).to(labels.device)
    same = (labels == own) & (labels != IGNORE)
    same[:, :, 0] = True
    return given & same.long().cumprod(-1).bool()


def draft_hidden(drafter: Drafter, embed: torch.Tensor, feats: dict[int, torch.Tensor], batch: Batch,
                 anchors: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 given: torch.Tensor | None = None) -> torch.Tensor:
    """Final-normed drafter hidden states of every block position, [S, A, B, H]. given [S, A, B]:
    token ids at the block positions a refine pass is given them (IGNORE elsewhere: MASK)."""
    cfg = drafter.cfg
    S, L = batch.ids.shape
    A, B = anchors.shape[1], cfg.block_size
    cos, sin = rope
    ctx = drafter.fuse(feats).reshape(S * L, -1)
    ctx_kv = drafter.context_kv(ctx, cos[:L].repeat(S, 1), sin[:L].repeat(S, 1))
    first = torch.gather(batch.ids, 1, anchors)  # [S, A] the anchor tokens
    block_ids = torch.full((S, A, B), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    if given is not None:
        block_ids = torch.where(given != IGNORE, given, block_ids)
    block_ids[:, :, 0] = first
    pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).clamp(max=cos.shape[0] - 1).flatten()
    # GQA with the query heads of a KV head folded into its query rows (SDPA's memory-efficient
    # kernel takes a mask, not enable_gqa): Q [S, kv_heads, rep * A*B, d] against K/V as they
    # are, instead of K/V copied rep times; the mask repeats along the rows, once per step.
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rep = H // Hkv
    mask = block_attention_mask(anchors, L, B, cfg.sliding_window).repeat(1, 1, rep, 1)

    block_cos, block_sin = cos[pos], sin[pos]

    def attend(i: int, h: torch.Tensor) -> torch.Tensor:
        q, k, v = drafter.layers[i].self_attn.qkv(h, block_cos, block_sin)
        ck, cv = ctx_kv[i]
        keys = torch.cat([ck.view(S, L, Hkv, d), k.view(S, A * B, Hkv, d)], 1).transpose(1, 2)
        vals = torch.cat([cv.view(S, L, Hkv, d), v.view(S, A * B, Hkv, d)], 1).transpose(1, 2)
        qs = q.view(S, A * B, Hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(S, Hkv, rep * A * B, d)
        out = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask)
        return out.view(S, Hkv, rep, A * B, d).permute(0, 3, 1, 2, 4).reshape(S * A * B, H, d)

    x = F.embedding(block_ids.flatten(), embed)
    return drafter.blocks(x, attend).view(S, A, B, -1)


def block_soft_labels(targets: Targets, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top tokens and their probabilities for every block position [S, A, B, K]:
    position k of anchor a gets the target's distribution after the sequence up to a+k-1 (the
    prefix its hard label follows). Position 0 is never labelled."""
    L = targets.top_ids.shape[1]
    before = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1).clamp(0, L - 1)
    at = lambda x: torch.gather(x, 1, before.flatten(1)[:, :, None].expand(-1, -1, x.shape[-1]))
    shape = (*before.shape, targets.top_ids.shape[-1])
    return at(targets.top_ids).view(shape), at(targets.top_probs).view(shape)


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, gamma: float,
               soft: tuple[torch.Tensor, torch.Tensor] | None = None, soft_weight: float = 0.0,
               scored: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted cross-entropy over labelled block positions, through the target's LM head
    (token_cross_entropy: on a GPU, without an fp32 copy of the logits). With soft =
    block_soft_labels(...) and soft_weight w, a position's label is (1 - w) x its hard label +
    w x the target's renormalised top-K distribution there: the loss is then, up to a constant,
    a KL divergence from that mixture, and near-ties of the target stop being one-hot.
    Metrics (detached): acc1 = accuracy of the first draft position; accepted = mean length of
    the correct draft prefix per block (what a greedy verify would accept). An ignored position
    ends the prefix, so with greedy-path labels a sampled answer's blocks count only up to where
    the answer leaves the greedy path: not comparable with runs that label every position.
    scored [S, A]: the blocks the metrics count (default all; refine blocks, given a start, are not)."""
    S, A, B, H = hidden.shape
    lab = labels[:, :, 1:]
    valid = lab != IGNORE
    k = torch.arange(1, B, device=hidden.device, dtype=torch.float32)
    weight = torch.exp(-(k - 1) / gamma).expand(S, A, B - 1)[valid]
    logits = F.linear(hidden[:, :, 1:][valid], lm_head)
    ids = lab[valid][:, None]
    token_weights = torch.ones(ids.shape, device=hidden.device)
    if soft is not None and soft_weight:  # the hard label's weight 1 - w, then the top-K's w x p
        soft_ids, probs = (x[:, :, 1:][valid] for x in soft)
        ids = torch.cat([ids, soft_ids], 1)
        token_weights = torch.cat([(1 - soft_weight) * token_weights, soft_weight * probs], 1)
    ce, top = token_cross_entropy(logits, ids, token_weights)
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = top == lab[valid]
        used = valid[:, :, 0] if scored is None else valid[:, :, 0] & scored
        accepted = correct.long().cumprod(-1).sum(-1)[used].float()
        metrics = {"loss": loss.detach(),
                   "acc1": correct[:, :, 0][used].float().mean() if used.any() else loss.new_zeros(()),
                   "accepted": accepted.mean() if used.any() else loss.new_zeros(()),
                   "blocks": used.sum().float()}
    return loss, metrics
