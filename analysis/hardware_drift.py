"""Graded drift across hardware: each cell on other hardware than the reference's, another CPU code
path (extras/cpu_path.py) or another device (a GPU), against the same stack on the reference
hardware, the device and path the spec's `reference:` names, by default the CPU's native path
(cells.cpu_path_of; `hardware` names a cell's path, or its device), measured by
analysis/partner_drift.py into hardware_metrics/<cell_id>.parquet. The hardware_drift view sums it,
a card gives it a line and the report a table per model, beside each cell's KL against the
reference: whether another CPU moves a stack more or less than its quantisation does."""

from __future__ import annotations

from analysis.partner_drift import Partnering, card_block, view_sql

TABLE = "hardware_metrics"  # the metrics table's columns; reference_cell_id: the reference hardware's cell
PARTNERING = Partnering(
    "hardware", "hardware", TABLE, "cpu_path_of", "the reference hardware", "reference-hardware", "cell(s)"
)

# the path as the cell's settings record what ran: torch's kernels and oneDNN's bf16 ISA
VIEW = "hardware_drift"
VIEW_SQL = (
    "SELECT d.*, coalesce(json_extract_string(p.settings, '$.cpu_path'), p.device) AS reference_hardware, "
    "l.first_layer_differing, l.first_layer_max_abs_diff FROM ({}) d "
    "LEFT JOIN cells p ON p.cell_id = d.reference_hardware_cell_id LEFT JOIN ({}) l ON l.cell_id = d.cell_id"
)
PAIRS_SQL = view_sql(
    TABLE,
    "c.device, m.cell_id, m.reference_cell_id AS reference_hardware_cell_id, "
    "coalesce(json_extract_string(c.settings, '$.cpu_path'), c.device) AS hardware, "
    "json_extract_string(c.settings, '$.cpu_path') AS cpu_path, "
    "json_extract_string(c.settings, '$.cpu_capability') AS cpu_capability, "
    "coalesce(json_extract_string(c.settings, '$.cpu_capability'), "
    "json_extract_string(c.settings, '$.ggml_cpu_variant')) AS kernels, "
    "json_extract_string(c.settings, '$.onednn_isa') AS onednn_isa",
    "c.device, m.cell_id, m.reference_cell_id, c.settings",
)
# the card cell as the one measured, or as the reference hardware's cell the others are measured against
CARD_SQL = f"""WITH me AS (SELECT ?::VARCHAR AS id)
               SELECT d.* FROM {VIEW} d, me WHERE d.cell_id = me.id OR d.reference_hardware_cell_id = me.id
               ORDER BY d.hardware"""
VIEW_ABOUT = (
    "each cell on other hardware than the reference's (another CPU code path, another device) against the same "
    "stack on the reference hardware (hardware, reference_hardware: the path or the device): rows "
    "bit-identical, KL (mean, s.e., p99, max), top-1 agreement and max |Δlogit|; with its KL against the reference; "
    "where both recorded `layers:`, the first layer whose states differ and the largest |Δ| there"
)


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines: its title, "bit-identical on avx512, avx512_bf16; KL 5.8e-12 on
    scalar, ..." in one line, then a line per path."""
    title = "Across hardware (the same stack on the reference hardware, row by row):"
    if not rows:
        return []
    same = [r["hardware"] for r in rows if r["bit_identical"]]
    moved = [f"KL {r['kld_mean']:.2g} on {r['hardware']}" for r in rows if not r["bit_identical"]]
    brief = "; ".join(([f"bit-identical on {', '.join(same)}"] if same else []) + moved)
    lines = card_block(
        title, rows, lambda r: f"{r['hardware']} ({r['kernels'] or r['device']}) against {r['reference_hardware']}"
    )
    lines[3:] = [line + _first_layer(r) for line, r in zip(lines[3:], rows)]
    return [*lines[:3], brief, "", *lines[3:]]


def _first_layer(r: dict) -> str:
    """ "; first apart at layer.3 (max |Δ| 0.0012)" where both sides' layer states were compared."""
    if not r.get("first_layer_differing"):
        return ""
    return f"; first apart at {r['first_layer_differing']} (max |Δ| {r['first_layer_max_abs_diff']:.3g})"


# Where both sides recorded `layers:` states: each pair's states compared layer by layer (the
# layer_metrics columns; reference_cell_id: the reference hardware's cell), so the view can say at which
# layer the two hardware paths first part, and by how much.
LAYER_TABLE = "hardware_layers"


def analyze_layers(wh, done, force: bool, log, skip_damaged: bool = False) -> int:
    """Each hardware pair with layer states on both sides into hardware_layers/<cell_id>.parquet,
    and the files of pairs no longer so removed; -> pairs measured. A damaged shard stops it unless
    skip_damaged (then that pair is left out, saying so)."""
    from analysis.partner_drift import pairs
    from store.verify import DamagedShard

    todo = [(c, s) for c, s in pairs(PARTNERING, done) if c.get("layers") and s.get("layers")]
    keep = {c.cell_id for c, _ in todo}
    for name in {f.rsplit("/", 1)[-1].removesuffix(".parquet") for f in wh.table_files(LAYER_TABLE)} - keep:
        wh.remove_table(LAYER_TABLE, name)
    for cell, sib in todo:
        try:
            _layers(wh, cell, sib, force, log)
        except DamagedShard as e:
            if not skip_damaged:
                raise
            wh.remove_table(LAYER_TABLE, cell.cell_id)
            log(f"SKIPPED (damaged) hardware layer drift of {cell.cell_id}: {e}")
    return len(todo)


def _layers(wh, cell, sib, force: bool, log) -> None:
    """One pair's layer file, unless the one there has this content key (both sides' layer shards)."""
    import hashlib
    import json

    from analysis import layer_analysis as LA

    mine, theirs = LA._open(wh, cell.cell_id, 0), LA._open(wh, sib.cell_id, 0)
    (mg, md), (tg, td) = LA._groups(mine), LA._groups(theirs)
    key = hashlib.sha256(json.dumps([LA.LAYER_KERNEL, sib.cell_id, md, td]).encode()).hexdigest()
    if not force and (wh.table_meta(LAYER_TABLE, cell.cell_id) or {}).get("key") == key:
        return
    table, _ = LA.compare(cell, sib.cell_id, 0, (mine, mg), (theirs, tg))
    wh.write_table(LAYER_TABLE, cell.cell_id, table, {"key": key, "rows": table.num_rows})
    log(f"[hardware] {cell.cell_id}: its layer states against {sib.cell_id}'s")


# the shallowest layer whose states differ (any row not bit-identical), and by how much there
FIRST_LAYER_SQL = f"""
    SELECT cell_id, arg_min(layer, layer_index) AS first_layer_differing,
           arg_min(worst, layer_index) AS first_layer_max_abs_diff
    FROM (SELECT cell_id, layer, layer_index, max(max_abs_diff) AS worst FROM {LAYER_TABLE}
          GROUP BY cell_id, layer, layer_index)
    WHERE worst > 0 GROUP BY cell_id"""


VIEW_SQL = VIEW_SQL.format(PAIRS_SQL, FIRST_LAYER_SQL)
