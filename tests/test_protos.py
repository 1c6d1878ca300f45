"""The generated protobuf/gRPC modules must match protos/pdflash.proto (run `make protos`)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ["pdflash_pb2.py", "pdflash_pb2.pyi", "pdflash_pb2_grpc.py"]


def test_generated_code_matches_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "pdflash.proto", tmp_path / "protos")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", "protos/pdflash.proto"], cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is out of date with pdflash.proto: run `make protos`"
