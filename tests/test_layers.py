"""The packages are layers: imports only go down, and no module imports itself back through others.

    matrix     spec, cells, placement, launch, run loop, CLI
    actors     what runs inside a Ray actor        analysis   every divergence computation
    store      every file format and read          backends   one file per engine (no ray)
    common     errors, names, ids, hashing, files

Every import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAY_IMPORT = {
    "common": set(),
    "store": {"common"},
    "backends": {"common"},
    # analysis.floors: a bf16-stored row's KL floor is measured where the native row is, in the actor
    "actors": {"common", "store", "backends", "analysis"},
    "analysis": {"common", "store"},
    "matrix": {"common", "store", "backends", "actors", "analysis"},
}
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for pkg in MAY_IMPORT:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = f.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules a file imports (`from pkg import mod` counts as pkg.mod when mod is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:  # `import a.b.c` where only a.b is a module of ours
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(f, known) - {m} for m, f in known.items()}


def test_every_import_goes_down_a_layer():
    upward = [f"{m} imports {d}" for m, deps in graph().items() for d in sorted(deps)
              if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    assert upward == [], "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan: a strongly connected component of more than one module is a cycle
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert cycles == []


def test_backends_never_import_ray():
    g = graph()
    for m, f in modules().items():
        if m.startswith("backends"):
            tree = ast.parse(f.read_text())
            mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} \
                | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not any(x == "ray" or x.startswith("ray.") for x in mods), m
    assert g  # the walk found the packages


def test_no_function_is_longer_than_60_lines():
    long = []
    for pkg in [*MAY_IMPORT, "benchmarks", "scripts"]:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert long == [], "\n".join(long)


def test_the_walk_sees_a_planted_upward_import_and_cycle(tmp_path, monkeypatch):
    """The checks above can fail: a store module importing matrix, and two modules importing each other."""
    for pkg in MAY_IMPORT:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "store" / "a.py").write_text("from matrix import b\n")
    (tmp_path / "matrix" / "b.py").write_text("def f():\n    import store.a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    g = graph()
    assert g["store.a"] == {"matrix.b"} and g["matrix.b"] == {"store.a"}
    try:
        test_every_import_goes_down_a_layer()
    except AssertionError as e:
        assert "store.a imports matrix.b" in str(e)
    else:
        raise AssertionError("the upward import was not seen")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "matrix.b" in str(e) and "store.a" in str(e)
    else:
        raise AssertionError("the cycle was not seen")
