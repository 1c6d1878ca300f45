"""The PD stack (`pdflash up`: real processes, gRPC, Mooncake) serving a DeepSeek-V3 folder
(MLA + MoE, the tiny checkpoint of test_mla_moe.py: a dense layer, then two MoE layers) with
DFlash (a random GQA drafter) and every page checksummed on arrival.

One stack holds P instances at TP 1 x PP 3, TP 2 x PP 2 and TP 4 and D instances at TP 1, 2 and
4, the experts of every TP 2 and TP 4 instance sharded over 2 EP ranks (on both sides); the
router's route header sends requests to each of the 9 (P TP, D TP) pairs. Greedy tokens equal the
single-process engine's without speculation: whole latent pages came from one P rank per D rank
(each stage sending its own layers'), the EP ranks' partial MoE outputs add up on both sides, and
speculation stayed lossless."""
from __future__ import annotations

import concurrent.futures
import os
import shutil

import pytest

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.model.source import converted_folder, resolve_model
from common.model.weights import load_weights
from common.runner.model_runner import ModelRunner
from pd_stack import Stack, pair_prompt, serve_alone
from test_mla_moe import PROMPTS, write_checkpoint
from tiny_models import save_random_drafter

pytestmark = pytest.mark.slow

PAGE = 8
MAX_NEW = 10
LAYERS, DRAFT_LAYERS = 3, 1  # the checkpoint's; the drafter's

# (TP, PP, EP) of each P instance and (TP, EP) of each D instance: every P TP x D TP pair in
# {1, 2, 4}, P at PP 3 (a layer per stage) and PP 2 (dense, MoE | MoE, each stage's TP group
# sharding its own layer's experts), EP 2 at TP 2 and TP 4 on both sides; 18 ranks in all.
P_SHAPES = ((1, 3, 1), (2, 2, 2), (4, 1, 2))
D_SHAPES = ((1, 1), (2, 2), (4, 2))
PAIRS = [(p, d) for p in range(len(P_SHAPES)) for d in range(len(D_SHAPES))]


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


def test_pd_every_pair_equals_one_process(folder, tmp_path) -> None:
    """Each pair serves one request alone (three pairs at a time, none sharing an instance),
    then all pairs all prompts at once (each D batching rooms of three P instances, prefilled in
    chunks); every latent and draft page D received was checksummed."""
    cfg, tensors = load_weights(resolve_model(folder))
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    Engine(ModelRunner(cfg, tensors, num_pages=64, page_size=PAGE), cfg.eos_token_ids).run_all(reqs)
    drafter = save_random_drafter(cfg, (0, 2), str(tmp_path / "drafter"))
    sizes = lambda xs: ",".join(map(str, xs))  # noqa: E731
    stack = Stack("--mode", "pd", "--model", folder, "--page-size", str(PAGE), "--kv-pages", "160",
                  "--chunk-size", "24", "--deadline", "240", "--request-timeout", "600", "--verify-transfer",
                  "--prefill", str(len(P_SHAPES)), "--prefill-tp", sizes(s[0] for s in P_SHAPES),
                  "--prefill-pp", sizes(s[1] for s in P_SHAPES), "--prefill-ep", sizes(s[2] for s in P_SHAPES),
                  "--decode", str(len(D_SHAPES)), "--decode-tp", sizes(s[0] for s in D_SHAPES),
                  "--decode-ep", sizes(s[1] for s in D_SHAPES), "--allow-route-header",
                  "--spec", "dflash", "--draft-model", drafter, "--spec-block", "4")
    try:
        alone = serve_alone(len(P_SHAPES), lambda pair: stack.generate_on(
            pair, PROMPTS[pair_prompt(pair)], MAX_NEW, ignore_eos=True))  # in PAIRS' order
        assert set(stack.served().values()) == {len(PAIRS) // len(P_SHAPES)}  # one request on each pair
        jobs = [(pair, i) for pair in PAIRS for i in range(len(PROMPTS))]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            mixed = list(pool.map(lambda job: stack.generate_on(job[0], PROMPTS[job[1]], MAX_NEW, ignore_eos=True), jobs))
        for (pair, i), got in zip([(pair, pair_prompt(pair)) for pair in PAIRS] + jobs, alone + mixed):
            assert got["output_ids"] == reqs[i].output_ids, (pair, i)
            assert got["meta_info"]["spec_verify_ct"] > 0
            # The latent planes of the target's layers (one per layer) and the drafter's K and V.
            pages = -(-len(PROMPTS[i]) // PAGE)
            assert got["meta_info"]["verified_pages"] == (LAYERS + 2 * DRAFT_LAYERS) * pages, (pair, i)
        stack.wait_all_pages_free()
    finally:
        stack.stop()
    stack.assert_clean_log()
