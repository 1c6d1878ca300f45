"""The drafter's optimizer loop pieces: one training step (Trainer), which sequences make each
step's batch (EpochOrder), checkpoints and the saved drafter. All deterministic in (seed, step),
so that a resumed run continues exactly where an uninterrupted one would be."""
from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict

import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.model.transformer import rope_cos_sin
from common.runner.model_runner import ModelRunner
from common.tools.drafter.data import Sequence
from common.tools.drafter.feature_cache import FeatureCache
from common.tools.drafter.objective import (IGNORE, SOFT_TOP_K, Batch, Targets, block_labels, block_loss,
                                            block_soft_labels, block_tokens, capture, draft_hidden, refine_prefix,
                                            sample_anchors)

MAX_DRAFTER_BYTES = 40_000_000  # the limit, in decimal MB
# Config fields that say how a drafter drafts, not what its weights are: a resumed or continued
# run may change them.
DRAFTING_ONLY = ("refine_passes", "refine_threshold")


def weight_config_diff(a: DrafterConfig, b: DrafterConfig) -> dict:
    """{field: (a's, b's)} over the config fields that describe the weights (not DRAFTING_ONLY)."""
    return {k: (v, getattr(b, k)) for k, v in asdict(a).items() if k not in DRAFTING_ONLY and getattr(b, k) != v}


