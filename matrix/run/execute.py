"""A bound plan executed: the run's own row, every unfinished cell started on the executor
(matrix/run/launch.py: Ray's or this machine's), and the run's end recorded whatever happens.

With Ray the caller (matrix.api) owns the connection: this module expects `ray` to be initialised
and never shuts it down. The rows of the small tables are built by store/rows.py.
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
from matrix.run.plan import Plan
from matrix.run.sweep import Sweep
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


def _record_end(wh: Warehouse, row: dict, log: Callable[[str], None]) -> OSError | None:
    """The run's last row; when the warehouse cannot take it (its disk is full), the outcome goes
    to a marker in this machine's cache for the next run to record. Returns that write's error."""
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


def _begin(
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
    run_id = ids.run_id()
    run = R.run_row(
        run_id,
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
    wh.write_rows("runs", run_id, [run])
    return run


# How long the end of a run waits for its killed hosts to be gone: a bound for a host that never
# goes, not a measure of how long one takes (on a loaded machine a kill takes seconds to arrive).
GONE_S = 120.0


def wait_exited(pids: list[int], timeout_s: float = GONE_S) -> list[int]:
    """Until these processes of this machine have exited; returns those still running at the bound.
    A killed Ray actor is reported dead before its process is gone, and until then a file it holds
    open (a partial shard it was writing, already unlinked) keeps its space: on a full disk the
    run's end could not be written."""
    end = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < end and _running(pid):
            time.sleep(0.05)
    return [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no files; its parent reaps it when it will)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid still exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def execute(
    plan: Plan,
    wh: Warehouse,
    argv: list[str],
    address: str | None,
    log: Callable[[str], None],
    ex,
    nonce: str | None = None,
) -> dict:
    """Run every unfinished cell of a bound plan (bind()) on the executor ex (launch.Executor);
    returns a summary. nonce: this run's, when a host was started with it ahead of the run."""
    cells = {c.cell_id: c for c in plan.cells}
    todo = [cells[cid] for cid in plan.todo]
    todo.sort(key=lambda c: c.cell_id not in plan.reference_cells.values())  # the reference first
    nonce = nonce or ids.probe_nonce()
    run = _begin(plan, wh, argv, address, ex.name, log, nonce)
    sweep, status = Sweep(plan, wh, run, ex, log, ex.open(wh.where, nonce)), "failed"
    try:
        for cell in todo:
            sweep.start(cell)
        waiting = sum(len(v) for v in sweep.waiting.values())
        log(
            f"{len(todo)} cell(s) to run, {sweep.out.units_total} capture(s); {len(plan.complete)} already complete"
            + (f"; {waiting} start once their reference is done (reference_metrics: in_actor)" if waiting else "")
        )
        sweep.loop()
        status = "done"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        storage = _record_error(e, wh, run)
        if storage is not None:
            raise storage from None
        raise
    finally:
        _stop(sweep, ex, wh, log)
        unrecorded = _record_end(wh, _finished_row(run, status, sweep), log)
    if unrecorded is not None:
        raise unrecorded
    return _summary(plan, sweep, run, len(todo))


def _record_error(e: Exception, wh: Warehouse, run: dict) -> Exception | None:
    """The run's error, in its row's first line; a driver-side write that hit full or failing
    storage comes back as the StorageError to raise instead (the same one line as an actor's)."""
    full = failures.storage_error(e)
    if full is not None:
        e = failures.StorageError(failures.storage_line(full, wh.where))
    err = getattr(e, "cause", None) or e  # the actor's own exception, not Ray's wrapper
    run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
    return e if full is not None else None


def _finished_row(run: dict, status: str, sweep: Sweep) -> dict:
    """The run's last row: how it ended and what it captured."""
    return R.run_finished(
        run,
        status,
        cells_done=sweep.out.cells_done,
        rows_written=sweep.out.rows,
        rows_delivery=json.dumps(sweep.out.via),
        cells_failed=len(sweep.out.failed),
    )


def _stop(sweep: Sweep, ex, wh: Warehouse, log: Callable[[str], None]) -> None:
    """Every host of the run stopped, and what the stopped ones were writing removed: the hosts
    stopped at the end and those a failure stopped earlier (sweep.stopped), each waited for until
    it is gone, so no file one of them still holds open keeps its space when the run's end is written."""
    ex.shutdown()  # first: no host still waiting for its turn starts while the others stop
    for cid in list(sweep.live):
        sweep.drop(cid)
    if sweep.stopped:  # a stopped run leaves no temp file: its killed actors' partial shards go too
        ex.wait_gone([a for lv in sweep.stopped for a in lv.started.actors], timeout_s=GONE_S)
        node = platform.node()
        wait_exited([lv.loaded["pid"] for lv in sweep.stopped if lv.loaded and lv.loaded.get("host") == node], GONE_S)
        for p in wh.sweep_tmp():
            log(f"removed the partial file of a stopped capture: {p}")


def _summary(plan: Plan, sweep: Sweep, run: dict, cells_run: int) -> dict:
    """What execute() returns (matrix.api.RunResult's fields)."""
    elapsed = time.perf_counter() - sweep.out.t0
    return {
        "run_id": run["run_id"],
        "cells_total": len(plan.cells),
        "cells_done": sweep.out.cells_done,
        "cells_run": cells_run,
        "rows_written": sweep.out.rows,
        "seconds": round(elapsed, 2),
        "rows_per_second": round(sweep.out.rows / max(elapsed, 1e-9), 2),
        "rows_delivery": sweep.out.via,
        "metrics_in_actor": sweep.out.inline_written,
        "skipped": plan.matrix.skipped,
        "left_out": plan.left_out,
        "reused": plan.reused,
        "failed": {cid: f.line() for cid, f in sweep.out.failed.items()},
        "bad_input": next((f.message for f in sweep.out.failed.values() if f.bad_input), None),
    }
