"""`matrix cells --warehouse W`: which engine builds captured each stack, and what a run would do.

The build a run would use is the cluster's (probed, with --address) or else this machine's: a
local run's actors import the driver's libraries, or the interpreter the backend's runtime_env
names (vLLM), asked here the same way the probe task asks.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from backends import backend_class
from common.builds import describe, engine_build
from common.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _local_build(cell) -> str | None:
    cls = backend_class(cell.engine)
    env = cls.runtime_env(cell.stack, cell.threads or 1) or {}
    return _interpreter_build(env.get("py_executable"), cls.libraries, cell.engine)


@functools.lru_cache(maxsize=None)
def _interpreter_build(python: str | None, libraries: tuple[str, ...], engine: str) -> str | None:
    """The build of `libraries` as `python` sees them (None: this interpreter); once per
    interpreter and engine, however many cells share them."""
    if not python:
        return engine_build(libraries)["build"]
    if not os.access(python, os.X_OK):
        return None
    code = "import json, sys; from common.builds import engine_build; print(json.dumps(engine_build(sys.argv[1:])))"
    r = subprocess.run(
        [python, "-c", code, *libraries],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    if r.returncode != 0:
        raise UserError(
            f"{python}: could not read the {engine} build: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return json.loads(r.stdout)["build"]


def build_columns(matrix, warehouse: str, answers: dict | None) -> dict[str, dict]:
    """stack id -> {"build": the build a run would use (None: unknown here), "captured": [...],
    "action": complete | capture | capture again (...)}."""
    from matrix.run import builds
    from store import Warehouse

    wh = Warehouse(warehouse)
    rows = [r for r in wh.read_all("cells") if r["status"] == "done"] if wh.check() else []
    by_stack: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["finished_at"]):
        libs = json.loads(r["build_libraries"]) if r.get("build_libraries") else None
        by_stack.setdefault(r["cell_id"].partition("@")[0], []).append(
            {
                "cell_id": r["cell_id"],
                "build": r.get("build"),
                "host": r["host"],
                "repeats": r["repeats"],
                "libraries": describe(libs) if libs else None,
            }
        )
    if answers is not None:
        bound, _, _ = builds.bind(matrix.cells, answers, builds.captured_builds(rows), lambda m: None)
        current = {c.stack_id: c.build for c in bound}
    else:
        current = {c.stack_id: _local_build(c) for c in matrix.cells}
    out = {}
    for c in matrix.cells:
        got, build = by_stack.get(c.stack_id, []), current.get(c.stack_id)
        full = [g for g in got if (g["repeats"] or 0) >= matrix.spec.repeats]
        if build and any(g["build"] == build for g in full):
            action = "complete"
        elif full:
            action = (
                f"capture again as build {build or '?'} (or --reuse-cells-from-other-builds: {full[-1]['cell_id']})"
            )
        else:
            action = "capture"
        out[c.stack_id] = {"build": build, "captured": got, "action": action}
    return out
