"""DFlashProposer: the drafter, its paged draft KV cache, and what prefill and decode need:

  append_context()  prefill: a chunk's captured target states -> fused context -> draft KV
  keep()            decode: the captured states of a step's tokens, kept in the request's row
                    of pending features (one copy: a plain step pays nothing more)
  catch_up()        decode: the pending features -> fused context -> draft KV, for every row
                    at once, before a step drafts (or when a row's pending features are full)
  draft()           decode: one block [last token, MASK x (B-1)] per row -> B-1 draft tokens
                    (and the drafter's refine passes, if it was trained for them)
  draft_ahead()     decode: the same for the next step, at the end of a speculative one: a
                    whole block's drafts kept in the request's row (ahead()), and the drafter's
                    confidence in each, which the host reads with the committed tokens

keep(), catch_up(), draft(), draft_ahead() and ahead() take static tensors (fixed shapes, no
host reads), so they run inside the CUDA graph of a decode or speculative step. The draft KV has
its own page pool and page tables (its head and layer counts are the drafter's), laid out like
the target's: [layer, k/v, page, token, head, dim]. A request's draft KV may lag its target KV
by the tokens whose features are pending: draft_cache.length counts the tokens written, and its
state_slot is its row of pending features (0: none yet).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.dflash.drafter import Drafter, DrafterConfig
from common.kv.buffers import PagedKVBuffer
from common.kv.page_pool import PagePool
from common.kv.seq_cache import SeqCache
from common.model import fused, gemv
from common.model.attention import AttnMeta, cache_slot, paged_attention, table_slots
from common.model.config import ModelConfig
from common.model.static_attention import StaticAttn
from common.model.transformer import apply_rope, linear, rope_cos_sin
from common.runner.model_runner import ModelRunner


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host on the device, without the host waiting: a copy from pageable memory first waits
    for every kernel queued before it (a prefill's), leaving the host idle while they run. The
    pinned block goes back to torch's cache only once the copy has read it."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """The log-probability of each row's most likely token, in fp32."""
    logits = logits.float()
    return logits.amax(-1) - logits.logsumexp(-1)


class DraftPages:
    """The draft KV's page pool and what the engine asks of a proposer about pages; the tensor
    itself lives with DFlashProposer (or, under pipeline parallelism, on the last stage)."""

    def __init__(self, drafter_cfg: DrafterConfig, target_cfg: ModelConfig, num_pages: int, page_size: int):
        self.block_size = drafter_cfg.block_size
        if self.block_size < 2:
            raise ValueError(f"a DFlash block needs at least 2 tokens, got {self.block_size}")
        self.capture_layers = tuple(drafter_cfg.capture_layers)
        if max(self.capture_layers) >= target_cfg.num_layers:
            raise ValueError(f"drafter captures target layers {self.capture_layers}, the target has "
                             f"{target_cfg.num_layers}")
        self.pool = PagePool(num_pages, page_size)

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        self.pool.reserve(seq, num_tokens)

    def release(self, seq: SeqCache) -> None:
        self.pool.release(seq)

    def claim_slots(self, seqs: list[SeqCache], counts: list[int]) -> tuple[list[int], list[int]]:
        """Positions and cache slots of counts[i] tokens appended to seqs[i] (lengths advance)."""
        page_size = self.pool.page_size
        positions, slots = [], []
        for seq, n in zip(seqs, counts):
            for pos in range(seq.length, seq.length + n):
                positions.append(pos)
                slots.append(cache_slot(seq.pages, pos, page_size))
            seq.length += n
        return positions, slots


