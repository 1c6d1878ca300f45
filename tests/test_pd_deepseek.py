"""The PD stack (`pdflash up`: real processes, gRPC, Mooncake) serving a DeepSeek-V3 folder
(MLA + MoE, the tiny checkpoint of test_mla_moe.py): P and D each at TP 2 with the experts
sharded over both ranks (EP 2), DFlash with a random GQA drafter, every latent and draft KV
page checksummed on arrival. Its greedy tokens equal the single-process engine's: whole latent
pages came from one P rank per D rank, the EP ranks' partial MoE outputs add up on both sides,
and speculation stayed lossless."""
from __future__ import annotations

import concurrent.futures
import os
import shutil

import pytest

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.model.weights import converted_folder, load_weights, resolve_model
from common.runner.model_runner import ModelRunner
from pd_stack import Stack
from test_mla_moe import PROMPTS, write_checkpoint
from tiny_models import save_random_drafter

pytestmark = pytest.mark.slow

PAGE = 8
MAX_NEW = 12
LAYERS, DRAFT_LAYERS = 3, 1  # the checkpoint's; the drafter's


@pytest.fixture(scope="module")
def folder(tmp_path_factory, embedded_source, embedded_tokenizer) -> str:
    """The checkpoint with the embedded model's tokenizer files beside it (the services load a
    tokenizer; requests here are token ids below the checkpoint's vocabulary)."""
    path = str(tmp_path_factory.mktemp("deepseek"))
    write_checkpoint("qlora_yarn_grouped", path)
    tokenizer = os.path.join(converted_folder(embedded_source), "tokenizer")  # kept there by Tokenizer
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), path)
    return path


def test_pd_stack_tp2_ep2_dflash_equals_one_process(folder, tmp_path) -> None:
    cfg, tensors = load_weights(resolve_model(folder))
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    Engine(ModelRunner(cfg, tensors, num_pages=64, page_size=PAGE), cfg.eos_token_ids).run_all(reqs)
    drafter = save_random_drafter(cfg, (0, 2), str(tmp_path / "drafter"))
    stack = Stack("--mode", "pd", "--model", folder, "--page-size", str(PAGE), "--kv-pages", "64",
                  "--chunk-size", "16", "--deadline", "240", "--request-timeout", "600", "--verify-transfer",
                  "--prefill-tp", "2", "--prefill-ep", "2", "--decode-tp", "2", "--decode-ep", "2",
                  "--spec", "dflash", "--draft-model", drafter, "--spec-block", "4")
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched, chunked prefill
            results = list(pool.map(lambda ids: stack.generate(ids, MAX_NEW, ignore_eos=True), PROMPTS))
        for ids, got, want in zip(PROMPTS, results, reqs):
            assert got["output_ids"] == want.output_ids
            # Every page D received was checksummed: the latent planes of the target's layers
            # (one per layer) and the drafter's K and V.
            assert got["meta_info"]["verified_pages"] == (LAYERS + 2 * DRAFT_LAYERS) * -(-len(ids) // PAGE)
        stack.wait_all_pages_free()
    finally:
        stack.stop()
    stack.assert_clean_log()
