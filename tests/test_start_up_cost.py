"""What a service process imports to load its model: every stack start pays it once per process
(router, P, D, each forkserver and node), dozens of times in this suite. torch._dynamo with sympy
and the inductor cost 3-4 s of CPU per process, transformers 2 s; nothing here needs them (the
chat template, rendered by transformers, is the router's). `pdflash up` itself, which runs no model, imports
no torch unless it must find the device (no --device and no OMP_NUM_THREADS), and neither does
the router, which tokenizes and renders chat templates but runs no model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns_hosts import REPO

from common.parallel.ports import free_port_pair

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


@pytest.mark.skipif(not os.path.isfile("/proc/self/maps"), reason="reads the process's mapped libraries")
def test_the_router_serves_without_torch():
    """A router ready to serve (model found, tokenizer and chat template loaded) has not loaded
    torch's library: about 7 s of CPU less at each of the dozens of router starts in this suite."""
    port = free_port_pair()  # HTTP, and gRPC on the next port
    proc = subprocess.Popen([sys.executable, "-m", "router_svc", "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "pd", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("pdflash router ready"), ready
        with open(f"/proc/{proc.pid}/maps") as f:
            libs = {line.split()[-1] for line in f if ".so" in line}
        assert not [lib for lib in libs if "libtorch" in lib], sorted(libs)
        assert [lib for lib in libs if "cygrpc" in lib]  # the control: a library it does load shows up
    finally:
        proc.kill()
        proc.wait()
