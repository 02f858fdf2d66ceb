"""Grading against a partner cell: each cell a plug-in pairs with another (extras.Extra.partner:
batch N with the same stack at batch 1, a quantised KV cache with the same stack on f16), every
row of repeat 0 against the partner's repeat 0, with the reference metrics' kernel: KL, top-1, max
|diff| (0 where the row is bit-identical). One file per cell in the plug-in's table, under a
content key of both shards, so a second analyze recomputes nothing; the plug-in's view sums it."""

from __future__ import annotations

from dataclasses import dataclass

from analysis.aggregates import agg
from store.cell_rows import CellRow

# The measuring modules are imported where a pair is measured: the plug-ins' column and table
# names (read whenever the store's schema is) come from modules that import only this one.


@dataclass(frozen=True)
class Partnering:
    """One plug-in's grading: its table (the metrics table's columns; reference_cell_id: the
    partner), the cells column with the partner's stack id, and its words in the log."""

    name: str  # e.g. "batch": "[batch] ... rows against batch 1", "no batch drift"
    title: str  # the analysis line's words: "batch", "KV cache"
    table: str
    column: str
    partner: str  # the partner in words: "batch 1"
    partner_capture: str  # "batch-1": "no batch-1 capture of its stack"
    cells: str  # what the analysis line calls the cells it measured: "batch cell(s)"


def view_sql(table: str, columns: str, group_by: str) -> str:
    """A plug-in's graded view over its table: the stack, `columns` (its own: the batch size, the
    K and V types; `group_by` groups by them), then what every grading against a partner gives,
    repeat 0 row by row: bit-identity on the row hashes, KL and top-1 where they differ, and the
    cell's KL against the model's reference beside it (so an invariant mode's cost shows too)."""
    return f"""
        WITH h AS (SELECT cell_id, prompt_id, position, row_hash FROM logits WHERE repeat = 0 AND path IS NULL),
        r AS (SELECT cell_id, {agg("mean", "kld")} AS kld_vs_reference FROM metrics WHERE repeat = 0 GROUP BY cell_id)
        SELECT c.model, c.engine, c.dtype, c.attention, {columns}, count(*) AS rows,
               count(*) FILTER (WHERE ha.row_hash = hb.row_hash) AS identical_rows,
               bool_and(coalesce(ha.row_hash = hb.row_hash, false)) AS bit_identical,
               {agg("mean", "m.kld")} AS kld_mean, {agg("stderr", "m.kld")} AS kld_stderr,
               {agg("p99", "m.kld")} AS kld_p99, {agg("max", "m.kld")} AS kld_max,
               {agg("share", "m.top1_match")} AS top1_agreement, {agg("max", "m.max_abs_diff")} AS max_abs_diff,
               any_value(r.kld_vs_reference) AS kld_vs_reference
        FROM {table} m JOIN cells c ON c.cell_id = m.cell_id
        LEFT JOIN h ha ON ha.cell_id = m.cell_id AND ha.prompt_id = m.prompt_id AND ha.position = m.position
        LEFT JOIN h hb ON hb.cell_id = m.reference_cell_id AND hb.prompt_id = m.prompt_id AND hb.position = m.position
        LEFT JOIN r ON r.cell_id = m.cell_id
        WHERE m.repeat = 0
        GROUP BY c.model, c.engine, c.dtype, c.attention, {group_by}"""


def card_block(title: str, rows: list[dict], head) -> list[str]:
    """A card's block of a plug-in's graded rows: its title, then a line per row, head(row) and either
    "bit-identical (N rows)" or its KL mean ± s.e. (p99 where the rows have it), max, top-1 and the
    rows bit-identical; none without rows."""
    if not rows:
        return []
    return ["", title, ""] + [f"- {head(r)}: {_graded(r)}" for r in rows]


def _graded(r: dict) -> str:
    if r["bit_identical"]:
        return f"bit-identical ({r['rows']} rows)"
    p99 = f"p99 {r['kld_p99']:.3g}, " if "kld_p99" in r else ""
    return (
        f"KL {r['kld_mean']:.3g} ± {r['kld_stderr'] or 0:.2g} nats ({p99}max {r['kld_max']:.3g}), "
        f"top-1 {r['top1_agreement']:.4f}, {r['identical_rows']} of {r['rows']} rows bit-identical"
    )


def line(p: Partnering, got: dict) -> str:
    """analyze's line: "batch drift: 2 batch cell(s) against batch 1, 20 rows (0 up to date)"."""
    measured = f"{got['cells']} {p.cells} against {p.partner}"
    return f"{p.title} drift: {measured}, {got['rows']} rows ({got['reused']} up to date)"


