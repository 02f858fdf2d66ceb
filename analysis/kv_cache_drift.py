"""Graded KV cache drift: each cell whose KV cache is not llama.cpp's default (f16 for K and V)
against the same stack on the f16 cache (cells.kv_cache_of), measured by analysis/partner_drift.py
into kv_cache_metrics/<cell_id>.parquet. The kv_cache_drift view sums it, a card gives it a line and
the report a table per model. The cache is written and read inside the attention, so this is the
cost of the cache type alone: the same file and threads on both sides, and the same engine build
where the warehouse has the partner from it (else its newest capture)."""

from __future__ import annotations

import html

from analysis.partner_drift import Partnering, card_block, view_sql

TABLE = "kv_cache_metrics"  # the metrics table's columns; reference_cell_id: the f16-cache cell
PARTNERING = Partnering("kv_cache", "KV cache", TABLE, "kv_cache_of", "the f16 cache", "f16-KV-cache", "cell(s)")

# the K and V types as the cell's settings record what llama.cpp ran
VIEW = "kv_cache_drift"
VIEW_SQL = view_sql(
    TABLE,
    "m.cell_id, m.reference_cell_id AS f16_cell_id, json_extract_string(c.settings, '$.kv_cache_k') AS kv_cache_k, "
    "json_extract_string(c.settings, '$.kv_cache_v') AS kv_cache_v, "
    "json_extract_string(c.settings, '$.flash_attn') AS flash_attn",
    "m.cell_id, m.reference_cell_id, c.settings",
)
CARD_SQL = f"SELECT * FROM {VIEW} WHERE cell_id = ?"
VIEW_ABOUT = (
    "each cell on a KV cache other than f16 against the same stack on the f16 cache: rows bit-identical, KL "
    "(mean, s.e., p99, max), top-1 agreement and max |Δlogit|; with its KL against the reference"
)


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines, one per cell: "K q8_0, V q4_0 against the f16 cache: ..."."""
    title = "KV cache (the same stack on llama.cpp's default f16 cache, row by row):"
    return card_block(title, rows, lambda r: f"K {r['kv_cache_k']}, V {r['kv_cache_v']} against the f16 cache")


def section(data: dict, model: str, k: int) -> str:
    """A model's table of its KV cache cells against f16; empty where it has none measured."""
    rows = [r for r in (data.get("plugin_views") or {}).get(VIEW) or [] if r["model"] == model]
    names = data.get("names") or {}
    if not rows:
        return ""
    from analysis import report_tables as T  # the report's, imported where the report is drawn

    head = "stack|K|V|rows|bit-identical rows|KL vs f16 cache|± s.e.|p99|max|top-1|KL vs reference".split("|")
    keys = ("kv_cache_k", "kv_cache_v", "rows", "identical_rows", "kld_mean", "kld_stderr", "kld_p99", "kld_max")
    body = [
        [html.escape(T.fmt(v)) for v in (names.get(r["cell_id"], r["cell_id"]), *(r[k] for k in keys))]
        + [html.escape(T.fmt(r["top1_agreement"])), html.escape(T.fmt(r["kld_vs_reference"]))]
        for r in sorted(rows, key=lambda r: (r["kld_mean"] or 0, r["cell_id"]))
    ]
    return "<h3>KV cache: each cache type against the same stack on f16</h3>" + T.html_table(
        f"kv-cache-rows-{k}", head, body
    )
