"""A run's own bookkeeping: its runs row when it starts and when it ends, and what it returns.

The scheduler (matrix/run/execute.py) calls these in order: begin() before any cell starts,
error() when the run raises, end() whatever happened, summary() when it succeeded. The rows
themselves are built by store/rows.py; a run whose end cannot be written leaves a marker
(matrix/run/failures.py) that mark_interrupted_runs() records on the next run.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable

from common import ids
from matrix import __version__
from matrix.run import failures
from matrix.run.outcome import Outcomes
from matrix.run.plan import Plan
from store import SCHEMA_VERSION, Warehouse
from store import rows as R


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "logit-matrix": __version__}
    for dist in (
        "numpy",
        "pyarrow",
        "duckdb",
        "ray",
        "pyyaml",
        "torch",
        "transformers",
        "accelerate",
        "safetensors",
        "gguf",
        "tokenizers",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def mark_interrupted_runs(wh: Warehouse, log: Callable[[str], None]) -> None:
    """Runs still 'running' while we hold the writer lock were killed, or could not record their
    end (a marker on this machine says how they ended): say so."""
    markers = failures.read_markers(wh.where)
    for run in wh.read_all("runs"):
        if run["status"] == "running":
            m = markers.get(run["run_id"]) or {
                "status": "interrupted",
                "error": "the process ended before the run finished",
            }
            wh.write_rows(
                "runs",
                run["run_id"],
                [R.run_finished(run, m["status"], finished_at=run["finished_at"], error=m["error"])],
            )
            failures.drop_marker(wh.where, run["run_id"])
            log(
                f"run {run['run_id']} ended {m['status']}"
                + (f" ({m['error']})" if m["error"] else "")
                + "; resuming its work"
            )


def begin(
    plan: Plan,
    wh: Warehouse,
    argv: list[str],
    address: str | None,
    executor: str,
    log: Callable[[str], None],
    nonce: str,
) -> dict:
    """Under the writer lock, before any cell starts: tidy what a killed run left, write the
    prompts, and the run's own row (status running)."""
    spec = plan.spec
    wh.create()
    wh.write_probe(nonce)
    mark_interrupted_runs(wh, log)  # also done by matrix.api.run before planning; here for direct callers
    for p in wh.sweep_tmp():
        log(f"removed a partial file left by an interrupted run: {p}")
    for m in plan.models.values():
        for p in m.prompts:
            if not wh.has_rows("prompts", p.prompt_id):
                wh.write_rows("prompts", p.prompt_id, [R.prompt_row(**p.to_row(), n_tokens=len(p.token_ids))])
    run = R.run_row(
        ids.run_id(),
        "running",
        started_at=R.now(),
        finished_at=None,
        spec_name=spec.name,
        spec_path=str(spec.path),
        spec_sha256=spec.sha256,
        spec_yaml=spec.raw_text,
        argv=json.dumps(argv),
        pid=os.getpid(),
        ray_address=(address or "local") if executor == "ray" else None,
        executor=executor,
        logit_matrix_version=__version__,
        schema_version=SCHEMA_VERSION,
        versions=json.dumps(library_versions(), sort_keys=True),
        cells_total=len(plan.cells),
        cells_done=len(plan.complete),
        rows_written=0,
        error=None,
    )
    wh.write_rows("runs", run["run_id"], [run])
    return run


def error(e: Exception, wh: Warehouse, run: dict) -> Exception | None:
    """The run's error, in its row's first line; a driver-side write that hit full or failing
    storage comes back as the StorageError to raise instead (the same one line as an actor's)."""
    full = failures.storage_error(e)
    if full is not None:
        e = failures.StorageError(failures.storage_line(full, wh.where))
    err = getattr(e, "cause", None) or e  # the actor's own exception, not Ray's wrapper
    run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
    return e if full is not None else None


def end(wh: Warehouse, run: dict, status: str, out: Outcomes, log: Callable[[str], None]) -> OSError | None:
    """The run's last row: how it ended and what it captured. When the warehouse cannot take it
    (its disk is full), the outcome goes to a marker in this machine's cache for the next run to
    record. Returns that write's error."""
    row = R.run_finished(
        run,
        status,
        cells_done=out.cells_done,
        rows_written=out.rows,
        rows_delivery=json.dumps(out.via),
        cells_failed=len(out.failed),
    )
    try:
        wh.write_rows("runs", row["run_id"], [row])
        return None
    except OSError as e:
        path = failures.leave_marker(wh.where, row["run_id"], row["status"], row["error"])
        log(
            f"could not record the end of run {row['run_id']} in the warehouse "
            f"({failures.storage_line(e, wh.where) if failures.storage_error(e) else e}); kept in {path}, "
            "for the next run to record"
        )
        return e


def summary(plan: Plan, out: Outcomes, run: dict, cells_run: int) -> dict:
    """What a run returns (matrix.api.RunResult's fields)."""
    elapsed = time.perf_counter() - out.t0
    return {
        "run_id": run["run_id"],
        "cells_total": len(plan.cells),
        "cells_done": out.cells_done,
        "cells_run": cells_run,
        "rows_written": out.rows,
        "seconds": round(elapsed, 2),
        "rows_per_second": round(out.rows / max(elapsed, 1e-9), 2),
        "rows_delivery": out.via,
        "metrics_in_actor": out.inline_written,
        "skipped": plan.matrix.skipped,
        "left_out": plan.left_out,
        "reused": plan.reused,
        "failed": {cid: f.line() for cid, f in out.failed.items()},
        "bad_input": next((f.message for f in out.failed.values() if f.bad_input), None),
    }
