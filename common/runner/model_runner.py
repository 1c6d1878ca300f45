"""ModelRunner: owns the model weights and the paged KV cache, and runs one forward at a time.

This is the interface the services drive (an SGLang-backed runner can implement the same):
  extend()           prefill a chunk (or any tokens) for a batch of requests, shapes as they come
                     (on a GPU one short fresh prompt replays a CUDA graph: prefill_graphs.py)
  forward_static()   T new tokens for each of a batch's rows through fixed shapes: decode (T = 1)
                     and speculative verify (T = B) steps, which CUDA graphs capture and replay
  forward_dense()    a padded batch of whole sequences in one causal pass without the cache (the
                     frozen target of drafter training; plain attention only: runs_dense)
  reserve()/release() grow or free a request's pages (and its state slot, models with KDA layers);
                     truncate() cut its cache back to a length
  commit_block()     after a verify step, keep each row's accepted prefix in its state slot
                     (KDA layers, whose recurrent state cannot be cut back; reserve_blocks() first)
  describe_buffers() where the KV lives and how it is laid out (for transfers)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv.buffers import PagedKVBuffer, SlotStateBuffer
from common.kv.page_pool import PagePool
from common.kv.seq_cache import SeqCache
from common.kv.shared import BufferMemory
from common.kv.state_pool import StatePool
from common.model.attention import AttnMeta, build_attn_meta
from common.model import cpu_packed, gemv, kda
from common.model.config import ModelConfig
from common.model.kimi_linear import HybridCache
from common.model.shapes import RandomWeights, fill_random_
from common.model.static_attention import StaticAttn, default_backend
from common.model.architectures import build_on_meta, to_empty
from common.model.transformer import Reduce, Transformer, no_reduce
from common.runner.describe import KDA_STATE_PARTS, CacheAddrs, describe_rank
from common.runner.layout import RankLayout
from common.runner.prefill_graphs import PrefillGraphs
from common.runner.shard import shard_tensors

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StepBatch:
    """One forward pass's batch as every rank needs it (pickled to the other ranks): request i
    has starts[i] cached tokens and adds counts[i] new ones; token_ids are all new tokens."""

    starts: list[int]
    counts: list[int]
    page_tables: list[list[int]]
    token_ids: list[int]
    logit_rows: list[int] | None  # rows whose final hidden state is wanted (None = all, [] = none)
    state_slots: list[int] | None = None  # each request's state slot (models with KDA layers)
    state_block: bool = False  # a verify block: KDA layers leave the slots alone (AttnMeta.state_block)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        return self.num_tokens if self.logit_rows is None else len(self.logit_rows)


@dataclass
class ExtendOutput:
    logits: torch.Tensor  # [rows, vocab] fp32, rows as asked (last token or all new tokens)
    captured: dict[int, torch.Tensor]  # layer -> [T, hidden] residual stream of every new token


class ModelRunner:
    """`cfg` is the whole model; with tensor/pipeline parallelism (`layout`) this process holds
    only its layers and heads of the weights and of the KV cache, and `reduce` all-reduces
    within its TP group (common.parallel.driver drives the ranks). `tensors` are Hugging
    Face-named weights, or RandomWeights to draw on the device instead (benchmarks of shapes)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor] | RandomWeights, *, dtype: str = "fp32",
                 device: str = "cpu", num_pages: int = 512, page_size: int = 64,
                 enforce_eager: bool = False, state_slots: int = 64, shared_kv: bool = False,
                 layout: RankLayout = RankLayout(), reduce: Reduce = no_reduce):
        self.cfg = cfg
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        if self.device.type == "cpu":
            cpu_packed.budget()  # a bad PDFLASH_CPU_PACKED_MB fails here, at start, not in a step
        local = layout.local_config(cfg)
        model = build_on_meta(local, reduce, first_layer=layout.layers(cfg).start)
        if isinstance(tensors, RandomWeights):  # drawn in place, already in the step's dtype
            self.model = fill_random_(to_empty(model, self.device, self.dtype), tensors).eval()
        else:
            model = to_empty(model, self.device)
            model.load_hf_weights(shard_tensors(tensors, cfg, layout))
            self.model = model.to(self.dtype).eval()
        self.model.init_rope(self.device)  # fp32 tables whatever the weights' dtype
        self.pool = PagePool(num_pages, page_size)
        # Every buffer a transfer reads or writes (the KV, a drafter's KV, state) comes from here;
        # `shared_kv`: in memory a process on this host can open (common/kv/shared.py).
        self.memory = BufferMemory(shareable=shared_kv)
        # One tensor for the whole cache ([layer, k/v, page, token, head, dim]) so that it is a
        # single region to register with the transfer engine. The extra last page is scratch:
        # padded attention reads land there and no request owns it. MLA has one plane and one
        # head (the latent and rope key), the same on every TP rank.
        self.kv = self.memory.zeros((len(layout.kv_layers(cfg)), cfg.kv_planes, num_pages + 1, page_size,
                                     local.num_kv_heads, cfg.cache_head_dim), self.dtype, self.device)
        # KDA layers (Kimi-Linear) keep no pages but a state slot per request, with a budget of
        # its own (`state_slots` requests at a time): row 0 of each tensor is scratch.
        self.state_pool: StatePool | None = None
        self.cache: torch.Tensor | HybridCache = self.kv
        if local.kda is not None:  # this rank's heads of each state
            k, n = local.kda, len(layout.kda_layers(cfg))
            self.state_pool = StatePool(state_slots)
            self.cache = HybridCache(
                self.kv,
                self.memory.zeros((n, state_slots + 1, k.num_heads, k.head_dim, k.head_dim), torch.float32, self.device),
                self.memory.zeros((n, state_slots + 1, 3 * k.proj_size, k.conv_size - 1), self.dtype, self.device))
        self.scratch_slot = num_pages * page_size
        # Static steps (decode, verify) replay CUDA graphs on a GPU unless told otherwise; a rank of
        # a parallel model cannot (its collectives and the other ranks' commands are not captured).
        self.use_graphs = self.device.type == "cuda" and not enforce_eager and layout.world == 1
        self.static_backend = default_backend(self.device)
        # A fresh prompt's prefill replays a graph too (prefill_graphs.py), except through KDA layers.
        self.prefill_graphs = self.padded_prefill(graphs=True) if self.use_graphs and self.state_pool is None else None
        # Page tables of static steps: enough pages for the longest context the pool or model allows.
        self.max_pages = -(-min(cfg.max_position, num_pages * page_size) // page_size)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    # ---- page management -------------------------------------------------------------------
    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Make sure seq has pages for `num_tokens` tokens, and a state slot if the model has KDA
        layers (raises OutOfPages or its OutOfStateSlots, allocating nothing). The slot is not
        cleared here: the request's first chunk reads it as zeros (AttnMeta.state_fresh), on
        every rank."""
        new_slot = self.state_pool is not None and not seq.state_slot
        if new_slot:
            seq.state_slot = self.state_pool.alloc()
        try:
            self.pool.reserve(seq, num_tokens)
        except Exception:
            if new_slot:
                self.state_pool.free(seq.state_slot)
                seq.state_slot = 0
            raise

    def release(self, seq: SeqCache) -> None:
        """Return seq's pages and state slot; it holds nothing after."""
        if seq.state_slot:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = 0
        self.pool.release(seq)

    def truncate(self, seq: SeqCache, length: int) -> None:
        """Forget tokens at positions >= length (their K/V is overwritten later). Pages are
        kept: the caller reserved them for the request's whole budget. A recurrent state cannot
        forget tokens, so models with KDA layers refuse to cut back."""
        if length > seq.length:
            raise ValueError(f"cannot truncate a cache of {seq.length} tokens to {length}")
        if self.state_pool is not None and length < seq.length:
            raise ValueError("a KDA layer's recurrent state cannot be cut back to an earlier length")
        seq.length = length

    def room_indices(self, seq: SeqCache) -> dict[str, list[int]]:
        """Buffer name -> what of it seq holds (describe_buffers' names): its pages, and its
        state slot in each KDA state buffer."""
        indices = {"kv": list(seq.pages)}
        if self.state_pool is not None:
            indices |= {name: [seq.state_slot] for name in KDA_STATE_PARTS}
        return indices

    def reserve_blocks(self, rows: int, block: int) -> None:
        """Scratch for verify steps of up to `rows` rows of `block` tokens, which a speculative
        decoder asks for before its first step: KDA layers keep a block's inputs there until
        commit_block (rows x block, not per request). Models without them need none."""
        c = self.cache
        if self.state_pool is None or (c.block is not None and c.block.fits(rows, block)):
            return
        layers, _, heads, dim, _ = c.recurrent.shape
        channels, taps = c.conv.shape[2:]
        c.block = kda.BlockInputs(
            torch.zeros(layers, rows, channels, taps + block, dtype=c.conv.dtype, device=self.device),
            torch.zeros(layers, rows, block, heads, 3 * dim + 1, device=self.device))

    def commit_block(self, state_slots: torch.Tensor, count: torch.Tensor, block: int) -> None:
        """After a verify step (forward_static of `block` tokens per row): row i's state slot
        advances by the first count[i] of them, the tokens the step commits. Static, like
        forward_static. A paged KV needs nothing: the K/V of the rest lies past the new length."""
        if self.state_pool is None:
            return
        c = self.cache
        for i in range(c.recurrent.shape[0]):
            kda.commit_block(c.recurrent[i], c.conv[i], c.block.layer(i), state_slots, count, block)

    def padded_prefill(self, graphs: bool) -> PrefillGraphs:
        """Prefill of a fresh prompt at a padded length over this runner's model and cache: what
        extend() uses on a GPU (graphs), and what checks and tests run eagerly (no graphs)."""
        return PrefillGraphs(self.model, self.cache, self.page_size, self.scratch_slot, self.cfg.max_position,
                             self.device, graphs)

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, seqs: list[SeqCache], tokens: list[list[int]], *, all_logits: bool = False,
               capture_layers: tuple[int, ...] = (), logits_of: list[int] | None = None,
               logit_rows: list[int] | None = None) -> ExtendOutput:
        """Append tokens[i] to seqs[i] (pages must be reserved) and run the model over them.
        Returns logits of each request's last new token (only requests `logits_of`, if given),
        of every new token if all_logits, or of the new tokens at `logit_rows` (indices into all
        requests' new tokens, in order) if given."""
        counts = [len(t) for t in tokens]
        self._check_room(seqs, counts)
        graphs = self.prefill_graphs
        if graphs is not None and not all_logits and logit_rows is None and graphs.fits([s.length for s in seqs], counts):
            hidden, captured = graphs.run(seqs[0].pages, tokens[0], capture_layers)
            seqs[0].length += counts[0]
            return ExtendOutput(self.model.logits(hidden[:0] if logits_of == [] else hidden), captured)
        ends = torch.tensor(counts).cumsum(0) - 1
        rows = (None if all_logits else logit_rows if logit_rows is not None
                else ends.tolist() if logits_of is None else ends[logits_of].tolist())
        batch = StepBatch([s.length for s in seqs], counts, [list(s.pages) for s in seqs],
                          [t for ts in tokens for t in ts], rows,
                          [s.state_slot for s in seqs] if self.state_pool is not None else None)
        with gemv.kept_only():  # this step's shapes were not met by a warm-up: time none of them now
            hidden, captured = self.forward(batch, capture_layers)
            logits = self.model.logits(hidden)
        for s, n in zip(seqs, counts):
            s.length += n
        return ExtendOutput(logits, captured)

    def forward(self, batch: StepBatch, capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Final-normed hidden states of the batch's logit rows, and the captured layers."""
        return self.model(self.token_tensor(batch), self.cache, self.attn_meta(batch), capture_layers)

    @property
    def runs_dense(self) -> bool:
        """Whether forward_dense can run: the whole model in this process, and a plain decoder
        (MLA keeps a latent and KDA a recurrent state, which only the cache path has; a model class
        added later runs dense only once it says here that it can)."""
        return type(self.model) is Transformer and self.layout.world == 1

    @torch.no_grad()
    def forward_dense(self, ids: torch.Tensor, hidden_rows: torch.Tensor, capture_layers: tuple[int, ...]
                      ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The model over sequences ids [S, L], each from position 0 and padded at its end, in
        one causal pass without the KV cache (training's frozen target: nothing is kept). Returns
        the final-normed hidden states of the flattened rows `hidden_rows` and each capture layer's
        residual stream [S, L, hidden]. Under no_grad, not inference mode: the outputs enter the
        drafter's autograd graph as constants, without a copy."""
        if not self.runs_dense:
            raise RuntimeError("forward_dense needs a whole model of plain attention layers (runs_dense)")
        S, L = ids.shape
        if L > self.cfg.max_position:
            raise ValueError(f"sequences of {L} tokens exceed the model context ({self.cfg.max_position})")
        positions = torch.arange(L, device=self.device).repeat(S)
        meta = AttnMeta(positions, positions[:0], hidden_rows, dense_rows=S)
        with gemv.kept_only():
            hidden, captured = self.model(ids.flatten(), self.cache, meta, capture_layers)
        return hidden, {layer: h.view(S, L, -1) for layer, h in captured.items()}

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states (any number of rows: no product is timed)."""
        with gemv.kept_only():
            return self.model.logits(hidden)

    def attn_meta(self, batch: StepBatch) -> AttnMeta:
        meta = build_attn_meta(batch.starts, batch.counts, batch.page_tables, self.page_size,
                               self.scratch_slot, self.device, batch.logit_rows)
        if batch.state_slots is not None:
            if 0 in batch.state_slots:
                raise RuntimeError("a request runs through KDA layers without a state slot (reserve it first)")
            meta.state_slots = torch.tensor(batch.state_slots, dtype=torch.long, device=self.device)
            meta.state_counts = batch.counts
            meta.state_fresh = torch.tensor([s == 0 for s in batch.starts], device=self.device)
            meta.state_block = batch.state_block
        return meta

    def token_tensor(self, batch: StepBatch) -> torch.Tensor:
        return torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)

    def forward_static(self, token_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                       attn: StaticAttn, capture_layers: tuple[int, ...] = (),
                       state_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """attn.tokens_per_row new tokens of each row (flattened, row by row), their positions
        (for RoPE), cache slots and (KDA layers) each row's state slot: final-normed hidden
        states of every token, and the captured layers. Nothing here reads the host: CUDA graphs
        capture it as it is."""
        self.check_static(attn, state_slots)
        meta = AttnMeta(positions=positions, write_slots=write_slots, logit_rows=None, static=attn,
                        state_slots=state_slots, state_block=self.state_pool is not None and attn.tokens_per_row > 1)
        return self.model(token_ids, self.cache, meta, capture_layers)

    def check_static(self, attn: StaticAttn, state_slots: torch.Tensor | None) -> None:
        if self.state_pool is None:
            return
        if state_slots is None:
            raise RuntimeError("a static step of a model with KDA layers needs each row's state slot")
        block, rows, T = self.cache.block, state_slots.shape[0], attn.tokens_per_row
        if T > 1 and (block is None or not block.fits(rows, T)):
            # A verify block must not advance the recurrent state past tokens it may reject.
            raise RuntimeError(f"a verify block of {rows} x {T} tokens through KDA "
                               "layers needs scratch for them (reserve_blocks)")

    @property
    def scratch_page(self) -> int:
        return self.scratch_slot // self.page_size

    def _check_room(self, seqs: list[SeqCache], counts: list[int]) -> None:
        for s, n in zip(seqs, counts):
            if s.length + n > len(s.pages) * self.page_size:
                raise RuntimeError(f"request needs {s.length + n} tokens of cache, has pages for "
                                   f"{len(s.pages) * self.page_size}")
            if s.length + n > self.cfg.max_position:
                raise ValueError(f"sequence of {s.length + n} tokens exceeds the model context "
                                 f"({self.cfg.max_position})")

    def close(self) -> None:
        """Nothing to stop in one process (ParallelRunner stops its worker ranks)."""

    # ---- transfer description --------------------------------------------------------------
    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of these pages of the KV, [layer, k/v (or latent), page, token, head, dim] (CPU)."""
        return self.kv[:, :, pages].cpu()

    def describe_buffers(self) -> list[PagedKVBuffer | SlotStateBuffer]:
        """This process's KV and KDA state slots, as common.runner.describe lays them out."""
        addrs = CacheAddrs(self.kv.data_ptr())
        if isinstance(self.cache, HybridCache):
            addrs = CacheAddrs(self.kv.data_ptr(), self.cache.recurrent.data_ptr(), self.cache.conv.data_ptr())
        return describe_rank(self.cfg, self.layout, addrs, num_pages=self.kv.shape[2], page_size=self.page_size,
                             state_slots=self.state_pool.num_slots if self.state_pool else 0,
                             dtype=str(self.dtype).removeprefix("torch."))
