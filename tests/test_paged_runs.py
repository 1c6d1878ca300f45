"""CPU attention that reads each row's pages in place (common.model.paged_runs) computes what
gathering them computes: on page tables of several runs per row, causal blocks whose own tokens
span runs (queries that see nothing of a run), windows, bf16 and MLA's one latent plane; it
reads no key it must not; and in the engine, on a fragmented pool, plain and speculative
decoding with every step read in place give the tokens plain decoding gives. The general path's
batches (prefill chunks) read that way equal attention written out request by request."""
from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F

from common.dflash.drafter import SHIPPED, Drafter
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.model import paged_runs
from common.model.attention import attend_cached, build_attn_meta
from common.model.static_attention import static_attention_torch

PAGE = 4


def interleaved(rows: int, prompt_pages: int, decode_pages: int) -> list[list[int]]:
    """Pages as a pool hands them out: each prompt's together, then decode pages in turns."""
    tables, page = [], 1  # page 0 stays unused: the scratch page
    for _ in range(rows):
        tables.append(list(range(page, page + prompt_pages)))
        page += prompt_pages
    for _ in range(decode_pages):
        for table in tables:
            table.append(page)
            page += 1
    return tables


def case(T: int, causal: bool, window: bool = False, dtype=torch.float32, heads=(6, 2), d=8):
    torch.manual_seed(T + 2 * causal + 4 * window)
    tables = interleaved(3, 3, 6)
    kv = torch.randn(2, 1 + sum(map(len, tables)), PAGE, heads[1], d).to(dtype)
    # Rows end mid-page, on a page's first slot, and with their T new tokens in two runs.
    kv_len = torch.tensor([13, 17, 25]) + T
    table = torch.tensor(tables)[:, :-(-int(kv_len.max()) // PAGE)]
    start = torch.tensor([0, 5, 9]) if window else None
    q = torch.randn(3 * T, heads[0], d).to(dtype)
    return q, kv, table, kv_len, start


def in_place(q, kv, table, kv_len, T, causal, start, scale=None) -> torch.Tensor:
    plan = paged_runs.plan(table, kv_len, start, T, causal, kv)
    assert plan is not None  # small tables and short runs: a plan only because of `always_in_place`
    return plan.attend(q, kv, scale)


@pytest.fixture
def always_in_place(monkeypatch):
    monkeypatch.setattr(paged_runs, "LONG_ROW", 0)
    monkeypatch.setattr(paged_runs, "SHORT_RUN", 0)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_in_place_equals_gathered(always_in_place, T, causal):
    q, kv, table, kv_len, _ = case(T, causal)
    got = in_place(q, kv, table, kv_len, T, causal, None)
    torch.testing.assert_close(got, static_attention_torch(q, kv, table, kv_len, T, causal), rtol=1e-5, atol=1e-6)
    plan = paged_runs.plan(table, kv_len, None, T, causal, kv)
    assert all(len(runs) > 1 for runs in plan.rows)
    if causal and T == 8:  # the test covers runs some of whose queries see none of their keys
        assert any(run.blind is not None for runs in plan.rows for run in runs)


def test_window_bf16_and_latent_plane(always_in_place):
    q, kv, table, kv_len, start = case(3, False, window=True)
    torch.testing.assert_close(in_place(q, kv, table, kv_len, 3, False, start),
                               static_attention_torch(q, kv, table, kv_len, 3, False, start), rtol=1e-5, atol=1e-6)
    q, kv, table, kv_len, _ = case(3, True, dtype=torch.bfloat16)
    torch.testing.assert_close(in_place(q, kv, table, kv_len, 3, True, None),
                               static_attention_torch(q, kv, table, kv_len, 3, True), rtol=2e-2, atol=2e-2)
    # MLA: one latent plane [1, pages, page, 1, latent + rope] read as both keys and values.
    q, latent, table, kv_len, _ = case(3, True, heads=(4, 1), d=24)
    kv = latent[:1].expand(2, *latent.shape[1:])
    torch.testing.assert_close(in_place(q, kv, table, kv_len, 3, True, None, 0.3),
                               static_attention_torch(q, kv, table, kv_len, 3, True, None, 0.3), rtol=1e-5, atol=1e-6)


def test_in_place_reads_only_its_keys(always_in_place):
    T = 3
    q, kv, table, kv_len, start = case(T, True, window=True)
    out = in_place(q, kv, table, kv_len, T, True, start)
    keep = torch.zeros(kv.shape[1] * PAGE, dtype=torch.bool)
    for row, lo, hi in zip(table.tolist(), start.tolist(), kv_len.tolist()):
        for pos in range(lo, hi):
            keep[row[pos // PAGE] * PAGE + pos % PAGE] = True
    poisoned = kv.clone().view(2, -1, *kv.shape[3:])
    poisoned[:, ~keep] = 1e4
    torch.testing.assert_close(in_place(q, poisoned.view_as(kv), table, kv_len, T, True, start), out)
    # Control: a key the rows do read changes the output.
    poisoned[:, keep.nonzero()[0]] = 1e4
    assert not torch.allclose(in_place(q, poisoned.view_as(kv), table, kv_len, T, True, start), out)


def test_plan_gathers_where_that_is_cheaper():
    kv = torch.zeros(2, 1, 64, 3, 64)  # pages of 64 keys of 768 bytes

    def plan(rows: int, keys: int, run: int = 1 << 20):
        """`rows` rows of `keys` keys each, in runs of `run` pages, the rows' runs interleaved."""
        pages = -(-keys // 64)
        table = torch.arange(rows * pages).view(-1, rows, min(run, pages)).transpose(0, 1).reshape(rows, pages)
        return paged_runs.plan(table, torch.full((rows,), keys), None, 1, True, kv)

    assert plan(8, 500) is None  # short rows: one batched call is cheaper
    assert plan(1, 500) is not None and plan(1, 4096, run=1) is not None  # one row: in place
    assert plan(2, paged_runs.LONG_ROW) is not None  # long rows
    assert plan(-(-paged_runs.GATHER_BYTES // (512 * 768)), 512) is not None  # a gather past the mmap threshold
    assert plan(8, 4096, run=paged_runs.SHORT_RUN // 64) is not None
    assert plan(8, 4096, run=paged_runs.SHORT_RUN // 64 // 2) is None  # runs too short


def test_engine_in_place_equals_gathered(make_embedded_runner, embedded_tokenizer, always_in_place, monkeypatch):
    """Eight requests decoding together, plainly and with DFlash blocks of 4, every step read in
    place from a pool that finished requests left fragmented (each request's pages are runs of
    one, so every row merges several), give the tokens plain decoding gives with the pages
    gathered from a fresh pool."""
    runner = make_embedded_runner(page_size=16, num_pages=256)
    tok = embedded_tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Count from {i} to {i + 20}, one number a line."}])
               for i in range(8)]

    def run(engine: Engine) -> list[list[int]]:
        free = runner.pool.num_free
        reqs = [Request(uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=24)) for ids in prompts]
        engine.run_all(reqs, 8)
        assert runner.pool.num_free == free
        return [r.output_ids for r in reqs]

    with monkeypatch.context() as gathering:
        gathering.setattr(paged_runs, "plan", lambda *a: None)
        gathered = run(Engine(runner, tok.eos_token_ids))
    pages = runner.pool.alloc(runner.pool.num_free)
    runner.pool.free(pages[1::2])  # handed out lowest first: pages 2 apart
    runs = []
    monkeypatch.setattr(paged_runs.RunPlan, "attend", lambda self, *a, _f=paged_runs.RunPlan.attend:
                        runs.append(min(map(len, self.rows))) or _f(self, *a))
    try:
        assert run(Engine(runner, tok.eos_token_ids)) == gathered
        assert min(runs) > 1
        proposer = DFlashProposer(Drafter.load(SHIPPED, dtype=torch.bfloat16), runner, runner.pool.num_pages)
        engine = Engine(runner, tok.eos_token_ids, proposer=proposer, spec=SpecConfig(block=4))
        assert run(engine) == gathered
    finally:
        runner.pool.free(pages[0::2])


def written_out(q, kv, starts, counts, tables, scale=None) -> torch.Tensor:
    """Each request's new tokens over its keys 0..start+n, causally: the definition."""
    heads, d = kv.shape[-2:]
    out, row = [], 0
    for start, n, table in zip(starts, counts, tables):
        if not n:
            continue
        slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(start + n)])
        k, v = (kv[i].reshape(-1, heads, d)[slots].transpose(0, 1)[None] for i in (0, 1))
        visible = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None], k, v, attn_mask=visible, scale=scale,
                                           enable_gqa=True)
        out.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("short_run", [0, paged_runs.SHORT_RUN])
def test_general_batches_read_in_place(dtype, tol, latent, short_run, monkeypatch):
    """A fresh prompt, a decode token, a request with no new token, and chunks continuing cached
    prompts whose pages are several runs, in one batch (how prefill and extend() batch them); the
    runs read one by one, and (their default: runs of a few keys) gathered into one read; and the
    padded view of the same batch."""
    monkeypatch.setattr(paged_runs, "SHORT_RUN", short_run)
    torch.manual_seed(1)
    tables = interleaved(5, 3, 6)
    starts, counts = [0, 22, 13, 9, 26], [7, 1, 4, 0, 9]
    heads, d = ((4, 1), 24) if latent else ((6, 2), 8)
    kv = torch.randn(2, 1 + sum(map(len, tables)), PAGE, heads[1], d).to(dtype)
    if latent:  # MLA: one plane read as keys and values
        kv = kv[:1].expand(2, *kv.shape[1:])
    q = torch.randn(sum(counts), heads[0], d).to(dtype)
    meta = build_attn_meta(starts, counts, tables, PAGE, 0, torch.device("cpu"), None)
    assert meta.extend is not None and len(meta.extend) == 4
    if short_run:
        assert all(r.scattered is not None for r in meta.extend if r.row)
    else:
        assert max(len(r.cached) for r in meta.extend) > 1
    scale = 0.3 if latent else None
    expected = written_out(q, kv, starts, counts, tables, scale)
    torch.testing.assert_close(attend_cached(q, kv, meta, scale), expected, rtol=tol, atol=tol)
    # The padded view (GPUs take it) against the same definition.
    padded = build_attn_meta(starts, counts, tables, PAGE, 0, torch.device("cpu"), None, in_place=False)
    assert padded.extend is None and padded.mask is not None
    torch.testing.assert_close(attend_cached(q, kv, padded, scale), expected, rtol=tol, atol=tol)
