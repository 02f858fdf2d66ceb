"""`analyze()` and `connect()`: every stack measured against its reference and the centroid, and
DuckDB over the warehouse with the derived views."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import extras
from common.errors import UserError
from common.output import log as stderr_log
from matrix.api.results import AnalyzeResult, QueryResult

if TYPE_CHECKING:
    import duckdb


def connect(warehouse: str) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with a view per warehouse table and the derived views (`summary`, ...)
    and row functions (kld, js, top1, ...); docs/warehouse.md lists them. Close it when done."""
    from analysis.sql import connect as views

    return views(warehouse)


def sql(warehouse: str, statement: str) -> QueryResult:
    """One read-only statement over the warehouse's views (a write is refused with UserError); only
    the tables and views it names are bound, so a small query stays cheap on a large warehouse."""
    from analysis.sql import query

    columns, rows = query(warehouse, statement)
    return QueryResult(tuple(columns), tuple(rows))


@dataclass(frozen=True)
class ViewsScript:
    """The warehouse's views as a SQL script for any DuckDB client (`duckdb -init FILE`)."""

    file: str
    tables: int
    views: int
    report: dict  # analysis/sql_export.py's: also each table's damaged files left out

    def to_dict(self) -> dict:
        return dict(self.report)


def export_views(warehouse: str, out: str) -> ViewsScript:
    """Write the table views (over the Parquet files, by glob) and the derived views to `out`."""
    from analysis.sql_export import export_views as write

    report = write(warehouse, out)
    return ViewsScript(report["file"], report["tables"], report["views"], report)


def analyze(
    warehouse: str = "warehouse",
    *,
    reference: str | None = None,
    centroid: str | None = None,
    ranges: list[int] | None = None,
    force: bool = False,
    skip_damaged: bool = False,
    workers: int | None = None,
    address: str | None = None,
    log: Callable[[str], None] | None = None,
) -> AnalyzeResult:
    """Measure every captured cell against its model's reference (or `reference`, a cell id) and
    against the centroid (`centroid`: mean_prob, mean_logprob or none; default the spec's), then run
    each per-cell extra's analysis. Only outputs whose inputs or metric kernel changed are computed
    again (force: every one). ranges: position bucket edges for summary_by_range.

    workers: pieces computed at once as Ray tasks (1: in this process; 0: one per CPU of the
    cluster); address: the cluster for them. With neither, the cluster the warehouse's last run used
    when it is still reachable, else this process."""
    from analysis.analyze import analyze as measure
    from matrix.run import cluster

    log = log or stderr_log
    side = extras.analyses(skip_damaged)  # each plug-in's: its partner cells, side tables, paths
    kw = {}
    if ranges:
        kw["ranges"] = tuple([0] + sorted({int(x) for x in ranges} - {0}))
    address = address or (last_cluster(warehouse, log) if workers is None else None)
    if address or (workers or 1) != 1:
        from matrix.run.analyze_ray import ray_runner

        kw["run_units"] = ray_runner(address, workers or 0, log)
    owned = not cluster.connected()  # a connection the pieces open is this call's to close
    try:
        with cluster.signals_restored():
            summary = measure(
                warehouse,
                reference,
                centroid=centroid,
                log=log,
                skip_damaged=skip_damaged,
                force=force,
                side=[s[:2] for s in side],
                **kw,
            )
    finally:
        cluster.release(owned)
    log(f"analyzed {summary['cells']} cell(s), {summary['metric_rows']} rows in {summary['seconds']}s")
    for name, _, line in side:
        if summary.get(name):
            log(line(summary[name]))
    return AnalyzeResult(summary["cells"], summary["metric_rows"], summary["seconds"], summary)


def last_cluster(warehouse: str, log) -> str | None:
    """The cluster the newest `matrix run` ran on, when it is still there: analyze runs on it by
    default. None for a run on this machine (a local cluster or the local executor), or a cluster
    that is gone (then analyze stays in this process)."""
    from matrix.run.cluster import check_reachable
    from store import Warehouse

    runs = [
        r
        for r in Warehouse(warehouse).require().read_all("runs")  # sweeps driven from here, not imports
        if r.get("started_at")
        and r.get("host") == socket.gethostname()  # nor runs merged from elsewhere
        and (r.get("ray_address") or r.get("executor") == "local")
    ]
    last = max(runs, key=lambda r: r["started_at"], default=None)
    if last is None or last.get("executor") == "local" or last["ray_address"] == "local":
        return None
    try:
        check_reachable(last["ray_address"], timeout=2.0)
    except UserError as e:
        log(f"the last run's cluster is not reachable ({e}); analyzing in this process")
        return None
    log(f"the last run ran on {last['ray_address']}: analyzing there (--workers 1 keeps it in this process)")
    return last["ray_address"]
