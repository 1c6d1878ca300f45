"""--draft-dtype: which dtype the drafter runs in, that the services' proposer runs it there (its
draft KV, and the LM head it drafts through once a decoder reserves it; the pending features stay
the target's), and that P and D holding the draft KV in different dtypes is refused with the flag
named. --draft-refine: the refine passes a served drafter drafts with. Losslessness with a bf16
drafter beside an fp32 target is tests/test_dflash_lossless.py's."""
from __future__ import annotations

import argparse
import re

import pytest
import torch
from tiny_models import random_model, save_random_drafter

from common.dflash import drafter as drafter_module
from common.dflash.drafter import Drafter, DrafterConfig, draft_dtype
from common.kv.buffers import PagedKVBuffer, RankEndpoint, RoomBuffers
from common.runner.model_runner import ModelRunner
from common.service.loader import load_proposer
from common.service.spec_args import add_spec_args, spec_flags
from common.transfer.plan import TransferPlanError
from prefill_svc.kv_sender import plan_writes


def test_named_dtypes_are_taken_as_given():
    for device in ("cpu", "cuda"):
        for target in (torch.float32, torch.bfloat16):
            assert draft_dtype("fp32", target, device) == torch.float32
            assert draft_dtype("bf16", target, device) == torch.bfloat16


def test_auto_narrows_an_fp32_target_where_bf16_is_native(monkeypatch):
    assert draft_dtype("auto", torch.float32, "cuda") == torch.bfloat16
    assert draft_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    monkeypatch.setattr(drafter_module, "_cpu_has_bf16", lambda: True)
    assert draft_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    monkeypatch.setattr(drafter_module, "_cpu_has_bf16", lambda: False)
    assert draft_dtype("auto", torch.float32, "cpu") == torch.float32  # negative control
    assert draft_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="fp16"):
        draft_dtype("fp16", torch.float32, "cpu")
    p = argparse.ArgumentParser()
    add_spec_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-dtype", "fp16"])


def test_flag_travels_to_child_processes():
    p = argparse.ArgumentParser()
    add_spec_args(p)
    assert "--draft-dtype" not in spec_flags(p.parse_args(["--spec", "dflash"]))
    flags = spec_flags(p.parse_args(["--spec", "dflash", "--draft-dtype", "fp32"]))
    assert flags[flags.index("--draft-dtype") + 1] == "fp32"


@pytest.mark.parametrize("choice,expected", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_services_proposer_runs_in_the_chosen_dtype(tmp_path, choice, expected):
    cfg, tensors = random_model(num_layers=2)
    folder = save_random_drafter(cfg, (0, 1), str(tmp_path / "drafter"))
    runner = ModelRunner(cfg, tensors, num_pages=16, page_size=8)
    p = argparse.ArgumentParser()
    add_spec_args(p)
    args = p.parse_args(["--spec", "dflash", "--draft-model", folder, "--draft-dtype", choice])
    args.model = None
    proposer = load_proposer(args, runner)
    assert proposer.dtype == proposer.kv.dtype == expected
    assert proposer.describe_buffers()[0].dtype == str(expected).removeprefix("torch.")
    if expected == torch.float32:  # the target's own LM head, not a copy
        assert proposer.lm_head.data_ptr() == runner.model.lm_head_weight.data_ptr()
    else:  # a prefill instance never drafts: the copy waits for a decoder
        assert proposer.lm_head is None
        with pytest.raises(RuntimeError, match="reserve_pending"):
            proposer.draft(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                           torch.zeros(1, 4, dtype=torch.long), 4)
    proposer.reserve_pending(8, 2)
    assert proposer.lm_head.dtype == expected and proposer.pending.dtype == torch.float32


def test_draft_refine_overrides_the_saved_setting_and_travels(tmp_path, capsys):
    """--draft-refine sets how the served drafter drafts (the weights are the same); absent, the
    drafter's saved setting holds, and a setting without a threshold keeps the saved one; a
    malformed or out-of-range value is refused by the parser, naming what was wrong."""
    cfg, tensors = random_model(num_layers=2)
    folder = str(tmp_path / "drafter")
    Drafter(DrafterConfig.for_target(cfg, num_layers=1, capture_layers=(0, 1), block_size=4, refine_passes=1,
                                     refine_threshold=0.7)).save(folder)
    runner = ModelRunner(cfg, tensors, num_pages=16, page_size=8)
    p = argparse.ArgumentParser()
    add_spec_args(p)

    def served(*flags: str) -> tuple[int, float]:
        args = p.parse_args(["--spec", "dflash", "--draft-model", folder, *flags])
        args.model = None
        got = load_proposer(args, runner).drafter.cfg
        return got.refine_passes, got.refine_threshold

    assert served() == (1, 0.7)
    assert served("--draft-refine", "2@0.4") == (2, 0.4)
    assert served("--draft-refine", "2") == (2, 0.7)
    assert served("--draft-refine", "0") == (0, 0.7)
    flags = spec_flags(p.parse_args(["--spec", "dflash", "--draft-refine", "0"]))
    assert flags[flags.index("--draft-refine") + 1] == "0"
    assert "--draft-refine" not in spec_flags(p.parse_args(["--spec", "dflash"]))
    for bad, why in (("two", "PASSES\\[@THRESHOLD\\]"), ("2@", "PASSES\\[@THRESHOLD\\]"), ("-1", "at least 0"),
                     ("2@1.5", "between 0 and 1"), ("2@nan", "between 0 and 1")):
        with pytest.raises(SystemExit):
            p.parse_args(["--draft-refine", bad])
        assert re.search(f"--draft-refine: refine setting '{re.escape(bad)}': .*{why}", capsys.readouterr().err), bad


def _room(dtype: str) -> list[RankEndpoint]:
    kv = PagedKVBuffer("kv", 1 << 20, 2, 8, 8, 2, 0, 2, 16, "float32")
    draft = PagedKVBuffer("draft_kv", 1 << 24, 1, 8, 8, 2, 0, 2, 16, dtype)
    return [RankEndpoint(0, "session", [kv, draft])]


def test_draft_kv_in_different_dtypes_is_refused_naming_the_flag():
    pages = {"kv": [1, 2], "draft_kv": [1, 2]}
    dst = [(0, "session", RoomBuffers(_room("float32")[0].buffers, pages))]
    assert plan_writes("r", _room("float32"), 1, pages, dst, 1, 12)  # negative control: same dtype plans
    with pytest.raises(TransferPlanError, match="--draft-dtype"):
        plan_writes("r", _room("bfloat16"), 1, pages, dst, 1, 12)
