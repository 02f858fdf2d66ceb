"""`matrix analyze`: metrics of every stack against its reference and against the centroid of stacks.

The work is cut into units, each written as whole files when it finishes:

    cell unit   metrics/<cell_id>.parquet                 every row of every repeat vs the reference's repeat 0
    group unit  centroid_metrics/<model>[.<group>].parquet repeat 0 of each stack vs the centroid of its group
                pairwise/<model>[.<group>].parquet         mean JS and top-1 agreement of every pair of stacks
    (always)    metrics_ranges/ranges.parquet             the position buckets the summary views use

Units stream their shards (analysis/compare.py, analysis/centroid.py), so memory does not grow
with the corpus. Each output file keeps a content key of its inputs in its Parquet metadata:
the shards' row hashes, the metric kernel's version, the centroid definition and members. A unit
whose key is unchanged is not redone (`--force` redoes it), so a second analyze does no metric
work, one new cell costs its own metrics plus its group's centroid, and an interrupted analyze
resumes where it stopped. `run_units` lets the caller spread units over a Ray cluster. The units,
their keys and their pieces are planned in analysis/units.py.

A row with NaN/Inf logits is flagged (metrics.nonfinite, centroid_metrics.nonfinite), its
metrics are null and it stays out of every centroid and mean; analyze says so per cell.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from analysis import metrics as M
from analysis import metrics_native
from analysis.centroid import Group, group_rows
from analysis.compare import CellResult, cell_metrics, with_floor
from analysis.unit_keys import as_measured, cell_key
from analysis.units import Task, Unit, keep_pairs, plan
from common.errors import UserError
from store import Warehouse
from store.cell_rows import CellRow
from store.floors import StorageFloor
from store.stream import shard_index

DEFAULT_RANGES = (0, 512, 2048, 8192)
HEARTBEAT_S = 60


def store_inline(wh: Warehouse, cell: CellRow, ref: CellRow, measured: dict[int, dict], log) -> bool:
    """Write the metrics a cell's actor measured while capturing (`reference_metrics: in_actor`)
    as analyze would, under the key analyze computes: a later analyze finds the unit done. False
    (nothing written) unless every repeat the unit covers was measured against this reference."""
    cid, ref_id = cell.cell_id, ref.cell_id
    want = [r for r in range(cell.repeats) if not (cid == ref_id and r == 0)]
    if not want or any(measured.get(r, {}).get("reference") != ref_id or "table" not in measured[r] for r in want):
        return False
    floor = StorageFloor.of_cell(ref) + StorageFloor.of_cell(cell)
    shards = {r: shard_index(wh, cid, r).digest for r in range(cell.repeats)}
    result = CellResult()
    for r in want:
        result.tables[r], result.counts[r] = with_floor(measured[r]["table"], floor), measured[r]["counts"]
    u = Unit(
        "cell",
        cid,
        cell_key(ref_id, shard_index(wh, ref_id, 0).digest, floor, shards),
        0,
        {"cell_id": cid, "ref_id": ref_id},
    )
    summary = {"damaged": [], "nonfinite_rows": 0, "unaligned_rows": {}, "cells": 0, "metric_rows": 0}
    _write(wh, u, result, summary, log, computed_in="actor")
    if not wh.table_files("metrics_ranges"):
        _write_ranges(wh, DEFAULT_RANGES)
    return True


def run_task(where: str, task: Task, skip_damaged: bool = False):
    """Compute one piece (in this process, or inside a Ray task): small results only."""
    wh = Warehouse(where)
    a = task.args
    if task.kind == "cell":
        return cell_metrics(wh, a["cell_id"], a["repeats"], a["ref_id"], a["floor"], skip_damaged, task.prompts)
    return group_rows(wh, a["ids"], a["centroid"], a["group"], task.prompts, a.get("pairs"))


def run_locally(where: str, tasks: list[Task], skip_damaged: bool, done: Callable) -> None:
    for t in tasks:
        done(t, run_task(where, t, skip_damaged))


def _reusable(wh: Warehouse, u: Unit) -> dict | None:
    """The unit's stored metadata when every output file of it holds this key, else None."""
    tables = ("metrics",) if u.kind == "cell" else ("centroid_metrics", "pairwise")
    metas = [wh.table_meta(t, u.name) or {} for t in tables]
    return metas[0] if all(m.get("key") == u.key for m in metas) else None