def pairs(p: Partnering, done: list[CellRow], log=lambda line: None) -> list[tuple[CellRow, CellRow]]:
    """(cell, its partner) for every done cell whose partner is another stack that is captured: of
    the same engine build where there is one, on the same host where there is one, else the newest.
    One without says so."""
    by_stack: dict[str, list[CellRow]] = {}
    for c in done:
        by_stack.setdefault(c.stack_id, []).append(c)
    out = []
    for c in done:
        want = c.get(p.column)
        if not want or want == (c.stack_id) or c.replica:
            continue  # no partner, or its own (batch 1)
        sibs = by_stack.get(want)
        if not sibs:
            log(f"NOTE {c.cell_id}: no {p.partner_capture} capture of its stack ({want}): no {p.name} drift")
            continue
        # the same engine build on the same host first: a partner from another machine would add that
        # machine's own drift (CPU flags are outside the build's hash)
        same = [s for s in sibs if s.build == c.build] or sibs
        same = [s for s in same if s.get("host") == c.get("host")] or same
        out.append((c, max(same, key=lambda s: (s.get("finished_at"), s.cell_id))))
    return out


def analyze(p: Partnering, wh, done: list[CellRow], force: bool, log, skip_damaged: bool = False) -> dict | None:
    """The plug-in's table for every pair (None: the warehouse has no cell to measure). A damaged
    shard stops it, unless skip_damaged: then that pair is left out, saying so."""
    todo = pairs(p, done, log)
    stale = {f.rsplit("/", 1)[-1].removesuffix(".parquet") for f in wh.table_files(p.table)}
    stale -= {c.cell_id for c, _ in todo}
    for name in sorted(stale):  # a partner no longer captured: its old comparison would mislead
        wh.remove_table(p.table, name)
    if not todo:
        return None
    from store.verify import DamagedShard

    got = {"cells": 0, "rows": 0, "reused": 0}
    for cell, sib in todo:
        try:
            _measure(p, wh, cell, sib, force, log, got)
        except DamagedShard as e:
            if not skip_damaged:
                raise
            wh.remove_table(p.table, cell.cell_id)  # no older comparison stands in for it
            log(f"SKIPPED (damaged) {p.name} drift of {cell.cell_id}: {e}")
    return got


def _measure(p: Partnering, wh, cell: CellRow, sib: CellRow, force: bool, log, got: dict) -> None:
    """One pair's file, unless the one there has this content key; none where a side kept only
    its rows' hashes (`keep_rows: references`, `matrix kld` without --keep-rows)."""
    from analysis import metrics as M
    from analysis.compare import cell_metrics
    from analysis.unit_keys import unit_key
    from store.floors import StorageFloor
    from store.stream import shard_index

    cid, sid = cell.cell_id, sib.cell_id
    bare = [c for c in (cid, sid) if not _keeps_values(wh, c)]
    if bare:
        wh.remove_table(p.table, cid)
        log(f"NOTE {cid}: no {p.name} drift: the rows of {', '.join(bare)} were not kept (keep_rows)")
        return
    floor = StorageFloor.of_cell(sib) + StorageFloor.of_cell(cell)
    key = unit_key(pair=[cid, sid], digests=[shard_index(wh, i, 0).digest for i in (cid, sid)], floor=floor)
    got["cells"] += 1
    old = None if force else wh.table_meta(p.table, cid)
    if old and old.get("key") == key:
        got["reused"] += 1
        got["rows"] += old.get("rows", 0)
        return
    result = cell_metrics(wh, cid, 1, sid, floor, skip_damaged=False)
    for note in result.notes(cid, sid):  # rows the partner lacks, NaN/Inf rows
        log(note)
    table = result.table
    if table is None:
        wh.remove_table(p.table, cid)
        return
    wh.write_table(p.table, cid, table, {"key": key, "kernel_version": M.KERNEL_VERSION, "rows": table.num_rows})
    got["rows"] += table.num_rows
    log(f"[{p.name}] {cid}: {table.num_rows} rows against {p.partner} ({sid})")


def _keeps_values(wh, cell_id: str) -> bool:
    """Whether repeat 0's shard keeps its values; one that cannot be read is damage (DamagedShard)."""
    import pyarrow as pa

    from store.verify import DamagedShard

    try:
        return wh.shard_keeps_values(cell_id, 0)
    except (OSError, pa.ArrowException) as e:
        raise DamagedShard(f"{wh.shard_path(cell_id, 0)}: unreadable footer: {e}") from e
