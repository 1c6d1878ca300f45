"""A prefill or decode service whose start fails after its port opened (here: a bad --model)
says so in one line and exits 2: no traceback, and no grpc server left for the interpreter's exit
to tear down ("Exception ignored in Server.__del__"). So does one whose port is taken."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.parallel.ports import free_ports

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_a_bad_model_path_is_one_line_and_a_clean_exit(service):
    r = subprocess.run([sys.executable, "-m", service, "--port", str(free_ports(1)[0]), "--device", "cpu",
                        "--model", "/no/such/model"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors == [f"python -m {service}: error: unknown model path '/no/such/model': expected a Hugging Face "
                      "folder or a .gguf file"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_a_port_in_use_is_one_line(service):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", service, "--host", "127.0.0.1", "--port", str(port),
                            "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"python -m {service}: error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
