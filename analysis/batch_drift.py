"""Graded batch drift: each batch cell of size > 1 against the same stack at batch 1 (cells.batch_of),
every row of repeat 0 against repeat 0, with the reference metrics' kernel: KL, top-1, max |diff|
(0 where the row is bit-identical). One file per cell, batch_metrics/<cell_id>.parquet, under a
content key of both shards, so a second analyze recomputes nothing; the batch_drift view sums it.
`matrix analyze` runs it as the batch plug-in's analysis (extras/batch.py)."""

from __future__ import annotations

from analysis import metrics as M
from analysis.aggregates import agg
from analysis.compare import cell_metrics
from analysis.unit_keys import unit_key
from store import Warehouse
from store.floors import StorageFloor
from store.stream import shard_index
from store.verify import DamagedShard

TABLE = "batch_metrics"  # the metrics table's columns; reference_cell_id: the batch-1 cell

# The graded view: each batch cell (size > 1) against the same stack at batch 1 (batch_metrics),
# repeat 0 row by row: bit-identity on the row hashes, KL and top-1 where they differ, and beside
# it the cell's KL against the model's reference (metrics), so an invariant mode's cost shows too.
VIEW = "batch_drift"
VIEW_SQL = f"""
        WITH h AS (SELECT cell_id, prompt_id, position, row_hash FROM logits WHERE repeat = 0 AND path IS NULL),
        r AS (SELECT cell_id, {agg("mean", "kld")} AS kld_vs_reference FROM metrics WHERE repeat = 0 GROUP BY cell_id)
        SELECT c.model, c.engine, c.dtype, c.attention, c.options, c.batch_of AS stack_id_batch_1,
               m.reference_cell_id AS batch_1_cell_id, m.cell_id, c.batch_size,
               json_extract_string(c.batch, '$.fill') AS fill, count(*) AS rows,
               count(*) FILTER (WHERE ha.row_hash = hb.row_hash) AS identical_rows,
               bool_and(coalesce(ha.row_hash = hb.row_hash, false)) AS bit_identical,
               {agg("mean", "m.kld")} AS kld_mean, {agg("stderr", "m.kld")} AS kld_stderr,
               {agg("max", "m.kld")} AS kld_max, {agg("share", "m.top1_match")} AS top1_agreement,
               {agg("max", "m.max_abs_diff")} AS max_abs_diff,
               any_value(r.kld_vs_reference) AS kld_vs_reference
        FROM batch_metrics m JOIN cells c ON c.cell_id = m.cell_id
        LEFT JOIN h ha ON ha.cell_id = m.cell_id AND ha.prompt_id = m.prompt_id AND ha.position = m.position
        LEFT JOIN h hb ON hb.cell_id = m.reference_cell_id AND hb.prompt_id = m.prompt_id AND hb.position = m.position
        LEFT JOIN r ON r.cell_id = m.cell_id
        WHERE m.repeat = 0
        GROUP BY c.model, c.engine, c.dtype, c.attention, c.options, c.batch_of, m.reference_cell_id, m.cell_id,
                 c.batch_size, c.batch"""
VIEW_ABOUT = (
    "each batch cell (batch_size > 1) against the same stack at batch 1: rows bit-identical, and "
    "KL (mean, s.e., max), top-1 agreement and max |Δlogit| where they differ; with its KL against the reference"
)


def pairs(done: list[dict], log=lambda line: None) -> list[tuple[dict, dict]]:
    """(batch cell, its batch-1 cell) for every done cell of batch size > 1 whose batch-1 stack is
    captured: of the same engine build where there is one, else the newest. One without says so."""
    by_stack: dict[str, list[dict]] = {}
    for c in done:
        by_stack.setdefault(c.get("stack_id") or c["cell_id"], []).append(c)
    out = []
    for c in done:
        if (c.get("batch_size") or 0) < 2 or c.get("replica"):
            continue
        sibs = by_stack.get(c.get("batch_of"))
        if not sibs:
            log(f"NOTE {c['cell_id']}: no batch-1 capture of its stack ({c.get('batch_of')}): no batch drift")
            continue
        same = [s for s in sibs if s.get("build") == c.get("build")] or sibs
        out.append((c, max(same, key=lambda s: (s["finished_at"], s["cell_id"]))))
    return out


def analyze_batches(wh: Warehouse, done: list[dict], force: bool, log, skip_damaged: bool = False) -> dict | None:
    """batch_metrics for every pair (None: the warehouse has no batch cell to measure). A damaged
    shard stops it, unless skip_damaged: then that pair is left out, saying so."""
    todo = pairs(done, log)
    stale = {p.rsplit("/", 1)[-1].removesuffix(".parquet") for p in wh.table_files(TABLE)}
    stale -= {c["cell_id"] for c, _ in todo}
    for name in sorted(stale):  # a batch-1 cell no longer captured: its old comparison would mislead
        wh.remove_table(TABLE, name)
    if not todo:
        return None
    got = {"cells": 0, "rows": 0, "reused": 0}
    for cell, sib in todo:
        try:
            _measure(wh, cell, sib, force, log, got)
        except DamagedShard as e:
            if not skip_damaged:
                raise
            wh.remove_table(TABLE, cell["cell_id"])  # no older comparison stands in for it
            log(f"SKIPPED (damaged) batch drift of {cell['cell_id']}: {e}")
    return got


def _measure(wh: Warehouse, cell: dict, sib: dict, force: bool, log, got: dict) -> None:
    """One pair's batch_metrics file, unless the one there has this content key."""
    cid, sid = cell["cell_id"], sib["cell_id"]
    floor = StorageFloor.of_cell(sib) + StorageFloor.of_cell(cell)
    key = unit_key(pair=[cid, sid], digests=[shard_index(wh, i, 0).digest for i in (cid, sid)], floor=floor)
    got["cells"] += 1
    old = None if force else wh.table_meta(TABLE, cid)
    if old and old.get("key") == key:
        got["reused"] += 1
        got["rows"] += old.get("rows", 0)
        return
    result = cell_metrics(wh, cid, 1, sid, floor, skip_damaged=False)
    for note in result.notes(cid, sid):  # rows without a batch-1 partner, NaN/Inf rows
        log(note)
    table = result.table
    if table is None:
        wh.remove_table(TABLE, cid)
        return
    wh.write_table(TABLE, cid, table, {"key": key, "kernel_version": M.KERNEL_VERSION, "rows": table.num_rows})
    got["rows"] += table.num_rows
    log(f"[batch] {cid}: {table.num_rows} rows against batch 1 ({sid})")


def line(got: dict) -> str:
    return f"batch drift: {got['cells']} batch cell(s) against batch 1, {got['rows']} rows ({got['reused']} up to date)"