def _todo(wh: Warehouse, units: list[Unit], force: bool, summary: dict, log) -> list[Unit]:
    """The units to compute; the others' stored outputs are counted in summary as reused."""
    todo = []
    for u in units:
        kept = None if force else _reusable(wh, u)
        if kept is None and u.kind == "cell":  # a cell whose values were not kept is not measured again
            kept = as_measured(wh, u.name, u.args["key_parts"], wh.table_meta("metrics", u.name), log)
        if kept is None:
            if u.kind == "group":
                keep_pairs(wh, u, force)
            todo.append(u)
            continue
        summary["reused"]["cells" if u.kind == "cell" else "groups"] += 1
        summary["cells" if u.kind == "cell" else "groups"] += 1
        summary["metric_rows"] += kept.get("rows", 0) if u.kind == "cell" else 0
    return todo


def _drop_stale_groups(wh: Warehouse, units: list[Unit], log) -> None:
    """Remove the centroid and pairwise files of groups a model no longer has (relabelled
    groups): left in place, the views would mix them with the current ones."""
    planned = {u.name for u in units if u.kind == "group"}
    models = {u.args["model"] for u in units if u.kind == "group"}
    for table in ("centroid_metrics", "pairwise"):
        for path in wh.table_files(table):
            name = path.rsplit("/", 1)[-1].removesuffix(".parquet")
            if name not in planned and any(name == m or name.startswith(m + ".") for m in models):
                wh.remove_table(table, name)
                log(f"removed {table}/{name}.parquet: no such centroid group now")


def analyze(
    warehouse: str,
    reference: str | None = None,
    ranges=DEFAULT_RANGES,
    centroid: str | None = None,
    log: Callable[[str], None] = print,
    skip_damaged: bool = False,
    force: bool = False,
    run_units: Callable = run_locally,
    *,
    side,
) -> dict:
    """side: (name, analysis) of each plug-in's tables, run after the stacks' metrics
    (extras.analyses(): batch drift, layers, the side files' paths); the caller says which, so no
    table is left out unseen."""
    wh = Warehouse(warehouse).require()
    with wh.lock():  # one writer at a time: a run in progress would change the cells under us
        wh.migrate(log)
        return _analyze(wh, reference, ranges, centroid, log, skip_damaged, force, run_units, side)


