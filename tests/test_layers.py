"""The packages are layers: imports only go down, and no module imports itself back through others.

    matrix.cli    the `matrix` command, one module per verb group: parse, call matrix.api, print
    matrix.api    the Python API: run, analyze, kld, connect
    matrix.run    plan, placement, launch, the run loop, cluster, builds, failures
    matrix.spec   parse, validate, expand: spec, cells, candidates, calibration, corpus, models
    actors        what runs inside a Ray actor (or the process that captures)
    extras        per-cell extras (layers, decode, prefix cache): one module each, a registry
    analysis      every divergence computation
    store         every file format and read          backends   one file per engine (no ray)
    common        errors, names, ids, hashing, files

Every import counts, also one inside a function (a lazy import is still a dependency). Files stay
under 400 lines and functions under 60; the driver's top level holds only its subpackages and a
few modules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BELOW_DRIVER = {"common", "store", "backends", "analysis", "extras", "actors"}
MAY_IMPORT = {
    "common": set(),
    "store": {"common"},
    "backends": {"common"},
    "analysis": {"common", "store"},
    "extras": {"common", "store", "backends", "analysis"},
    # analysis.inline: a stack's metrics against its reference measured in the capturing actor
    "actors": {"common", "store", "backends", "analysis", "extras"},
    "matrix": set(),  # the package itself: its version
    "matrix.spec": {"matrix"} | BELOW_DRIVER,
    "matrix.run": {"matrix", "matrix.spec"} | BELOW_DRIVER,
    # the Python API: what each verb of the command calls
    "matrix.api": {"matrix", "matrix.spec", "matrix.run"} | BELOW_DRIVER,
    "matrix.cli": {"matrix", "matrix.spec", "matrix.run", "matrix.api"} | BELOW_DRIVER,
}
PACKAGES = ("common", "store", "backends", "analysis", "extras", "actors", "matrix")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
MAX_DRIVER_TOP_MODULES = 8


def layer(module: str) -> str:
    """The layer a module belongs to: its package, or matrix's subpackage (matrix.__main__ is the CLI's)."""
    parts = module.split(".")
    if parts[0] == "matrix" and len(parts) > 1:
        return (
            "matrix.cli"
            if parts[1] == "__main__"
            else f"matrix.{parts[1]}"
            if f"matrix.{parts[1]}" in MAY_IMPORT
            else "matrix"
        )
    return parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
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
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
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
    upward = [
        f"{m} imports {d}"
        for m, deps in graph().items()
        for d in sorted(deps)
        if layer(d) != layer(m) and layer(d) not in MAY_IMPORT[layer(m)]
    ]
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
            mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
                n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            }
            assert not any(x == "ray" or x.startswith("ray.") for x in mods), m
    assert g  # the walk found the packages


def test_no_function_is_longer_than_60_lines():
    long = []
    for pkg in [*PACKAGES, "benchmarks", "scripts"]:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if (
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES
                ):
                    long.append(f"{f.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert long == [], "\n".join(long)


def test_every_project_import_names_a_module():
    """`from matrix.spec.models import fetch` must name a module that exists: the walk above trims
    an unknown dotted name back to a known one, so a wrong path would pass it unseen."""
    wrong = []
    for pkg in [*PACKAGES, "benchmarks", "scripts", "tests"]:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                names = (
                    [n.module]
                    if isinstance(n, ast.ImportFrom) and n.module and not n.level
                    else [a.name for a in n.names]
                    if isinstance(n, ast.Import)
                    else []
                )
                for name in names:
                    if name.split(".")[0] in PACKAGES:
                        where = REPO / name.replace(".", "/")
                        if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()):
                            wrong.append(f"{f.relative_to(REPO)}:{n.lineno} {name}")
    assert wrong == [], "\n".join(wrong)


def test_no_source_file_is_longer_than_400_lines():
    long = [
        f"{f.relative_to(REPO)} ({n} lines)"
        for pkg in [*PACKAGES, "benchmarks", "scripts"]
        for f in sorted((REPO / pkg).rglob("*.py"))
        if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long == [], "\n".join(long)


def test_no_command_calls_another_commands_function():
    """A verb of the CLI parses, calls matrix.api (or a layer below) and prints: what two verbs share
    lives below the CLI, never in another verb's cmd_* function."""
    found = []
    for name, path in modules().items():
        if not name.startswith("matrix.cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("matrix.cli"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("cmd_")]
    assert found == [], found


def test_the_driver_top_level_is_its_subpackages():
    top = sorted(f.name for f in (REPO / "matrix").glob("*.py"))
    subs = sorted(d.name for d in (REPO / "matrix").iterdir() if (d / "__init__.py").is_file())
    assert len(top) <= MAX_DRIVER_TOP_MODULES, top
    assert {"spec", "run", "cli"} <= set(subs), subs


def test_the_walk_sees_a_planted_upward_import_and_cycle(tmp_path, monkeypatch):
    """The checks above can fail: a store module importing matrix, and two modules importing each other."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "store" / "a.py").write_text("from matrix import b\n")
    (tmp_path / "matrix" / "b.py").write_text("def f():\n    import store.a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    g = graph()
    assert g["store.a"] == {"matrix.b"} and g["matrix.b"] == {"store.a"}
    _fails_naming(test_every_import_goes_down_a_layer, "store.a imports matrix.b")
    _fails_naming(test_no_import_cycles, "matrix.b", "store.a")
    (tmp_path / "store" / "c.py").write_text("from store.nowhere import x\n")
    _fails_naming(test_every_project_import_names_a_module, "store/c.py:1 store.nowhere")


def _fails_naming(check, *names: str) -> None:
    """The check fails, and its message names each of `names`."""
    try:
        check()
    except AssertionError as e:
        assert all(n in str(e) for n in names), (names, str(e))
    else:
        raise AssertionError(f"{check.__name__} saw nothing planted")


# The core that loops over the plug-ins (extras/): its code names no plug-in's axis; comments and
# docstrings may, to say why.
CORE = ("matrix/spec", "matrix/run", "store/schema.py", "analysis/sql.py", "analysis/card.py", "analysis/report.py")
PLUGIN_WORDS = ("batch", "kv_cache", "kv cache", "kv-cache")


def code_words(source: str) -> list[tuple[int, str]]:
    """(line, word) of every identifier and string in the code, docstrings left out."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.alias):
            out.append((node.lineno, node.name))
    return out


def test_the_core_names_no_plug_ins_axis():
    files = [f for c in CORE for f in sorted((REPO / c).rglob("*.py") if (REPO / c).is_dir() else [REPO / c])]
    named = [
        f"{f.relative_to(REPO)}:{line}: {word[:60]!r}"
        for f in files
        for line, word in code_words(f.read_text())
        if any(w in word.lower() for w in PLUGIN_WORDS)
    ]
    assert len(files) > 20 and named == [], "\n".join(named)


def test_the_core_check_sees_a_name_in_code_not_in_a_docstring():
    planted = 'def f(cell):\n    """A batch cell."""\n    # the kv_cache of it\n    return cell.batch\n'
    assert [w for _, w in code_words(planted) if "batch" in w] == ["batch"]


def test_the_spec_reaches_engines_only_through_the_registry():
    """matrix/spec/ imports the registry (backends) and the contract (backends.base), no engine
    module: tokenising with a GGUF's vocabulary, keeping it, a checkpoint's dtype go through
    backends.for_files and the Backend class methods."""
    spec = {m: deps for m, deps in graph().items() if m.startswith("matrix.spec")}
    engine = [
        f"{m} imports {d}"
        for m, deps in spec.items()
        for d in sorted(deps)
        if d.startswith("backends.") and d != "backends.base"
    ]
    assert len(spec) > 10 and engine == [], "\n".join(engine)
