"""Graded drift across CPU code paths: each cell on a path other than native (extras/cpu_path.py)
against the same stack on this CPU's native path (cells.cpu_path_of), measured by
analysis/partner_drift.py into hardware_metrics/<cell_id>.parquet. The hardware_drift view sums it,
a card gives it a line and the report a table per model, beside each cell's KL against the
reference: whether another CPU moves a stack more or less than its quantisation does."""

from __future__ import annotations

import html

from analysis.partner_drift import Partnering, card_block, view_sql

TABLE = "hardware_metrics"  # the metrics table's columns; reference_cell_id: the native-path cell
PARTNERING = Partnering(
    "hardware", "CPU code path", TABLE, "cpu_path_of", "the native path", "native-path", "CPU-path cell(s)"
)

# the path as the cell's settings record what ran: torch's kernels and oneDNN's bf16 ISA
VIEW = "hardware_drift"
VIEW_SQL = view_sql(
    TABLE,
    "c.device, m.cell_id, m.reference_cell_id AS native_cell_id, "
    "json_extract_string(c.settings, '$.cpu_path') AS cpu_path, "
    "json_extract_string(c.settings, '$.cpu_capability') AS cpu_capability, "
    "json_extract_string(c.settings, '$.onednn_isa') AS onednn_isa",
    "c.device, m.cell_id, m.reference_cell_id, c.settings",
)
# the card cell as the path measured, or as the native partner of the paths measured against it
CARD_SQL = f"""WITH me AS (SELECT ?::VARCHAR AS id)
               SELECT d.* FROM {VIEW} d, me WHERE d.cell_id = me.id OR d.native_cell_id = me.id ORDER BY d.cpu_path"""
VIEW_ABOUT = (
    "each cell on a CPU code path other than native against the same stack on the native path: rows "
    "bit-identical, KL (mean, s.e., p99, max), top-1 agreement and max |Δlogit|; with its KL against the reference"
)


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines, one per path: "avx2 against native: bit-identical (80 rows)"."""
    title = "Across CPU code paths (the same stack on this CPU's native path, row by row):"
    return card_block(title, rows, lambda r: f"{r['cpu_path']} ({r['cpu_capability']}) against native")


def section(data: dict, model: str, k: int) -> str:
    """A model's table of its CPU-path cells against native; empty where it has none measured."""
    rows = [r for r in (data.get("plugin_views") or {}).get(VIEW) or [] if r["model"] == model]
    names = data.get("names") or {}
    if not rows:
        return ""
    from analysis import report_tables as T  # the report's, imported where the report is drawn

    head = "stack|path|torch|oneDNN bf16|rows|bit-identical rows|KL vs native|± s.e.|p99|max|top-1|KL vs reference"
    keys = ("cpu_path", "cpu_capability", "onednn_isa", "rows", "identical_rows", "kld_mean", "kld_stderr")
    body = [
        [html.escape(T.fmt(v)) for v in (names.get(r["cell_id"], r["cell_id"]), *(r[k] for k in keys))]
        + [html.escape(T.fmt(r[k])) for k in ("kld_p99", "kld_max", "top1_agreement", "kld_vs_reference")]
        for r in sorted(rows, key=lambda r: (r["cell_id"], r["cpu_path"] or ""))
    ]
    return "<h3>CPU code paths: each path against the same stack on the native path</h3>" + T.html_table(
        f"hardware-rows-{k}", head.split("|"), body
    )
