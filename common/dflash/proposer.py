"""DFlashProposer: the drafter, its paged draft KV cache, and the two things decode needs:

  append_context(): committed tokens' captured target states -> fused context -> draft KV
  propose():        one draft block per request -> B-1 draft tokens each

The draft KV has its own page pool and page tables (its head count and layer count are the
drafter's), laid out like the target's: [layer, k/v, page, token, head, dim].
"""
from __future__ import annotations

import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.kv.buffers import PagedKVBuffer
from common.kv.page_pool import PagePool
from common.kv.seq_cache import SeqCache
from common.model.attention import build_attn_meta, cache_slot, paged_attention
from common.model.config import ModelConfig
from common.model.transformer import rope_cos_sin
from common.runner.model_runner import ModelRunner


class DraftPages:
    """The draft KV's page pool and what the engine asks of a proposer about pages; the tensor
    itself lives with DFlashProposer (or, under pipeline parallelism, on the last stage)."""

    def __init__(self, drafter_cfg: DrafterConfig, target_cfg: ModelConfig, num_pages: int, page_size: int,
                 block_size: int | None = None):
        self.block_size = block_size or drafter_cfg.block_size
        if self.block_size < 2:
            raise ValueError(f"a DFlash block needs at least 2 tokens, got {self.block_size}")
        self.capture_layers = tuple(drafter_cfg.capture_layers)
        if max(self.capture_layers) >= target_cfg.num_layers:
            raise ValueError(f"drafter captures target layers {self.capture_layers}, the target has "
                             f"{target_cfg.num_layers}")
        self.pool = PagePool(num_pages, page_size)

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.pool.alloc(need))

    def release(self, seq: SeqCache) -> None:
        self.pool.free(seq.pages)
        seq.pages, seq.length = [], 0

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
    def __init__(self, drafter: Drafter, target: ModelRunner, num_pages: int, block_size: int | None = None):
        super().__init__(drafter.cfg, target.cfg, num_pages, target.page_size, block_size)
        self.drafter = drafter
        self.target = target
        cfg = drafter.cfg
        page_size = target.page_size
        self.kv = torch.zeros(cfg.num_layers, 2, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=target.dtype, device=target.device)
        self.scratch_slot = num_pages * page_size
        self.rope_cos, self.rope_sin = rope_cos_sin(cfg.as_model_config, target.device)

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
        index = torch.cat(rows).to(self.target.device)
        ctx = self.drafter.fuse({layer: captured[layer][index] for layer in self.capture_layers})
        self.write_context(ctx, *self.claim_slots(seqs, [len(r) for r in rows]))

    def write_context(self, ctx: torch.Tensor, positions: list[int], slots: list[int]) -> None:
        """Draft K/V of fused context rows ctx [T, H] at these positions, into these slots."""
        pos_t = torch.tensor(positions, device=self.target.device)
        slot_t = torch.tensor(slots, device=self.target.device)
        cos, sin = self.rope_cos[pos_t].to(ctx.dtype), self.rope_sin[pos_t].to(ctx.dtype)
        for layer, (k, v) in enumerate(self.drafter.context_kv(ctx, cos, sin)):
            self.kv[layer, 0].view(-1, *k.shape[1:]).index_copy_(0, slot_t, k)
            self.kv[layer, 1].view(-1, *v.shape[1:]).index_copy_(0, slot_t, v)

    # ---- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[SeqCache], last_tokens: list[int]) -> list[list[int]]:
        """For each request: block [last token, MASK x (B-1)] at the positions right after its
        context; returns the B-1 draft tokens (greedy). The block's own K/V is written just past
        the context, where the next append_context overwrites it: pages for length + B must be
        reserved."""
        B = self.block_size
        cfg = self.drafter.cfg
        meta = build_attn_meta([s.length for s in seqs], [B] * len(seqs), [s.pages for s in seqs],
                               self.pool.page_size, self.scratch_slot, self.target.device, None,
                               causal=False, window=cfg.sliding_window)
        ids = torch.full((len(seqs), B), cfg.mask_token_id, dtype=torch.long, device=self.target.device)
        ids[:, 0] = torch.tensor(last_tokens, device=self.target.device)
        x = self.target.model.embed_tokens(ids.flatten())
        cos, sin = self.rope_cos[meta.positions].to(x.dtype), self.rope_sin[meta.positions].to(x.dtype)
        hidden = self.drafter.blocks(x, cos, sin, lambda i, q, k, v: paged_attention(q, k, v, self.kv[i], meta))
        logits = self.target.model.logits(hidden.view(len(seqs), B, -1)[:, 1:])
        return logits.argmax(-1).tolist()
