"""gpu-check part `flashinfer`: flashinfer's kernels against ours for the small steps of a decode
layer, in one run, to keep whichever is faster (issue 19).

At the embedded and the Llama-3-8B shapes, bf16, batch 1, 8 and 32, a context of 256 tokens
(attention also 2048), pages of 16 tokens:
  add_rmsnorm  residual add + RMSNorm: fused.add_rms_norm / flashinfer.norm.fused_add_rmsnorm
  silu_mul     SiLU(gate) x up: fused.silu_mul / flashinfer.activation.silu_and_mul
  rope_kv      RoPE from the cos/sin tables and the new token's K and V written into its page:
               fused.rope_write_kv (one kernel) / flashinfer.rope.apply_rope_with_cos_sin_cache_inplace
               then flashinfer.page.append_paged_kv_cache
  attention    paged decode attention: static_attention_triton (split + merge) /
               flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper (use_cuda_graph, plan() outside
               the graph, run() inside)
Each pair is checked (max |ours - flashinfer| against the largest |ours|: bf16 within two
roundings) and timed in microseconds per op, many ops replayed in one CUDA graph as the gemv part
does; attention reads the KV of enough layers to stream past the L2 cache, as a step does.

Our KV cache [2, pages, page_size, Hkv, d] is flashinfer's NHD layout as a (K, V) tuple of views:
both sides read and write the same tensors; only the page table is described differently
(flashinfer takes indptr / indices / last_page_len, `csr_pages`).

flashinfer is optional (`pip install '.[flashinfer]'`) and imported here only: without it the
part prints one line and returns. It compiles each kernel with nvcc on first use.
"""
from __future__ import annotations

import traceback
from types import ModuleType

import torch

from common.model import fused
from common.model.config import ModelConfig
from common.model.cuda_timing import cycled_us_per_op
from common.model.shapes import SHAPES
from common.model.static_attention import static_attention_triton
from common.model.transformer import rope_cos_sin

SHAPE_NAMES = ("embedded", "llama3-8b")
BATCHES = (1, 8, 32)
CONTEXT = 256
ATTENTION_CONTEXTS = (256, 2048)
PAGE_SIZE = 16
DTYPE = torch.bfloat16
TOLERANCE = 2.0 ** -6  # two bf16 roundings, relative to the largest output
INPUT_SETS = 4  # element-wise ops cycle through these many inputs
STREAM_BYTES = 256 << 20  # KV read per attention timing: several times the H200's 60 MB L2
MAX_KV_COPIES = 1024
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended decode workspace


