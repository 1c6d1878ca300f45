"""The layering rules of docs/ARCHITECTURE.md, checked on the code's own imports.

Every import of every module (also those inside functions and under TYPE_CHECKING: a lazy
import is still a dependency) is read with `ast`; the test fails on an import cycle between
modules and on an import that a layer may not make. Two negative controls feed the checker a
graph with a cycle and one with an upward edge, so a checker that sees nothing cannot pass.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("common", "prefill_svc", "decode_svc", "router_svc", "deploy", "protos")

# Bottom to top. A module may import its own package and packages on lower floors only; packages
# on one floor do not import each other. `model` and `kv` import nothing else of ours.
FLOORS: list[tuple[str, ...]] = [
    ("protos",),
    ("common.model", "common.kv"),
    ("common.runner",),
    ("common.engine", "common.dflash", "common.transfer"),
    ("common.parallel",),
    ("common.service",),
    ("common.tools", "prefill_svc", "decode_svc", "router_svc", "deploy"),
]
ISOLATED = {"common.model", "common.kv"}  # may not import even protos


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def our_modules() -> dict[str, str]:
    """module name -> file, for every Python file of the trees (generated protobuf code aside)."""
    found = {}
    for tree in TREES:
        for folder, _, files in os.walk(os.path.join(ROOT, tree)):
            for f in files:
                if f.endswith(".py") and not f.endswith(("_pb2.py", "_pb2_grpc.py")):
                    path = os.path.join(folder, f)
                    found[module_name(path)] = path
    return found


def imports_of(name: str, path: str, modules: set[str]) -> set[str]:
    """The modules of ours that `name` imports (a package import counts as its __init__)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    out = set()
    for t in targets:
        while t and t not in modules and not t.startswith("protos"):
            t = t.rpartition(".")[0]
        if t.startswith("protos"):
            t = "protos"
        if t and t != name:
            out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = our_modules()
    names = set(mods) | {"protos"}
    return {name: imports_of(name, path, names) for name, path in mods.items()}


def package_of(module: str) -> str | None:
    for floor in FLOORS:
        for pkg in floor:
            if module == pkg or module.startswith(pkg + "."):
                return pkg
    return None


def floor_of(pkg: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if pkg in floor)


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in graph.items():
        pa = package_of(a)
        if pa is None:
            if a != "common":
                bad.append(f"{a} belongs to no layer (put it in one of the packages of FLOORS)")
            continue
        for b in sorted(targets):
            pb = package_of(b)
            if pb is None or pa == pb:
                continue
            if pa in ISOLATED:
                bad.append(f"{a} -> {b}: {pa} imports nothing else of ours")
            elif floor_of(pb) >= floor_of(pa):
                bad.append(f"{a} -> {b}: {pa} may not import {pb} (same floor or above)")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "common.engine.engine" in graph["decode_svc.service"] or any(
        t.startswith("common.engine") for t in graph["decode_svc.service"])
    assert "common.model.config" in graph["common.model.transformer"]
    assert len(graph) > 80


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_forbidden_imports():
    assert forbidden_edges(import_graph()) == []


def test_checker_finds_a_cycle_and_an_upward_import():
    graph = {"common.kv.a": {"common.kv.b"}, "common.kv.b": {"common.kv.a"},
             "common.model.x": {"common.runner.y"}, "common.runner.y": set(),
             "prefill_svc.s": {"decode_svc.t"}, "decode_svc.t": set(),
             "common.engine.e": {"common.dflash.d"}, "common.dflash.d": set(),
             "common.service.s": {"common.tools.t"}, "common.tools.t": set()}
    assert cycles(graph) == [["common.kv.a", "common.kv.b"]]
    bad = forbidden_edges(graph)
    assert any(b.startswith("common.model.x -> common.runner.y") for b in bad)
    assert any(b.startswith("prefill_svc.s -> decode_svc.t") for b in bad)
    assert any(b.startswith("common.engine.e -> common.dflash.d") for b in bad)
    assert any(b.startswith("common.service.s -> common.tools.t") for b in bad)
    assert len(bad) == 4
