"""How a model is split over pipeline stages (layers), tensor-parallel ranks (heads) and, in MoE
layers, expert-parallel ranks (routed experts).

Expert parallelism follows SGLang's `--ep-size`: it does not add processes, it shards the
routed experts over the ranks of each TP group. EP must divide TP; the TP group then holds
EP groups of experts, each split by width over TP / EP ranks (SGLang's moe_tp_size), and TP rank
t holds expert group t // (TP / EP), width slice t % (TP / EP). Attention, the dense MLPs and
the shared experts split over TP as without EP.

Pure arithmetic shared by the runners (which weights and KV a process holds) and the transfer
plan (which bytes a P rank sends to which D rank).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.model.config import ModelConfig


class ParallelConfigError(ValueError):
    """The model cannot be split this way; raised at start-up with the reason."""


def layer_range(stage: int, pp: int, num_layers: int) -> range:
    """Contiguous layers of pipeline stage `stage`; the first num_layers % pp stages get one more."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside [0, {pp})")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> range:
    """KV heads held by TP rank `rank`. With more ranks than KV heads each head is replicated on
    tp // num_kv_heads consecutive ranks (rank r holds head r // (tp // num_kv_heads))."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def q_head_range(rank: int, tp: int, num_heads: int) -> range:
    per = num_heads // tp
    return range(rank * per, (rank + 1) * per)


def check_parallel(cfg: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Refuse splits that do not divide the model evenly, with the numbers that don't fit."""
    problems = []
    if tp < 1 or pp < 1 or ep < 1:
        problems.append(f"tp, pp and ep must be >= 1 (got tp {tp}, pp {pp}, ep {ep})")
    else:
        if cfg.num_heads % tp:
            problems.append(f"{cfg.num_heads} attention heads do not split over TP {tp}")
        if tp <= cfg.num_kv_heads and cfg.num_kv_heads % tp:
            problems.append(f"{cfg.num_kv_heads} KV heads do not split over TP {tp}")
        if tp > cfg.num_kv_heads and tp % cfg.num_kv_heads:
            problems.append(f"TP {tp} is not a multiple of the {cfg.num_kv_heads} KV heads (needed to replicate them)")
        if cfg.intermediate_size % tp:
            problems.append(f"MLP width {cfg.intermediate_size} does not split over TP {tp}")
        if ep > 1 and cfg.moe is None:
            problems.append(f"EP {ep} needs a model with routed experts")
        # As SGLang requires: the experts are sharded over the TP group's ranks (EP divides TP),
        # and every EP rank holds the same number of experts.
        if ep > 1 and tp % ep:
            problems.append(f"EP {ep} does not divide TP {tp} (experts are sharded over the TP group's ranks)")
        if cfg.moe is not None and not tp % ep:
            m, moe_tp = cfg.moe, tp // ep
            if m.num_experts % ep:
                problems.append(f"{m.num_experts} routed experts do not split over EP {ep}")
            if m.intermediate_size % moe_tp:
                problems.append(f"expert width {m.intermediate_size} does not split over TP {tp} / EP {ep}")
            if m.shared_intermediate_size % tp:
                problems.append(f"shared expert width {m.shared_intermediate_size} does not split over TP {tp}")
        if pp > cfg.num_layers:
            problems.append(f"PP {pp} exceeds the {cfg.num_layers} layers")
        if cfg.kda is not None and cfg.kda.num_heads % tp:
            problems.append(f"{cfg.kda.num_heads} KDA heads do not split over TP {tp}")
    if problems:
        raise ParallelConfigError(f"cannot run {cfg.name} with TP {tp} x PP {pp} (EP {ep}): " + "; ".join(problems))


@dataclass(frozen=True)
class RankLayout:
    """Where one process sits: TP rank `rank % tp` of pipeline stage `rank // tp`. Rank 0 is the
    driver (the service process); stage s's TP rank t sends its activations to stage s+1's
    TP rank t. `ep` shards the routed experts over each TP group (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    rank: int = 0
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def with_rank(self, rank: int) -> "RankLayout":
        return replace(self, rank=rank)

    def layers(self, cfg: ModelConfig) -> range:
        return layer_range(self.stage, self.pp, cfg.num_layers)

    def kv_layers(self, cfg: ModelConfig) -> range:
        """This stage's layers that keep paged KV (all but KDA layers), numbered among the
        model's KV layers: a stage's layers are consecutive, so are those of each kind."""
        return _among(cfg.kv_layers, self.layers(cfg))

    def kda_layers(self, cfg: ModelConfig) -> range:
        """This stage's KDA layers (each a state slot per request), numbered among the model's."""
        return _among(cfg.kda.layers if cfg.kda is not None else (), self.layers(cfg))

    def kv_heads(self, cfg: ModelConfig) -> range:
        return kv_head_range(self.tp_rank, self.tp, cfg.num_kv_heads)

    def q_heads(self, cfg: ModelConfig) -> range:
        return q_head_range(self.tp_rank, self.tp, cfg.num_heads)

    def kda_heads(self, cfg: ModelConfig) -> range:
        """This rank's KDA heads, and so its slice of every KDA state: [heads, D, D] and, of
        each of the q, k and v convolution windows, those heads' channels."""
        return q_head_range(self.tp_rank, self.tp, cfg.kda.num_heads)

    @property
    def moe_tp(self) -> int:
        """Ranks splitting each routed expert's width (SGLang's moe_tp_size)."""
        return self.tp // self.ep

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp

    def experts(self, cfg: ModelConfig) -> range:
        """The routed experts this rank holds (a share of each one's width)."""
        per = cfg.moe.num_experts // self.ep
        group = self.tp_rank // self.moe_tp
        return range(group * per, (group + 1) * per)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model this rank computes: its layers, its heads, its share of the MLP width, its
        routed experts and its share of their width (routing is replicated), its KDA heads."""
        moe = None
        if cfg.moe is not None:
            experts = self.experts(cfg)
            moe = replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // self.moe_tp,
                          shared_intermediate_size=cfg.moe.shared_intermediate_size // self.tp,
                          first_expert=experts.start, local_experts=len(experts))
        return replace(cfg, num_layers=len(self.layers(cfg)), num_heads=len(self.q_heads(cfg)),
                       num_kv_heads=len(self.kv_heads(cfg)), intermediate_size=cfg.intermediate_size // self.tp,
                       moe=moe, kda=cfg.kda and replace(cfg.kda, num_heads=len(self.kda_heads(cfg))))


def _among(kind: tuple[int, ...], layers: range) -> range:
    """Positions in `kind` (sorted layer numbers) of the layers in `layers`."""
    first = sum(layer < layers.start for layer in kind)
    return range(first, first + sum(layer in layers for layer in kind))
