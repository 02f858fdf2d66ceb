"""`run()`: a spec captured into a warehouse, resuming what earlier runs left."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import UserError, first_line
from common.output import log as stderr_log
from matrix.api.results import RunResult


@dataclass(frozen=True)
class _Started:
    """The executor a run uses, the Ray module this call connected (to shut down at the end; None for
    the local executor or a connection the caller already held), and
    the nonce of a host started ahead of the run (matrix/run/early.py), or None."""

    executor: object
    ray: object = None
    nonce: str | None = None


def run(
    spec,
    warehouse: str = "warehouse",
    *,
    executor: str | None = None,
    address: str | None = None,
    cluster_config: str | None = None,
    reuse_cells_from_other_builds: bool = False,
    skip_failed: bool = False,
    recapture_damaged: bool = False,
    command: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Capture every cell of `spec` (a path, or a Matrix from matrix.spec.cells.load_spec) into
    `warehouse` (a directory or an s3:// / gs:// URI), resuming: complete cells are not captured again.

    executor: "ray" (a cluster: `address`'s, or one started here and stopped at the end) or "local"
    (worker processes of this machine, no Ray); default ray, local when ray cannot be imported.
    command: what the runs table records as the command (default: this process's argv).
    log: where progress lines go (default: stderr). Bad input raises common.errors.UserError; a
    cell's failure is the cell's own and is reported in the result."""
    from matrix.run import cluster, placement
    from matrix.spec.cells import load_spec
    from store import Warehouse

    t0 = time.perf_counter()
    log = log or stderr_log
    matrix = load_spec(spec) if isinstance(spec, (str, os.PathLike)) else spec
    if cluster_config:
        placement.node_types(cluster_config)  # a bad file fails here, before any work
    wh = Warehouse(warehouse)
    wh.check()  # an incompatible warehouse fails here, before anything is written
    for s in matrix.skipped:
        log(f"skipping {s['stack_id']}: {s['reason']}")
    kind = choose_executor(executor, address, cluster_config, log)
    resume = _resume(reuse_cells_from_other_builds, skip_failed, recapture_damaged, address)
    with cluster.signals_restored():
        early = _early(matrix, wh, log) if kind == "local" else None
        try:
            summary, plan = _sweep(matrix, wh, kind, address, cluster_config, resume, early, command or sys.argv, log)
        finally:
            if early is not None:  # a host started ahead that the run did not take over (it stopped early)
                early.executor.shutdown()
    return _result(summary, plan, wh, time.perf_counter() - t0, log)


def choose_executor(executor: str | None, address: str | None, cluster_config: str | None, log) -> str:
    """The executor asked for, or Ray when it can be imported (said in one line when it cannot)."""
    if executor not in (None, "ray", "local"):
        raise UserError(f"executor {executor!r}: ray or local")
    if executor == "local" and (address or cluster_config):
        flag = "--address" if address else "--cluster-config"
        raise UserError(f"--executor local runs on this machine alone: drop {flag}")
    if executor:
        return executor
    found = importlib.util.find_spec("ray")
    if found is not None and found.origin is not None:  # not a bare `ray/` directory (Ray's session dir in /tmp)
        return "ray"
    if address or cluster_config:
        raise UserError("--address / --cluster-config need Ray, and this interpreter cannot import ray")
    log("ray is not installed here: running every cell on this machine (--executor local)")
    return "local"


def _resume(reuse: bool, skip_failed: bool, recapture: bool, address: str | None):
    from matrix.run import runner

    return runner.Resume(reuse, skip_failed, recapture, own_cluster=not address)


def _early(matrix, wh, log) -> _Started | None:
    """The local executor of the run, its first host already loading where it can be (then with the
    nonce it was started with): that host starts while the driver tokenises (matrix/run/early.py).
    None: starting it ahead failed, and the run starts it itself."""
    from matrix.run import cluster, early, local

    local.check(matrix.cells)
    ex = local.LocalExecutor()
    cluster.sigterm_interrupts()
    try:
        nonce = early.start_first_host(matrix, wh, ex, log)
    except UserError:  # bad input: the line the run itself would give
        ex.shutdown()
        raise
    except Exception as e:  # noqa: BLE001 - said here; the run then starts that host itself
        ex.shutdown()
        log(f"the first cell's host starts with the run, not ahead of it: {first_line(str(e), type(e).__name__)}")
        return None
    return _Started(ex, None, nonce)  # the run's executor, whether or not a host started ahead


def _connect(kind: str, address: str | None, cluster_config: str | None) -> _Started:
    from matrix.run import cluster, placement

    if kind == "local":
        from matrix.run.local import LocalExecutor

        cluster.sigterm_interrupts()
        return _Started(LocalExecutor())
    config = cluster_config or placement.default_cluster_config(address)
    owned = not cluster.connected()
    ray = cluster.init_ray(address)  # first: Ray reads its auth settings when it is first imported
    from matrix.run.ray_executor import RayExecutor

    return _Started(RayExecutor(config), ray if owned else None)


def _sweep(matrix, wh, kind, address, cluster_config, resume, early, command, log) -> tuple[dict | None, object]:
    """Prepare, then under the warehouse's lock: migrate, bind to the nodes' builds, execute what is left."""
    from matrix.run import execute, placement, record, runner

    plan = runner.prepare(matrix, wh, log)
    summary = None
    wh.create()
    with wh.lock(log):
        wh.migrate(log)
        record.mark_interrupted_runs(wh, log)  # even when nothing is left to do
        started = early or _connect(kind, address, cluster_config)
        ex = started.executor
        try:
            nodes = ex.nodes()
            if cluster_config or (kind == "ray" and ex.cluster_config):
                log(f"node types from {ex.cluster_config}: " + ", ".join(n.node_type for n in nodes if n.node_type))
            placement.check_placement(matrix.cells, nodes, log)
            plan = runner.bind(plan, wh, ex, log, resume, nodes)
            runner.regroup_complete_cells(plan, wh, log)
            if early:
                ex.keep_early(set(plan.todo))
            if plan.todo:
                summary = execute.execute(plan, wh, command, address, log, ex, started.nonce)
        finally:
            if started.ray is not None:
                started.ray.shutdown()
    return summary, plan


def _result(summary: dict | None, plan, wh, wall_s: float, log) -> RunResult:
    if summary is not None:
        log(
            f"run {summary['run_id']}: {summary['cells_done']}/{summary['cells_total']} cells complete, "
            f"{summary['rows_written']} rows in {summary['seconds']}s ({summary['rows_per_second']} rows/s)"
        )
        result = RunResult(**{**summary, "skipped": tuple(summary["skipped"])}, wall_s=round(wall_s, 2))
        if result.failed:
            log(f"{len(result.failed)} cell(s) FAILED (run again to retry them, or --skip-failed):")
            for cid, why in result.failed.items():
                log(f"  {cid}: {why}")
        return result
    log(
        f"nothing to do: all {len(plan.cells)} cell(s) are complete in {wh.where}"
        + (f" ({len(plan.left_out)} left out this time)" if plan.left_out else "")
    )
    return RunResult(
        cells_total=len(plan.cells),
        cells_done=len(plan.complete),
        cells_run=0,
        rows_written=0,
        wall_s=round(wall_s, 2),
        skipped=tuple(plan.matrix.skipped),
        left_out=dict(plan.left_out),
        reused=dict(plan.reused),
    )