def csr_pages(page_table: torch.Tensor, kv_len: torch.Tensor, page_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's description of our page table [rows, max_pages] (padded after each row's
    pages) and kv_len [rows]: (indptr [rows + 1], indices [pages used], last_page_len [rows]),
    int32, on page_table's device. Row r owns its first ceil(kv_len[r] / page_size) pages;
    a row with no keys owns none and its last page holds 0."""
    pages = (kv_len.long() + page_size - 1) // page_size
    if bool((pages > page_table.shape[1]).any()):
        raise ValueError("kv_len needs more pages than the page table has")
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=page_table.device)
    indptr[1:] = pages.cumsum(0)
    owned = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < pages[:, None]
    indices = page_table[owned].to(torch.int32)  # row-major: row 0's pages, then row 1's
    last = torch.where(pages > 0, kv_len.long() - (pages - 1) * page_size, 0).to(torch.int32)
    return indptr, indices, last


def _import() -> ModuleType | str:
    """flashinfer with the submodules used, or why not."""
    try:
        import flashinfer
        import flashinfer.activation
        import flashinfer.decode
        import flashinfer.norm
        import flashinfer.page
        import flashinfer.rope
    except Exception as e:  # not installed, or installed without what its import needs
        return f"{type(e).__name__}: {e}"
    return flashinfer


def flashinfer_check() -> dict:
    fi = _import()
    if isinstance(fi, str):
        print(f"flashinfer: not importable ({fi}); install the extra: pip install '.[flashinfer]'")
        return {"available": False, "reason": fi}
    rows = []
    with torch.inference_mode():
        for name in SHAPE_NAMES:
            for bs in BATCHES:
                cases = [("add_rmsnorm", None), ("silu_mul", None), ("rope_kv", CONTEXT)]
                cases += [("attention", ctx) for ctx in ATTENTION_CONTEXTS]
                rows += [_case(fi, name, op, bs, ctx) for op, ctx in cases]
    return {"available": True, "version": fi.__version__, "rows": rows}


def _case(fi: ModuleType, shape: str, op: str, bs: int, context: int | None) -> dict:
    """One comparison; a failure (a kernel flashinfer cannot build, say) becomes its row's error
    and the other cases go on."""
    cfg = SHAPES[shape]
    try:
        if op == "attention":
            return _attention(fi, shape, cfg, bs, context)
        return {"add_rmsnorm": _add_rmsnorm, "silu_mul": _silu_mul, "rope_kv": _rope_kv}[op](fi, shape, cfg, bs)
    except Exception as e:
        traceback.print_exc()
        return {"shape": shape, "op": op, "batch": bs, "context": context, "error": f"{type(e).__name__}: {e}"}


def _row(shape: str, op: str, bs: int, context: int | None, ours: torch.Tensor, theirs: torch.Tensor,
         ours_us: float, fi_us: float) -> dict:
    diff = (ours.float() - theirs.float()).abs().max().item()
    rel = diff / max(ours.float().abs().max().item(), 1e-30)
    return {"shape": shape, "op": op, "batch": bs, "context": context, "dtype": str(DTYPE).removeprefix("torch."),
            "max_abs_diff": diff, "max_rel_diff": rel, "ok": rel <= TOLERANCE, "tolerance": TOLERANCE,
            "ours_us": ours_us, "flashinfer_us": fi_us, "faster": "ours" if ours_us <= fi_us else "flashinfer"}


def _randn(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=g).to(DTYPE)


def _add_rmsnorm(fi: ModuleType, shape: str, cfg: ModelConfig, bs: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(bs)
    w = (1 + 0.1 * torch.randn(cfg.hidden_size, device="cuda", generator=g)).to(DTYPE)
    hs = [_randn(bs, cfg.hidden_size, g=g) for _ in range(INPUT_SETS)]
    ds = [_randn(bs, cfg.hidden_size, g=g) for _ in range(INPUT_SETS)]
    s, ours = fused.add_rms_norm(hs[0], ds[0], w, cfg.rms_eps)
    residual, normed = hs[0].clone(), ds[0].clone()  # flashinfer: residual += input; input = norm(residual)
    fi.norm.fused_add_rmsnorm(normed, residual, w, cfg.rms_eps)
    both = torch.cat([s, ours]), torch.cat([residual, normed])
    # flashinfer works in place: its timing ops run on their own copies (their values drift, unchecked)
    fh, fd = [h.clone() for h in hs], [d.clone() for d in ds]
    ours_us = cycled_us_per_op([lambda i=i: fused.add_rms_norm(hs[i], ds[i], w, cfg.rms_eps) for i in range(INPUT_SETS)])
    fi_us = cycled_us_per_op([lambda i=i: fi.norm.fused_add_rmsnorm(fd[i], fh[i], w, cfg.rms_eps) for i in range(INPUT_SETS)])
    return _row(shape, "add_rmsnorm", bs, None, *both, ours_us, fi_us)


def _silu_mul(fi: ModuleType, shape: str, cfg: ModelConfig, bs: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(bs)
    xs = [_randn(bs, 2 * cfg.intermediate_size, g=g) for _ in range(INPUT_SETS)]
    outs = [torch.empty(bs, cfg.intermediate_size, dtype=DTYPE, device="cuda") for _ in range(INPUT_SETS)]
    ours, theirs = fused.silu_mul(xs[0]), fi.activation.silu_and_mul(xs[0])
    ours_us = cycled_us_per_op([lambda i=i: fused.silu_mul(xs[i]) for i in range(INPUT_SETS)])
    fi_us = cycled_us_per_op([lambda i=i: fi.activation.silu_and_mul(xs[i], out=outs[i]) for i in range(INPUT_SETS)])
    return _row(shape, "silu_mul", bs, None, ours, theirs, ours_us, fi_us)


def kv_copies(cfg: ModelConfig, bs: int, context: int) -> int:
    """Layers' KV caches an attention timing cycles through so that it streams past the L2 cache."""
    layer_bytes = 2 * (bs * -(-context // PAGE_SIZE) + 1) * PAGE_SIZE * cfg.num_kv_heads * cfg.head_dim * DTYPE.itemsize
    return max(1, min(MAX_KV_COPIES, -(-STREAM_BYTES // layer_bytes)))


class Pages:
    """bs rows of `context` keys each (the last one the token being decoded) over a shuffled page
    pool with one scratch page, and `copies` layers' KV caches over it. `width`: pages per row of
    the table, padded with the scratch page as a CUDA graph's static table is (default: no more
    than the rows own)."""

    def __init__(self, cfg: ModelConfig, bs: int, context: int, copies: int, g: torch.Generator,
                 width: int | None = None):
        per_row = -(-context // PAGE_SIZE)
        self.num_pages = bs * per_row + 1
        order = torch.randperm(self.num_pages - 1, device="cuda", generator=g)
        table = order.view(bs, per_row)  # int64, as the static inputs hold it
        if width is not None and width > per_row:
            scratch = torch.full((bs, width - per_row), self.num_pages - 1, dtype=table.dtype, device="cuda")
            table = torch.cat([table, scratch], dim=1)
        self.page_table = table.contiguous()
        self.kv_len = torch.full((bs,), context, dtype=torch.int64, device="cuda")
        self.indptr, self.indices, self.last_page_len = csr_pages(self.page_table, self.kv_len, PAGE_SIZE)
        shape = (2, self.num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [_randn(*shape, g=g) for _ in range(copies)]
        pos = context - 1
        self.positions = torch.full((bs,), pos, dtype=torch.int32, device="cuda")
        self.write_slots = self.page_table[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        self.batch_indices = torch.arange(bs, dtype=torch.int32, device="cuda")

    @staticmethod
    def kv_tuple(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0], layer[1]  # flashinfer's NHD (K, V) tuple: views, no copy


def _rope_kv(fi: ModuleType, shape: str, cfg: ModelConfig, bs: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(bs)
    pages = Pages(cfg, bs, CONTEXT, 1, g)
    Hq, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos_table, sin_table = rope_cos_sin(cfg, "cuda")
    # flashinfer's table [positions, d]: cos of each frequency, then its sin (our sin table's
    # second half: its first half is the rotate-half sign folded in)
    cos_sin_cache = torch.cat([cos_table[:, :d // 2], sin_table[:, d // 2:]], dim=-1).contiguous()
    cos, sin = cos_table[pages.positions.long()], sin_table[pages.positions.long()]  # gathered once per step
    qkvs = [_randn(bs, (Hq + 2 * Hkv) * d, g=g) for _ in range(INPUT_SETS)]

    def theirs(qkv: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv[:, :Hq * d], qkv[:, Hq * d:(Hq + Hkv) * d], qkv[:, (Hq + Hkv) * d:]
        fi.rope.apply_rope_with_cos_sin_cache_inplace(pages.positions, q, k, d, cos_sin_cache, is_neox=True)
        fi.page.append_paged_kv_cache(k.view(bs, Hkv, d), v.view(bs, Hkv, d), pages.batch_indices, pages.positions,
                                      Pages.kv_tuple(layer), pages.indices, pages.indptr, pages.last_page_len, "NHD")
        return q.view(bs, Hq, d)

    ours_kv, fi_kv = pages.layers[0].clone(), pages.layers[0].clone()
    q_ours = fused.rope_write_kv(qkvs[0], cos, sin, Hq, Hkv, ours_kv, pages.write_slots)
    q_fi = theirs(qkvs[0].clone(), fi_kv)
    both = (torch.cat([q_ours.flatten(), ours_kv.flatten()]), torch.cat([q_fi.flatten(), fi_kv.flatten()]))
    layer = pages.layers[0]
    ours_us = cycled_us_per_op([lambda i=i: fused.rope_write_kv(qkvs[i], cos, sin, Hq, Hkv, layer, pages.write_slots)
                         for i in range(INPUT_SETS)])
    fi_qkvs = [x.clone() for x in qkvs]  # rotated in place again at every replay
    fi_us = cycled_us_per_op([lambda i=i: theirs(fi_qkvs[i], layer) for i in range(INPUT_SETS)])
    return _row(shape, "rope_kv", bs, CONTEXT, *both, ours_us, fi_us)


def _attention(fi: ModuleType, shape: str, cfg: ModelConfig, bs: int, context: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(bs + context)
    Hq, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    copies = kv_copies(cfg, bs, context)
    pages = Pages(cfg, bs, context, copies, g)
    qs = [_randn(bs, Hq, d, g=g) for _ in range(INPUT_SETS)]
    outs = [torch.empty(bs, Hq, d, dtype=DTYPE, device="cuda") for _ in range(INPUT_SETS)]
    wrapper = fi.decode.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.empty(len(pages.indices), dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device="cuda"))
    wrapper.plan(pages.indptr, pages.indices, pages.last_page_len, Hq, Hkv, d, PAGE_SIZE,
                 q_data_type=DTYPE, kv_data_type=DTYPE)

    def ours(i: int) -> torch.Tensor:
        return static_attention_triton(qs[i % INPUT_SETS], pages.layers[i % copies], pages.page_table, pages.kv_len)

    def theirs(i: int) -> torch.Tensor:
        return wrapper.run(qs[i % INPUT_SETS], Pages.kv_tuple(pages.layers[i % copies]), out=outs[i % INPUT_SETS])

    n = max(INPUT_SETS, copies)
    both = ours(0), theirs(0).clone()
    ours_us = cycled_us_per_op([lambda i=i: ours(i) for i in range(n)])
    fi_us = cycled_us_per_op([lambda i=i: theirs(i) for i in range(n)])
    return _row(shape, "attention", bs, context, *both, ours_us, fi_us)


LAYER_OPS = {"add_rmsnorm": 2, "silu_mul": 1, "rope_kv": 1, "attention": 1}  # per decoder layer


def summary_lines(result: dict) -> list[str]:
    if not result.get("available"):
        return [f"flashinfer not importable: {result.get('reason')}"]
    failed = [r for r in result["rows"] if "error" in r]
    rows = [r for r in result["rows"] if "error" not in r]
    lines = [f"flashinfer {result['version']}: {'shape':9} {'op':11} batch context  check           "
             f"us/op: ours flashinfer  faster"]
    for r in rows:
        check = f"{'ok' if r['ok'] else 'FAIL'} {r['max_abs_diff']:.1e}/{r['max_rel_diff']:.0e}"
        lines.append(f"flashinfer {r['shape']:9} {r['op']:11} {r['batch']:5} {r['context'] or '':>7}  {check:15} "
                     f"{r['ours_us']:10.2f} {r['flashinfer_us']:10.2f}  {r['faster']}")
    lines += [f"flashinfer {r['shape']:9} {r['op']:11} {r['batch']:5} {r['context'] or '':>7}  FAILED {r['error']}"
              for r in failed]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for bs in dict.fromkeys(r["batch"] for r in rows if r["shape"] == shape):
            layer = [r for r in rows if r["shape"] == shape and r["batch"] == bs
                     and (r["op"] != "attention" or r["context"] == CONTEXT)]
            ours = sum(LAYER_OPS[r["op"]] * r["ours_us"] for r in layer)
            theirs = sum(LAYER_OPS[r["op"]] * r["flashinfer_us"] for r in layer)
            missing = sorted(set(LAYER_OPS) - {r["op"] for r in layer})
            lines.append(f"flashinfer one {shape} layer, batch {bs}, context {CONTEXT} (2 add_rmsnorm, silu_mul, "
                         f"rope_kv, attention): ours {ours:.1f} us, flashinfer {theirs:.1f} us (x{theirs / ours:.2f})"
                         + (f" WITHOUT {', '.join(missing)}" if missing else ""))
        wins = []
        for op in LAYER_OPS:
            rs = [r for r in rows if r["shape"] == shape and r["op"] == op]
            n = sum(r["faster"] == "flashinfer" for r in rs)
            wins.append(f"{op} flashinfer {n}/{len(rs)}")
        lines.append(f"flashinfer {shape}: faster per op (cases flashinfer wins): {', '.join(wins)}")
    return lines
