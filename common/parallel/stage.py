"""One rank's part of a forward pass of a tensor/pipeline-parallel model (common.runner.layout).

Every rank runs `stage_forward` for the same StepBatch: the first stage embeds the tokens,
the others receive the residual stream [T, hidden] from the same TP rank of the previous
stage; each stage runs its layers (TP ranks all-reduce inside them) and sends the stream on;
the last stage final-norms the logit rows. The decoder layer returns the whole residual stream
(no separate residual carried beside it), so what crosses a stage boundary is exactly the
hidden state a single process would capture there.

With a DFlash drafter, each stage also adds its capture layers' share of the drafter's `fc`
(Drafter.fc_part) to a running sum that travels with the stream; the captured states
themselves never leave their stage.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.dflash.drafter import Drafter
from common.model.transformer import Reduce, no_reduce
from common.runner.layout import RankLayout
from common.runner.model_runner import ModelRunner, StepBatch

# A peer that dies makes gloo fail at once (connection reset); this only bounds a peer that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def init_ranks(layout: RankLayout, init_method: str, backend: str, device: str) -> Reduce:
    """Join the process group of all ranks; returns the all-reduce over this rank's TP group."""
    if backend == "nccl":
        torch.cuda.set_device(device)  # NCCL builds its communicators on the current device
    dist.init_process_group(backend, init_method=init_method, rank=layout.rank, world_size=layout.world,
                            timeout=COLLECTIVE_TIMEOUT)
    if layout.tp == 1:
        return no_reduce
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    groups = [dist.new_group(list(range(s * layout.tp, (s + 1) * layout.tp))) for s in range(layout.pp)]
    group = groups[layout.stage]

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return all_reduce


@dataclass
class StageOutput:
    hidden: torch.Tensor | None  # last stage: final-normed logit rows; None elsewhere
    captured: dict[int, torch.Tensor]  # this stage's capture layers
    fc_sum: torch.Tensor | None  # last stage with a drafter: every stage's Drafter.fc_part, summed


@torch.inference_mode()
def stage_forward(runner: ModelRunner, batch: StepBatch, capture_layers: tuple[int, ...],
                  drafter: Drafter | None = None) -> StageOutput:
    layout = runner.layout
    meta = runner.attn_meta(batch)
    shape = (batch.num_tokens, runner.cfg.hidden_size)
    fuse = drafter is not None and bool(capture_layers)
    if layout.is_first_stage:
        h = runner.model.embed_tokens(runner.token_tensor(batch))
        fc_sum = torch.zeros(shape, dtype=torch.float32, device=runner.device) if fuse else None
    else:
        prev = layout.rank - layout.tp
        h = recv(shape, runner.dtype, runner.device, prev)
        fc_sum = recv(shape, torch.float32, runner.device, prev) if fuse else None
    h, captured = runner.model.run_layers(h, runner.cache, meta, capture_layers)
    if fuse and captured:
        fc_sum = fc_sum + drafter.fc_part(captured)
    if not layout.is_last_stage:
        dist.send(h.contiguous(), layout.rank + layout.tp)
        if fuse:
            dist.send(fc_sum, layout.rank + layout.tp)
        return StageOutput(None, captured, None)
    return StageOutput(runner.model.final_norm(h, meta), captured, fc_sum)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t