class DFlashProposer(DraftPages):
    def __init__(self, drafter: Drafter, target: ModelRunner, num_pages: int):
        super().__init__(drafter.cfg, target.cfg, num_pages, target.page_size)
        self.drafter = drafter
        self.target = target
        cfg = drafter.cfg
        page_size = target.page_size
        # The drafter's dtype may be narrower than the target's (common.dflash.drafter.draft_dtype):
        # its KV and the LM head it drafts through are kept in it; pending features stay the target's.
        self.dtype = drafter.dtype
        self.kv = target.memory.zeros((cfg.num_layers, 2, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim),
                                      self.dtype, target.device)  # beside the target's KV: shareable alike
        # In another dtype a copy, made by reserve_pending: only a decoder drafts (not a P instance).
        self.lm_head = target.model.lm_head_weight if self.dtype == target.dtype else None
        self.scratch_slot = num_pages * page_size
        self.rope_cos, self.rope_sin = rope_cos_sin(cfg.as_model_config, target.device)
        self.name = f"dflash {cfg}" + ("" if self.dtype == target.dtype else f" in {self.dtype}")
        # The context K/V of every draft layer in one matrix product (weights stacked once: the
        # drafter does not change while it serves); see write_context.
        attn = [layer.self_attn for layer in drafter.layers]
        self._context_kv_weight = torch.cat([a.kv_proj.weight for a in attn])  # [layers * 2 * kv, H]
        self._context_k_norm = torch.stack([a.k_norm.weight for a in attn])[None, :, None, :]  # [1, layers, 1, d]
        # Per layer, Q and K/V of a draft block in one product (draft(), on CUDA); stacked once too.
        self._block_qkv_weight = [torch.cat([a.q_proj.weight, a.kv_proj.weight]) for a in attn]
        # Pending features [slot, width, capture layers x H] (reserve_pending); slot 0 is scratch.
        features = len(self.capture_layers) * (cfg.target_hidden_size or cfg.hidden_size)
        self.pending = torch.zeros(1, 0, features, dtype=target.dtype, device=target.device)
        # Drafts of the next block, drafted ahead [slot, block_size - 1], rows as pending's.
        self.drafts_ahead = torch.zeros(1, self.block_size - 1, dtype=torch.long, device=target.device)
        self._free_slots: list[int] = []

    def describe_buffers(self) -> list[PagedKVBuffer]:
        cfg = self.drafter.cfg
        return [PagedKVBuffer(
            name="draft_kv", base_addr=self.kv.data_ptr(), num_layers=cfg.num_layers,
            num_pages=self.kv.shape[2], page_size=self.pool.page_size, num_heads=cfg.num_kv_heads,
            head_start=0, total_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            dtype=str(self.kv.dtype).removeprefix("torch."))]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of these pages of the draft KV, [layer, k/v, page, token, head, dim] (CPU)."""
        return self.kv[:, :, pages].cpu()

    # ---- context ---------------------------------------------------------------------------
    @torch.inference_mode()
    def append_context(self, seqs: list[SeqCache], captured: dict[int, torch.Tensor], rows: list[torch.Tensor]) -> None:
        """Append draft KV for committed tokens. captured: layer -> [T, H] from a target
        forward; rows[i]: which of those T rows are seqs[i]'s newly committed tokens, in order."""
        positions, slots = self.claim_slots(seqs, [len(r) for r in rows])
        host = torch.stack([torch.cat(rows), *(torch.tensor(x, dtype=torch.long) for x in (positions, slots))])
        index, positions, slots = to_device(host, self.target.device)
        with gemv.kept_only():  # a prefill step's rows come in any number: time none of them now
            ctx = self.drafter.fuse({layer: captured[layer][index] for layer in self.capture_layers})
            self.write_context(ctx, positions, slots)

    def write_context(self, ctx: torch.Tensor, positions: list[int] | torch.Tensor,
                      slots: list[int] | torch.Tensor) -> None:
        """Draft K/V of fused context rows ctx [T, H] at these positions, into these slots: what
        Drafter.context_kv computes layer by layer, for all layers at once (every speculative
        step pays for it, so it is kept to a handful of kernels)."""
        cfg = self.drafter.cfg
        L, heads, d, T = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ctx.shape[0]
        device = self.target.device
        cos, sin = self._rope(torch.as_tensor(positions, device=device), ctx.dtype)
        kv = linear(ctx, self._context_kv_weight).view(T, L, 2, heads, d)
        k = self._context_k_norm * F.rms_norm(kv[:, :, 0].float(), (d,), eps=cfg.rms_eps).to(ctx.dtype)
        k = apply_rope(k.reshape(T, L * heads, d), cos, sin).view(T, L, heads, d)
        new = torch.stack([k, kv[:, :, 1]]).permute(2, 0, 1, 3, 4)  # [layer, k/v, T, head, dim]
        self.kv.view(L, 2, -1, heads, d).index_copy_(2, torch.as_tensor(slots, device=device), new)

    # ---- pending features (decode) ---------------------------------------------------------
    @property
    def pending_width(self) -> int:
        return self.pending.shape[1]

    def reserve_pending(self, width: int, slots: int) -> None:
        """Room for `width` pending tokens per request and `slots` requests; a buffer as large
        already stays as it is (one engine at a time decodes with a proposer). A decoder calls it
        first, so the LM head in the drafter's dtype is made here too."""
        if self.lm_head is None:
            self.lm_head = self.target.model.lm_head_weight.to(self.dtype)
        rows = self.pending.shape[0] - 1
        if width > self.pending_width or slots > rows:
            self._resize(max(slots, rows), max(width, self.pending_width))

    def hold_slots(self, seqs: list[SeqCache]) -> bool:
        """A pending row for each seq without one. True when that took a larger buffer: steps
        captured over the old one must be captured again."""
        new = [s for s in seqs if not s.state_slot]
        grew = len(new) > len(self._free_slots)
        if grew:
            self._resize(2 * (self.pending.shape[0] - 1 + len(new)), self.pending_width)
        for s in new:
            s.state_slot = self._free_slots.pop()
        return grew

    def _resize(self, slots: int, width: int) -> None:
        """A buffer of `slots` rows (and the scratch row) of `width` tokens, holding what the old one held."""
        old = self.pending
        self.pending = old.new_zeros(slots + 1, width, old.shape[2])
        self.pending[:old.shape[0], :old.shape[1]] = old
        drafts = self.drafts_ahead
        self.drafts_ahead = drafts.new_zeros(slots + 1, drafts.shape[1])
        self.drafts_ahead[:drafts.shape[0]] = drafts
        self._free_slots[:0] = range(slots, old.shape[0] - 1, -1)  # popped from the end: lowest first

    def release(self, seq: SeqCache) -> None:
        super().release(seq)
        if seq.state_slot:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = 0

    def keep(self, captured: dict[int, torch.Tensor], slot: torch.Tensor, offset: torch.Tensor | None) -> None:
        """Static: the captured target states of a step's T tokens per row (rows*T, row by row)
        become pending features offset[i] .. offset[i]+T-1 of row slot[i] (None: 0 ..)."""
        feats = torch.cat([captured[layer] for layer in self.capture_layers], -1)
        rows = slot.shape[0]
        T = feats.shape[0] // rows
        if offset is None:
            cols = torch.arange(T, device=slot.device)[None, :]
        elif T == 1:  # a plain step's token: no more kernels than the copy
            cols = offset[:, None]
        else:
            cols = offset[:, None] + torch.arange(T, device=slot.device)[None, :]
        self.pending[slot[:, None], cols] = feats.view(rows, T, -1)

    def catch_up(self, slot: torch.Tensor, start: torch.Tensor, pages: torch.Tensor, width: int) -> None:
        """Static: the draft KV of the first `width` pending tokens of each row, at positions
        start[i] .. (its draft length on). Rows with fewer write past their committed length,
        where nothing reads before a later step overwrites it (the block's K/V of draft())."""
        positions = start[:, None] + torch.arange(width, device=start.device)[None, :]
        ctx = self.drafter.fuse_features(self.pending[slot, :width].flatten(0, 1))
        self.write_context(ctx, positions.flatten(), table_slots(pages, positions, self.pool.page_size).flatten())

    # ---- static steps (decode) ------------------------------------------------------------
    def draft(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, B: int) -> torch.Tensor:
        """Greedy drafts [rows, B-1] after each row's last committed token. Row i's block sits at
        positions length[i] .. length[i]+B-1 (its K/V written there, past the context, where a
        later catch-up writes the committed tokens' context); pages [rows, W] is its draft page table."""
        return self._draft(last, length, pages, B)[0]

    def draft_ahead(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, slot: torch.Tensor
                    ) -> torch.Tensor:
        """Static: draft() of a whole block, kept in row slot[i] for ahead(); returns the
        drafter's log-probability of each draft [rows, block_size - 1] (fp32; of its first pass,
        where it refines)."""
        tokens, logits = self._draft(last, length, pages, self.block_size)
        self.drafts_ahead[slot] = tokens
        # In fp32: at logits of 16-32, bf16's spacing (0.125) is wider than the policy's top
        # bands of log-probability (0.95-0.98-0.99). Single requests draft ahead: a small copy.
        return confidence(logits)

    def ahead(self, slot: torch.Tensor, B: int) -> torch.Tensor:
        """Static: the first B-1 drafts that draft_ahead() kept in row slot[i] [rows, B-1]."""
        return self.drafts_ahead[slot, :B - 1]

    def _draft(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, B: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """draft()'s drafts and the logits of its first pass."""
        cfg = self.drafter.cfg
        if self.lm_head is None:
            raise RuntimeError("DFlashProposer.draft before reserve_pending: no LM head in the drafter's dtype yet")
        rows = last.shape[0]
        positions = length[:, None] + torch.arange(B, device=last.device)[None, :]
        ids = torch.full((rows, B), cfg.mask_token_id, dtype=torch.long, device=last.device)
        ids[:, 0] = last
        kv_start = None if cfg.sliding_window is None else (length - cfg.sliding_window).clamp(min=0)
        attn = StaticAttn(pages, length + B, B, causal=False, kv_start=kv_start, backend=self.target.static_backend)
        meta = AttnMeta(positions=positions.flatten(), write_slots=table_slots(pages, positions, self.pool.page_size).flatten(),
                        logit_rows=None, static=attn)
        x = self.target.model.embed_tokens(ids.flatten()).to(self.dtype)
        cos, sin = self._rope(positions.flatten(), x.dtype)

        def attend(i: int, h: torch.Tensor) -> torch.Tensor:
            a = self.drafter.layers[i].self_attn
            if fused.rope_fusable(h, cfg.head_dim):  # Q, K and V in one product; norms, RoPE and the K/V write in one kernel
                qkv = linear(h, self._block_qkv_weight[i])
                q = fused.rope_write_kv(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, self.kv[i], meta.write_slots,
                                        (a.q_norm.weight, a.k_norm.weight, cfg.rms_eps))
                return attn.attend(q, self.kv[i])
            return paged_attention(*a.qkv(h, cos, sin), self.kv[i], meta)

        def drafts(x: torch.Tensor) -> torch.Tensor:  # logits of block positions 1..B-1 [rows, B-1, V]
            hidden = self.drafter.blocks(x, attend).view(rows, B, -1)[:, 1:]
            return linear(hidden.reshape(rows * (B - 1), -1), self.lm_head).view(rows, B - 1, -1)

        first = logits = drafts(x)
        tokens = fused.argmax(logits.flatten(0, 1)).view(rows, B - 1)
        if not cfg.refine_passes:
            return tokens, first
        least = math.log(cfg.refine_threshold)
        sure = confidence(logits) >= least
        for n in range(cfg.refine_passes):
            given = sure.long().cumprod(-1).bool()  # each row's confident leading drafts
            block = torch.where(given, tokens, ids[:, 1:])
            x = self.target.model.embed_tokens(torch.cat([ids[:, :1], block], 1).flatten()).to(self.dtype)
            logits = drafts(x)
            tokens = torch.where(given, tokens, fused.argmax(logits.flatten(0, 1)).view(rows, B - 1))
            if n + 1 < cfg.refine_passes:  # after the last pass nothing reads it
                sure = given | (confidence(logits) >= least)
        return tokens, first

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions past the table belong to tokens past a request's budget, never committed.
        positions = positions.clamp(max=self.rope_cos.shape[0] - 1)
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)