@dataclass
class Progress:
    """Rows compared so far, of how many, since when; a heartbeat while nothing finishes."""

    total: int
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        rate = self.done / max(el, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        return f"{self.done}/{self.total} rows | {rate:.0f} rows/s | ETA {eta:.0f}s"


def _analyze(wh: Warehouse, reference, ranges, centroid, log, skip_damaged: bool, force: bool, run_units, side) -> dict:
    done = _done_cells(wh, reference)
    if centroid is None:
        asked = {c.get("centroid") for c in done} - {None}
        centroid = asked.pop() if len(asked) == 1 else "mean_prob"
    summary = {
        "cells": 0,
        "metric_rows": 0,
        "groups": 0,
        "nonfinite_rows": 0,
        "centroid": centroid,
        "unaligned_rows": {},
        "skip_damaged": skip_damaged,
        "damaged": [],
        "reused": {"cells": 0, "groups": 0},
        "kernel_version": M.KERNEL_VERSION,
    }
    units = plan(wh, done, reference, centroid, summary, log)
    _drop_stale_groups(wh, units, log)
    todo = _todo(wh, units, force, summary, log)
    tasks = [t for u in todo for t in u.tasks()]
    why = f": {metrics_native.failure()}" if M.kernel_mode() == "numpy" else ""
    log(
        f"metrics kernel {M.KERNEL_VERSION}: {M.kernel_mode()}{why} (float64), {metrics_native.threads()} thread(s); "
        f"{len(todo)} of {len(units)} unit(s) to compute in {len(tasks)} piece(s)"
        + (f", {len(units) - len(todo)} up to date" if len(todo) < len(units) else "")
    )
    progress = _compute(wh, todo, tasks, summary, log, skip_damaged, run_units)
    _write_ranges(wh, ranges)
    for name, part in side:  # the plug-ins' tables: batch_metrics, layer_metrics, decode_metrics
        got = part(wh, done, reference, force, log)
        if got is not None:
            summary[name] = got
    summary["computed"] = {"cells": sum(u.kind == "cell" for u in todo), "groups": sum(u.kind == "group" for u in todo)}
    summary["seconds"] = round(time.perf_counter() - progress.t0, 2)
    return summary


def _done_cells(wh: Warehouse, reference: str | None) -> list[CellRow]:
    """The captured cells; there must be some, and --reference must be one of them."""
    done = wh.cell_rows("done")
    if not done:
        raise UserError(f"{wh.where}: no captured cells to analyze (the warehouse has no logits)")
    if reference is not None and reference not in {c.cell_id for c in done}:
        raise UserError(f"--reference {reference}: no captured cell with that id in {wh.where}")
    return done


def _compute(wh: Warehouse, todo: list[Unit], tasks: list[Task], summary: dict, log, skip_damaged, run_units):
    """Run the pieces (run_units); each unit is merged and written as soon as its last piece is
    back. Its Progress, whose t0 is when the computing began."""
    progress = Progress(sum(u.rows for u in todo))
    by_name = {(u.kind, u.name): u for u in todo}
    parts: dict[tuple, dict[int, object]] = {}
    finished = [0]

    def record(t: Task, result) -> None:
        got = parts.setdefault((t.kind, t.name), {})
        got[t.piece] = result
        progress.done += t.rows
        progress.last = time.perf_counter()
        u = by_name[(t.kind, t.name)]
        if len(got) == len(u.pieces):  # the unit is whole: merge its pieces (prompt order), write it
            pieces = [got[i] for i in range(len(u.pieces))]
            _write(wh, u, CellResult.merge(pieces) if u.kind == "cell" else Group.merge(pieces), summary, log)
            del parts[(t.kind, t.name)]
            finished[0] += 1
            log(f"[analyze {finished[0]}/{len(todo)}] {u.kind} {u.name} | {progress.line()}")

    with _heartbeat(progress, lambda: f"{finished[0]}/{len(todo)} unit(s)", log):
        run_units(wh.where, tasks, skip_damaged, record)
    return progress


@contextmanager
def _heartbeat(progress: Progress, what: Callable[[], str], log, every: float = HEARTBEAT_S):
    """A line every `every` seconds in which no unit finished, from a thread beside the work."""
    stop = threading.Event()

    def beat():
        while not stop.wait(every / 4):
            quiet = time.perf_counter() - progress.last
            if quiet >= every:
                log(f"heartbeat: {what()} done, nothing finished for {quiet:.0f}s | {progress.line()}")
                progress.last = time.perf_counter()

    t = threading.Thread(target=beat, name="analyze-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _write(wh: Warehouse, u: Unit, result, summary: dict, log, computed_in: str = "analyze") -> None:
    meta = {"key": u.key, "kernel_version": M.KERNEL_VERSION, "computed_in": computed_in}
    if u.kind == "cell":
        if result.damaged:  # left-out rows: computed again (and reported again) next time
            meta.pop("key")
        for note in result.notes(u.name, u.args["ref_id"]):
            log(note)
        summary["damaged"] += [why for _, why in sorted(result.damaged.items())]
        summary["nonfinite_rows"] += result.nonfinite_rows
        if result.unaligned:
            summary["unaligned_rows"][u.name] = result.unaligned
        if result.table is None:
            wh.remove_table("metrics", u.name)  # not a stale result from an earlier analysis
            return
        wh.write_table("metrics", u.name, result.table, {**meta, "rows": result.table.num_rows})
        summary["cells"] += 1
        summary["metric_rows"] += result.table.num_rows
        return
    cent, pair = result.tables(u.args["ref_id"], u.args["group"])
    kept = set(u.args.get("kept", ()))
    if kept:
        old = pa.Table.from_pylist(
            [r for r in wh.read_rows("pairwise", u.name) if f"{r['cell_a']}|{r['cell_b']}" in kept]
        )
        pair = pa.concat_tables([pair, old.select(pair.column_names).cast(pair.schema)])
        pair = pair.sort_by([("cell_a", "ascending"), ("cell_b", "ascending")])
    wh.write_table("centroid_metrics", u.name, cent, meta)
    wh.write_table("pairwise", u.name, pair, {**meta, "pairs": u.args["pair_keys"]})
    log(
        f"[{u.args['model']}] centroid group {u.args['group']}: {len(u.args['ids'])} stack(s), {cent.num_rows} rows, "
        f"{pair.num_rows} pair(s)" + (f" ({len(kept)} kept: neither shard changed)" if kept else "")
    )
    summary["groups"] += 1


def _write_ranges(wh: Warehouse, ranges) -> None:
    edges = list(ranges)
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    wh.write_table(
        "metrics_ranges",
        "ranges",
        pa.table(
            {"lo": pa.array(edges, pa.int32()), "hi": pa.array(edges[1:] + [2**31 - 1], pa.int32()), "range": labels}
        ),
    )