class Trainer:
    """The drafter, its optimizer and one training step. The target stays frozen."""

    def __init__(self, runner: ModelRunner, drafter: Drafter, *, lr: float, total_steps: int, warmup: float = 0.04,
                 min_lr_ratio: float = 0.0, weight_decay: float = 0.01, gamma: float = 7.0, anchors: int = 32,
                 grad_clip: float = 1.0, amp: bool = False, seed: int = 0,
                 greedy_path: bool = False, soft_weight: float = 0.0, refine: float = 0.0, compile: bool = False,
                 cache: FeatureCache | None = None):
        self.runner, self.drafter = runner, drafter
        self.device = runner.device
        self.amp = amp
        wdtype = runner.dtype if amp else torch.float32  # without autocast, match the fp32 drafter
        self.embed = runner.model.embed_tokens.weight.detach().to(wdtype)
        self.lm_head = runner.model.lm_head_weight.detach().to(wdtype)
        self.rope = rope_cos_sin(drafter.cfg.as_model_config, self.device)
        self.lr, self.total_steps, self.min_lr_ratio = lr, total_steps, min_lr_ratio
        self.warmup_steps = int(warmup if warmup >= 1 else round(warmup * total_steps))
        self.first_total = total_steps  # as planned, before any re-plan
        self.replans: list[tuple[int, int]] = []  # (step, new total) of each re-plan, in order
        self.replanned: tuple[int, float] | None = None  # (step, progress through the cosine) of the last one
        self.gamma, self.anchors, self.grad_clip, self.seed = gamma, anchors, grad_clip, seed
        self.greedy_path, self.soft_weight = greedy_path, soft_weight
        self.refine = refine  # the share of blocks trained as a refine pass sees them
        if cache is not None and soft_weight:
            raise ValueError("a feature cache holds no soft labels: train with --soft-labels 0 or without the cache")
        self.cache = cache
        # torch.compile fuses the drafter's elementwise work (norms, RoPE, SiLU), forward and
        # backward, which in eager mode is about a third of a step's GPU time. Only
        # the batch's sequences and length vary (marked dynamic in loss()); every other size,
        # the weights' too, stays a constant, so that no guard relates a length to them.
        self.draft_hidden = torch.compile(draft_hidden) if compile else draft_hidden
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                                     fused=self.device.type == "cuda")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cos = 0.5 * (1 + math.cos(math.pi * self.progress(step)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cos)

    def progress(self, step: int) -> float:
        """How far the cosine after the warmup is at `step` (0-1); after a replan, the rest of it
        spread over the steps from there to the new total."""
        begin, done = (self.warmup_steps, 0.0) if self.replanned is None else self.replanned
        return min(1.0, done + (1 - done) * (step - begin) / max(1, self.total_steps - begin))

    def replan(self, step: int, total: int) -> None:
        """Go on to `total` steps from `step`, the learning rate going on from where it is: no
        jump, and it anneals as the new total ends (during the warmup, only the total changes)."""
        if step >= self.warmup_steps:
            self.replanned = (step, self.progress(step))
        self.total_steps = total
        self.replans.append((step, total))

    def forward(self, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.loss(batch, self.capture(batch), generator)

    def capture(self, batch: Batch) -> Targets:
        """Target features of a batch, its greedy next tokens where sampled answers need them, and
        its top next tokens where soft labels do; read back from the feature cache where it
        holds them."""
        def run(b: Batch) -> Targets:
            return capture(self.runner, b, self.drafter.cfg.capture_layers, argmax=bool(b.sampled.any()),
                           top_k=SOFT_TOP_K if self.soft_weight else 0)

        if self.cache is None or not batch.keys:
            return run(batch)
        return self.cache.targets(batch, run)

    def loss(self, batch: Batch, targets: Targets, generator: torch.Generator
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.drafter.cfg
        anchors, ok = sample_anchors(batch, self.anchors, generator)
        labels = block_labels(batch, anchors, ok, cfg.block_size, targets.next_token, self.greedy_path)
        soft = block_soft_labels(targets, anchors, cfg.block_size) if self.soft_weight else None
        given, scored = None, None
        if self.refine:
            start = refine_prefix(labels, self.refine, generator, block_tokens(batch, anchors, cfg.block_size))
            given, labels = labels.masked_fill(~start, IGNORE), labels.masked_fill(start, IGNORE)
            scored = ~start.any(-1)
        # Held-out evaluation (no autograd) runs eager: a few batches now and then, and without
        # autograd the inference kernels run, which the compiled training pass never meets.
        draft = self.draft_hidden if torch.is_grad_enabled() else draft_hidden
        if draft is not draft_hidden:
            for t in (batch.ids, *targets.feats.values()):
                torch._dynamo.maybe_mark_dynamic(t, (0, 1))
            for t in (anchors, given):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            hidden = draft(self.drafter, self.embed, targets.feats, batch, anchors, self.rope, given)
            return block_loss(hidden, labels, self.lm_head, self.gamma, soft, self.soft_weight, scored)

    def step(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        """One optimizer step; anchors depend only on (seed, step), so a resumed run repeats them."""
        self.drafter.train()
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        loss, metrics = self.forward(batch, torch.Generator().manual_seed(self.seed * 1_000_003 + step))
        loss.backward()
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return metrics

    def synchronize(self) -> None:
        """Wait for the device's queued work (timings); nothing to wait for on a CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        self.drafter.eval()
        sums = {"loss": 0.0, "acc1": 0.0, "accepted": 0.0, "blocks": 0.0}
        for n, batch in enumerate(batches):
            _, m = self.forward(batch, torch.Generator().manual_seed(n))  # fixed anchors
            w = float(m["blocks"])
            for key in ("loss", "acc1", "accepted"):
                sums[key] += float(m[key]) * w
            sums["blocks"] += w
        total = max(sums.pop("blocks"), 1.0)
        return rounded({k: v / total for k, v in sums.items()})


class EpochOrder:
    """Which sequences make step `step`'s batch: every sequence of `seqs`, plus from each group
    (sequences, k) of `drawn` k of them, chosen afresh each epoch; a seeded shuffle per epoch,
    then sorted by length within windows of 64 batches (less padding), the batches themselves
    shuffled. A pure function of (seed, step), so a resumed run sees the same batches."""

    def __init__(self, seqs: list[Sequence], batch_size: int, seed: int,
                 drawn: list[tuple[list[Sequence], int]] | None = None):
        self.seqs, self.batch_size, self.seed = list(seqs), batch_size, seed
        self._always = len(seqs)
        self._groups = []  # (first index in self.seqs, size, drawn per epoch)
        for group, k in drawn or []:
            self._groups.append((len(self.seqs), len(group), k))
            self.seqs += group
        self.steps_per_epoch = math.ceil((self._always + sum(k for _, _, k in self._groups)) / batch_size)
        if not self.steps_per_epoch:
            raise ValueError("no sequences to train on")
        self._epoch, self._batches = -1, []

    def batch(self, step: int) -> list[Sequence]:
        epoch, idx = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            members = list(range(self._always))
            for first, size, k in self._groups:
                members += [first + i for i in torch.randperm(size, generator=g)[:k].tolist()]
            perm = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
            window = self.batch_size * 64
            batches = []
            for w in range(0, len(perm), window):
                chunk = sorted(perm[w:w + window], key=lambda i: len(self.seqs[i].ids))
                batches += [chunk[b:b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
            order = torch.randperm(len(batches), generator=g).tolist()
            self._epoch, self._batches = epoch, [batches[i] for i in order]
        return [self.seqs[i] for i in self._batches[idx]]

    def per_epoch(self) -> list[tuple[Sequence, float]]:
        """Each distinct sequence, in the order of self.seqs, and how often an epoch meets it."""
        seqs: dict[int, Sequence] = {}
        times: dict[int, float] = {}
        shares = [(s, 1.0) for s in self.seqs[:self._always]]
        shares += [(s, k / size) for first, size, k in self._groups for s in self.seqs[first:first + size]]
        for s, share in shares:
            seqs.setdefault(id(s), s)
            times[id(s)] = times.get(id(s), 0.0) + share
        return [(s, times[key]) for key, s in seqs.items()]

    def response_tokens_through(self, step: int) -> int:
        """Response tokens in the batches of steps 0..step-1 (what a snapshot was trained on)."""
        return sum(self.seqs[i].response_len for s in range(step)
                   for i in self._batch_indices(s))

    def _batch_indices(self, step: int) -> list[int]:
        self.batch(step)
        return self._batches[step % self.steps_per_epoch]


def save_checkpoint(path: str, trainer: Trainer, step: int, seconds: float) -> None:
    state = {"step": step, "seconds": seconds, "total_steps": trainer.total_steps,
             "schedule": {"first_total": trainer.first_total, "warmup_steps": trainer.warmup_steps,
                          "replans": trainer.replans},
             "drafter_config": asdict(trainer.drafter.cfg), "model": trainer.drafter.state_dict(),
             "optim": trainer.opt.state_dict(), "refine": trainer.refine}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a kill mid-write leaves the previous checkpoint intact


def checkpoint_schedule(path: str) -> tuple[int, int, list[tuple[int, int]]]:
    """The checkpointed run's total steps now, as first planned, and its re-plans (step, total),
    without reading its tensors (memory-mapped)."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    schedule = state.get("schedule", {})  # checkpoints from before re-plans have none
    return (int(state["total_steps"]), int(schedule.get("first_total", state["total_steps"])),
            [tuple(r) for r in schedule.get("replans", [])])


def load_checkpoint(path: str, trainer: Trainer, cfg: DrafterConfig, total: int) -> tuple[int, float]:
    state = torch.load(path, map_location=trainer.device, weights_only=True)
    saved = DrafterConfig(**state["drafter_config"])  # fields added since it was saved: their defaults
    diff = weight_config_diff(saved, cfg)
    if diff:
        raise ValueError(f"{path} holds a drafter with another config (checkpoint vs now: {diff})")
    if state.get("refine", 0.0) != trainer.refine:
        raise ValueError(f"{path} was trained with --refine {state.get('refine', 0.0)}, this run asks {trainer.refine}")
    if state["total_steps"] != total:
        print(f"note: the checkpoint planned {state['total_steps']} steps, now {total}: the lr schedule changes",
              flush=True)
    if "schedule" in state:  # the warmup as it ran (a fraction of the first total), and the re-plans again
        schedule = state["schedule"]
        trainer.first_total, trainer.warmup_steps = schedule["first_total"], schedule["warmup_steps"]
        trainer.total_steps, trainer.replans, trainer.replanned = trainer.first_total, [], None
        for step_at, new_total in schedule["replans"]:
            trainer.replan(step_at, new_total)
        trainer.total_steps = total
    trainer.drafter.load_state_dict(state["model"])
    trainer.opt.load_state_dict(state["optim"])
    return int(state["step"]), float(state["seconds"])


def save_drafter(drafter: Drafter, folder: str, dtype: str) -> torch.dtype:
    """Drafter.save in fp32, or in bf16 when asked or when fp32 would exceed 40 MB."""
    fp32_bytes = sum(p.numel() for p in drafter.state_dict().values()) * 4
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if want is None:
        want = torch.float32 if fp32_bytes <= MAX_DRAFTER_BYTES else torch.bfloat16
    copy.deepcopy(drafter).to(device="cpu", dtype=want).save(folder)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    if size > MAX_DRAFTER_BYTES:
        print(f"warning: the drafter file is {size / 2**20:.1f} MiB, over the 40 MB limit", flush=True)
    return want


def rounded(d: dict) -> dict:
    if "accepted" in d:  # the weighted accept length a greedy verify would see on these blocks
        d = d | {"accept_len": 1 + d["accepted"]}
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}
