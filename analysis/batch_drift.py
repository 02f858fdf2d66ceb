"""Graded batch drift: each batch cell of size > 1 against the same stack at batch 1 (cells.batch_of),
measured by analysis/partner_drift.py into batch_metrics/<cell_id>.parquet; the batch_drift view sums
it. `matrix analyze` runs it as the batch plug-in's analysis (extras/batch.py)."""

from __future__ import annotations

from analysis.aggregates import agg
from analysis.partner_drift import Partnering

TABLE = "batch_metrics"  # the metrics table's columns; reference_cell_id: the batch-1 cell
PARTNERING = Partnering("batch", TABLE, "batch_of", "batch 1", "batch-1")

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


def line(got: dict) -> str:
    return f"batch drift: {got['cells']} batch cell(s) against batch 1, {got['rows']} rows ({got['reused']} up to date)"
