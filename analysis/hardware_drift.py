"""Graded drift across hardware: each cell on a CPU code path other than native (extras/cpu_path.py),
and each cell on another device (a GPU), against the same stack on this CPU's native path
(cells.cpu_path_of; `hardware` names the path, or the device), measured by
analysis/partner_drift.py into hardware_metrics/<cell_id>.parquet. The hardware_drift view sums it,
a card gives it a line and the report a table per model, beside each cell's KL against the
reference: whether another CPU moves a stack more or less than its quantisation does."""

from __future__ import annotations

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
    "coalesce(json_extract_string(c.settings, '$.cpu_path'), c.device) AS hardware, "
    "json_extract_string(c.settings, '$.cpu_path') AS cpu_path, "
    "json_extract_string(c.settings, '$.cpu_capability') AS cpu_capability, "
    "json_extract_string(c.settings, '$.onednn_isa') AS onednn_isa",
    "c.device, m.cell_id, m.reference_cell_id, c.settings",
)
# the card cell as the path measured, or as the native partner of the paths measured against it
CARD_SQL = f"""WITH me AS (SELECT ?::VARCHAR AS id)
               SELECT d.* FROM {VIEW} d, me WHERE d.cell_id = me.id OR d.native_cell_id = me.id ORDER BY d.hardware"""
VIEW_ABOUT = (
    "each cell on a CPU code path other than native, or on another device, against the same stack on the "
    "CPU's native path (hardware: the path or the device): rows "
    "bit-identical, KL (mean, s.e., p99, max), top-1 agreement and max |Δlogit|; with its KL against the reference"
)


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines: its title, "bit-identical on avx512, avx512_bf16; KL 5.8e-12 on
    scalar, ..." in one line, then a line per path."""
    title = "Across hardware (the same stack on the CPU's native path, row by row):"
    if not rows:
        return []
    same = [r["hardware"] for r in rows if r["bit_identical"]]
    moved = [f"KL {r['kld_mean']:.2g} on {r['hardware']}" for r in rows if not r["bit_identical"]]
    brief = "; ".join(([f"bit-identical on {', '.join(same)}"] if same else []) + moved)
    lines = card_block(title, rows, lambda r: f"{r['hardware']} ({r['cpu_capability'] or r['device']}) against native")
    return [*lines[:3], brief, "", *lines[3:]]
