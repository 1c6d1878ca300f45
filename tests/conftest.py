"""Shared fixtures. The embedded model (SmolLM2-135M-Instruct) is read once per session."""
from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TypeVar

import pytest
from filelock import FileLock

# The suite runs three xdist workers on two cores, each next to the service processes of its stacks:
# one compute thread per process. With torch's default (a thread per core) every process's
# threads spin waiting on each other on the busy cores, several times the CPU for the same work.
# Before torch is imported, here and in every process the tests start (they inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

T = TypeVar("T")


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], T]) -> T:
    """compute() once per test run however many xdist workers ask: a reference output that tests
    on several workers compare against (the session stacks' groups may land on any) is computed by
    the first to ask and read by the others from the run's own temporary folder, never from an
    earlier run's."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"  # the run's folder, above each worker's
    with FileLock(f"{path}.lock"):
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        path.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def embedded_source():
    from common.model.source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def embedded_weights(embedded_source):
    """(ModelConfig, Hugging Face-named fp32 tensors) of the embedded model."""
    from common.model.weights import load_weights

    return load_weights(embedded_source)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_source, embedded_weights):
    from common.model.tokenizer import Tokenizer

    return Tokenizer(embedded_source, embedded_weights[0].eos_token_ids)


@pytest.fixture(scope="session")
def make_embedded_runner(embedded_weights):
    """Factory: a fresh ModelRunner (own weights copy and KV pool) of the embedded model."""
    from common.runner.model_runner import ModelRunner

    def make(dtype: str = "fp32", page_size: int = 16, num_pages: int = 256) -> ModelRunner:
        cfg, tensors = embedded_weights
        return ModelRunner(cfg, tensors, dtype=dtype, num_pages=num_pages, page_size=page_size)

    return make


@pytest.fixture(scope="session")
def embedded_runner(make_embedded_runner):
    """fp32, page size 16, 256 pages. Shared: a test must release every page it reserves."""
    return make_embedded_runner()


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_source):
    """transformers' own fp32 model read independently from the same GGUF file."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(embedded_source.folder, gguf_file=embedded_source.gguf_file,
                                             dtype=torch.float32)
    return model.eval()


# ---- stacks shared by the tests that only read from them ---------------------------------------
# Starting `pdflash up` costs a model load per process; the tests that send requests and read
# what comes back (equivalence, the router's APIs, the benchmarks) share one stack of each mode
# for the whole session. Tests that kill, freeze or reconfigure services start their own.
SHARED_STACK_ARGS = ("--page-size", "16", "--kv-pages", "512", "--deadline", "240", "--request-timeout", "600")


@pytest.fixture(scope="session")
def pd_stack():
    """`pdflash up --mode pd --spec dflash --draft-dtype bf16 --spec-block 4 --verify-transfer
    --chunk-size 40`: PD with speculation at every step (the per-step choice is tested in-process: on a busy CI machine the
    costs it would measure, and so what it would choose, vary from run to run), every KV page
    (target and draft) checksummed on arrival, prompts over 40 tokens prefilled in chunks that
    end inside a page (P sends each chunk's whole pages while the next one computes). The drafter in
    bf16 beside the fp32 model, as auto runs it on CUDA, whatever this CPU has."""
    from pd_stack import running

    with running("--mode", "pd", "--spec", "dflash", "--draft-dtype", "bf16", "--spec-block", "4", "--verify-transfer", "--chunk-size", "40",
                 *SHARED_STACK_ARGS) as s:
        yield s


@pytest.fixture(scope="session")
def colocated_stack():
    """`pdflash up --mode colocated --replicas 2`: two replicas that prefill and decode."""
    from pd_stack import running

    with running("--mode", "colocated", "--replicas", "2", *SHARED_STACK_ARGS) as s:
        yield s


@pytest.fixture(scope="session", params=["pd", "colocated"])
def shared_stack(request):
    """Each of the session's stacks in turn, for tests that hold for both."""
    return request.getfixturevalue(f"{request.param}_stack")


# The suite runs on several workers (pytest-xdist, `--dist loadgroup`, see the Makefile): a test
# runs on the worker of its group. Tests on a session stack share that stack's group, so that
# it starts once; every other test keeps to its module's group, so that a module's own stack
# (module-scoped fixtures) starts once too.
SESSION_STACKS = ("pd_stack", "colocated_stack")


def stack_group(item) -> str | None:
    """The session stack a test uses, named or through `shared_stack`'s parameter."""
    if "shared_stack" in item.fixturenames:
        return f"{item.callspec.params['shared_stack']}_stack"
    return next((s for s in SESSION_STACKS if s in item.fixturenames), None)


# The groups that take longest (their stacks, or the kernels under Triton's interpreter: minutes
# each on two cores), handed out first: xdist hands groups out in collection order (the Makefile
# turns its own by-size order off), and a long group handed out last would run alone at the end
# while the other workers idle.
LONGEST_FIRST = ("test_pd_kimi_linear", "test_deploy_netns", "test_pd_deepseek", "test_static_steps", "pd_stack",
                 "test_pd_parallel", "test_faults", "colocated_stack", "test_dflash_lossless")


def group_of(item) -> str:
    return stack_group(item) or item.module.__name__


# First: xdist's worker reads the groups in its own hook of this name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item), len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist tells the groups to its scheduler as an "@group" suffix of each test's id; where that
    is lost (pytest 9.2, pytest-xdist#1386) every test is a group of its own and each stack starts
    on every worker, silently doubling the suite's time: stop instead."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit(f"--dist loadgroup: xdist cannot group the tests under pytest {pytest.__version__} "
                    "(pyproject.toml pins a version where it can)", returncode=4)
