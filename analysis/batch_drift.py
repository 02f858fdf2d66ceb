"""Graded batch drift: each batch cell of size > 1 against the same stack at batch 1 (cells.batch_of),
measured by analysis/partner_drift.py into batch_metrics/<cell_id>.parquet; the batch_drift view sums
it, and a card's block gives the card's stack at each batch size the warehouse holds. `matrix
analyze` runs it as the batch plug-in's analysis (extras/batch.py)."""

from __future__ import annotations

from analysis.partner_drift import Partnering, card_block, view_sql

TABLE = "batch_metrics"  # the metrics table's columns; reference_cell_id: the batch-1 cell
PARTNERING = Partnering("batch", "batch", TABLE, "batch_of", "batch 1", "batch-1", "batch cell(s)")

# The graded view: each batch cell (size > 1) against the same stack at batch 1 (batch_metrics)
VIEW = "batch_drift"
VIEW_SQL = view_sql(
    TABLE,
    "c.options, c.batch_of AS stack_id_batch_1, m.reference_cell_id AS batch_1_cell_id, m.cell_id, c.batch_size, "
    "json_extract_string(c.batch, '$.fill') AS fill",
    "c.options, c.batch_of, m.reference_cell_id, m.cell_id, c.batch_size, c.batch",
)
VIEW_ABOUT = (
    "each batch cell (batch_size > 1) against the same stack at batch 1: rows bit-identical, and "
    "KL (mean, s.e., p99, max), top-1 agreement and max |Δlogit| where they differ; with its KL against the reference"
)

# every batch size of the card cell's stack (its batch-1 stack id, at any size of its own) captured by
# the card cell's engine build; a batch-free cell has no batch_of, so no rows
CARD_SQL = """WITH me AS (SELECT batch_of, build FROM cells WHERE cell_id = ?)
              SELECT d.batch_size, d.fill, d.rows, d.identical_rows, d.bit_identical, d.kld_mean, d.kld_stderr,
                     d.kld_max, d.top1_agreement
              FROM batch_drift d JOIN cells c USING (cell_id) JOIN me ON d.stack_id_batch_1 = me.batch_of
              WHERE c.build IS NOT DISTINCT FROM me.build
              ORDER BY d.batch_size"""


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines, one per batch size: "batch 1 vs 8 (corpus fill): ..."; none for a
    batch-free stack."""
    title = "Batch composition (each prompt among batch - 1 other sequences, against batch 1):"
    return card_block(title, rows, lambda r: f"batch 1 vs {r['batch_size']} ({r['fill']} fill)")
