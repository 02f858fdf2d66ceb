"""Graded KV cache drift: each cell whose KV cache is not llama.cpp's default (f16 for K and V)
against the same stack on the f16 cache (cells.kv_cache_of), measured by analysis/partner_drift.py
into kv_cache_metrics/<cell_id>.parquet. The kv_cache_drift view sums it, a card gives it a line and
the report a table per model. The cache is written and read inside the attention, so this is the
cost of the cache type alone: the same file, threads and build on both sides."""

from __future__ import annotations

import html

from analysis import report_tables as T
from analysis.aggregates import agg
from analysis.partner_drift import Partnering

TABLE = "kv_cache_metrics"  # the metrics table's columns; reference_cell_id: the f16-cache cell
PARTNERING = Partnering("kv_cache", TABLE, "kv_cache_of", "the f16 KV cache", "f16-KV-cache")

# repeat 0 row by row: bit-identity on the row hashes, KL and top-1 where they differ, the K and V
# types as the cell's settings record what llama.cpp ran, and the cell's KL against the reference
VIEW = "kv_cache_drift"
VIEW_SQL = f"""
    WITH h AS (SELECT cell_id, prompt_id, position, row_hash FROM logits WHERE repeat = 0 AND path IS NULL),
    r AS (SELECT cell_id, {agg("mean", "kld")} AS kld_vs_reference FROM metrics WHERE repeat = 0 GROUP BY cell_id)
    SELECT c.model, c.engine, c.dtype, c.attention, m.cell_id, m.reference_cell_id AS f16_cell_id,
           json_extract_string(c.settings, '$.kv_cache_k') AS kv_cache_k,
           json_extract_string(c.settings, '$.kv_cache_v') AS kv_cache_v,
           json_extract_string(c.settings, '$.flash_attn') AS flash_attn, count(*) AS rows,
           count(*) FILTER (WHERE ha.row_hash = hb.row_hash) AS identical_rows,
           bool_and(coalesce(ha.row_hash = hb.row_hash, false)) AS bit_identical,
           {agg("mean", "m.kld")} AS kld_mean, {agg("stderr", "m.kld")} AS kld_stderr,
           {agg("p99", "m.kld")} AS kld_p99, {agg("max", "m.kld")} AS kld_max,
           {agg("share", "m.top1_match")} AS top1_agreement, {agg("max", "m.max_abs_diff")} AS max_abs_diff,
           any_value(r.kld_vs_reference) AS kld_vs_reference
    FROM {TABLE} m JOIN cells c ON c.cell_id = m.cell_id
    LEFT JOIN h ha ON ha.cell_id = m.cell_id AND ha.prompt_id = m.prompt_id AND ha.position = m.position
    LEFT JOIN h hb ON hb.cell_id = m.reference_cell_id AND hb.prompt_id = m.prompt_id AND hb.position = m.position
    LEFT JOIN r ON r.cell_id = m.cell_id
    WHERE m.repeat = 0
    GROUP BY c.model, c.engine, c.dtype, c.attention, m.cell_id, m.reference_cell_id, c.settings"""
VIEW_ABOUT = (
    "each cell on a KV cache other than f16 against the same stack on the f16 cache: rows bit-identical, KL "
    "(mean, s.e., p99, max), top-1 agreement and max |Δlogit|; with its KL against the reference"
)


def line(r: dict) -> str:
    """One cell's line: "K q8_0, V q4_0 against f16: KL ..." or bit-identical."""
    head = f"K {r['kv_cache_k']}, V {r['kv_cache_v']} against the f16 cache"
    if r["bit_identical"]:
        return f"{head}: bit-identical ({r['rows']} rows)"
    return (
        f"{head}: KL {r['kld_mean']:.3g} ± {r['kld_stderr'] or 0:.2g} nats (p99 {r['kld_p99']:.3g}, max "
        f"{r['kld_max']:.3g}), top-1 {r['top1_agreement']:.4f}, {r['identical_rows']} of {r['rows']} rows bit-identical"
    )


def card_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    return ["", "KV cache (the same stack on llama.cpp's default f16 cache, row by row):", ""] + [
        f"- {line(r)}" for r in rows
    ]


def section(rows: list[dict], names: dict, k: int) -> str:
    """A model's table of its KV cache cells against f16 (rows: the view's, that model's)."""
    if not rows:
        return ""
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
