"""What a model and one request of it hold in memory, by arithmetic on the config (no timing,
no device): weights, KV bytes per token, KDA state bytes per request, and a prompt's total."""
from __future__ import annotations

from dataclasses import dataclass

from common.model.architectures import build_on_meta
from common.model.config import ModelConfig
from common.model.moe import MoE
from common.model.transformer import no_reduce


@dataclass(frozen=True)
class RequestMemory:
    model: str
    dtype_bytes: int
    params: int  # every weight
    # What one token runs through: all but the routed experts it does not choose and (untied) the
    # input embedding, of which it reads one row (the count model cards give as "activated").
    active_params: int
    kv_bytes_per_token: int  # over all (MLA / attention) layers
    state_bytes_per_request: int  # KDA recurrent states (fp32) and convolution windows, all layers
    prompt_tokens: int

    @property
    def prompt_kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.prompt_tokens

    @property
    def prompt_bytes(self) -> int:
        """KV and state of one request once its prompt is in."""
        return self.prompt_kv_bytes + self.state_bytes_per_request

    def lines(self) -> list[str]:
        gb = lambda n: f"{n / 1e9:.2f} GB"
        mib = lambda n: f"{n / 2 ** 20:.2f} MiB"
        return [f"{self.model}: {self.params / 1e9:.3g}B parameters ({gb(self.params * self.dtype_bytes)} at "
                f"{self.dtype_bytes} bytes each), {self.active_params / 1e9:.3g}B active per token",
                f"  KV per token:      {self.kv_bytes_per_token} bytes",
                f"  state per request: {self.state_bytes_per_request} bytes ({mib(self.state_bytes_per_request)})",
                f"  a {self.prompt_tokens}-token prompt: KV {mib(self.prompt_kv_bytes)} + state "
                f"{mib(self.state_bytes_per_request)} = {mib(self.prompt_bytes)}"]


def request_memory(cfg: ModelConfig, dtype_bytes: int, prompt_tokens: int) -> RequestMemory:
    """`dtype_bytes`: of the weights, the KV and the convolution windows (recurrent states are
    fp32 whatever the dtype). Parameters are counted on a model built on the meta device."""
    model = build_on_meta(cfg, no_reduce)
    params = sum(p.numel() for p in model.parameters())
    unused = sum((m.gate_up[0].numel() + m.down[0].numel()) * (m.moe.num_experts - m.moe.experts_per_token)
                 for m in model.modules() if isinstance(m, MoE))
    if not cfg.tie_embeddings:
        unused += model.embed_tokens.weight.numel()
    return RequestMemory(cfg.name, dtype_bytes, params, params - unused, cfg.kv_elems_per_token * dtype_bytes,
                         cfg.state_bytes_per_request(dtype_bytes), prompt_tokens)
