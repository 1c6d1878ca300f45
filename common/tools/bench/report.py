"""Output files (JSON, JSONL, markdown) and table formatting shared by the benchmarks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

# common/tools/bench/report.py -> the repository root: `pdflash up` started from there runs
# this checkout's services, not whatever copy an installed package points at.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def provenance(args: Any) -> dict[str, Any]:
    """What produced a result: the command line, its options, the git commit, when."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    options = {k: _in_repo(v) for k, v in vars(args).items() if not k.startswith("_")}
    return {"argv": [_in_repo(a) for a in sys.argv], "options": options, "git_commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _in_repo(value: Any) -> Any:
    """A path inside the repository relative to its root: results are read on other machines."""
    if isinstance(value, str) and value.startswith(REPO_ROOT + os.sep):
        return os.path.relpath(value, REPO_ROOT)
    return value


def fmt(x: Any, digits: int = 2, unit: str = "") -> str:
    """A table cell: '-' for None, fixed digits for floats."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def md_table(headers: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    """A markdown table; align per column: 'l' or 'r' (default: first left, others right)."""
    align = align or ["l"] + ["r"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
