"""What a service process imports to load its model: every stack start pays it once per process
(router, P, D, each forkserver and node), dozens of times in this suite. torch._dynamo with sympy
and the inductor cost 3-4 s of CPU per process, transformers 2 s; nothing here needs them (the
chat template, rendered by transformers, is the router's). `pdflash up` itself, which runs no model, imports
no torch unless it must find the device (no --device and no OMP_NUM_THREADS)."""
from __future__ import annotations

import json
import subprocess
import sys

from netns_hosts import REPO

HEAVY = ("torch._dynamo", "sympy", "torch._inductor", "transformers")

LOAD = """
import json, sys
from common.service.loader import ModelOptions, load_model
runner, tokenizer = load_model(ModelOptions(page_size=16, kv_pages=8))
assert tokenizer.decode(tokenizer.encode("The capital of France is")) == "The capital of France is"
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def test_loading_the_model_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", LOAD.format(heavy=HEAVY)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_up_imports_no_torch():
    """`pdflash up` only starts and watches processes: torch would add seconds of CPU to every stack start."""
    code = "import sys; import common.tools.up; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
