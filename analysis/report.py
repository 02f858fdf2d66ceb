"""`matrix report`: a terminal table and one self-contained HTML page (inline SVG charts drawn with
matplotlib, the font they were measured with embedded; nothing fetched from a network).

Reads only the warehouse's SQL views (analysis never imports a backend). Stacks are shown by their
readable names (analysis/stack_names.py), which say what tells them apart; the cell ids are in the
stacks table and the page's JSON.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path

from analysis import frontier as F
from analysis import report_buckets as B
from analysis import report_plots as P
from analysis import report_tables as T
from analysis.aggregates import agg
from analysis.sql import connect, dict_rows
from analysis.stack_names import names
from common import plugins
from common.output import table

QUANTILES = [i / 200 for i in range(201)]  # the CDF's points: every half percent of a stack's rows


def gather(warehouse: str) -> dict:
    con = connect(warehouse)
    try:
        q = lambda sql, *p: dict_rows(con, sql, p)  # noqa: E731
        data = {
            "cells": q("""
                SELECT s.model, s.cell_id, s.engine, s.dtype, s.attention, s.rows, s.kld_mean, s.kld_stderr,
                       s.kld_p99, s.kld_max,
                       s.top1_agreement, s.js_mean, s.ppl_ratio, s.below_resolution, s.is_reference, s.bit_reproducible,
                       s.storage_floor, s.reference_repeat_kld, s.nonfinite_rows, cs.kld_centroid_stack, cs.js_centroid,
                       cs.rank_closest
                FROM summary s LEFT JOIN centroid_summary cs USING (cell_id)
                ORDER BY s.model, s.kld_mean, s.cell_id"""),
            # quantile_disc: each point is a row's own KL (an interpolated one could fall between 0 and the
            # smallest positive KL, a value no row has, and stretch the log axis)
            "distribution": q(
                """SELECT cell_id, quantile_disc(kld, ?::DOUBLE[]) AS q
                                 FROM metrics WHERE repeat = 0 AND kld IS NOT NULL GROUP BY cell_id ORDER BY cell_id""",
                QUANTILES,
            ),
            "curves": q(f"""SELECT cell_id, position, {agg("median", "kld")} AS median, {agg("p10", "kld")} AS p10,
                                  {agg("p90", "kld")} AS p90, count(DISTINCT prompt_id) AS prompts
                           FROM metrics WHERE repeat = 0 AND kld IS NOT NULL
                           GROUP BY ALL ORDER BY cell_id, position"""),
            "pairs": q("SELECT cell_a, cell_b, mean_js, top1_agreement FROM pairwise"),
            "ranges": q("""SELECT cell_id, range, lo, category, rows, kld_mean, kld_stderr, kld_p99, top1_agreement
                           FROM summary_by_range ORDER BY cell_id, category NULLS FIRST, lo"""),
            "buckets": q(B.SQL),
            "layers": q("""SELECT cell_id, layer, layer_index, rows, cosine_min, cosine_mean, norm_ratio_dev_max
                           FROM layer_summary ORDER BY cell_id, layer_index"""),
            "paths": q("""SELECT cell_id, rows_of, path, rows, kld_mean, cached_tokens_mean, kld_vs_prefill_mean,
                                 max_abs_diff_vs_prefill, identical_share
                                 FROM summary_by_path ORDER BY cell_id, rows_of, path"""),
            "runs": q("""SELECT run_id, status, started_at, finished_at, host, executor, logit_matrix_version,
                      spec_name,
                                spec_sha256, cells_done, cells_total FROM runs ORDER BY started_at"""),
            "centroids": q("SELECT DISTINCT centroid_group, centroid FROM centroid_metrics ORDER BY ALL"),
            "stacks": q("SELECT * FROM cells"),
            "frontier": q(f"SELECT * FROM {F.VIEW} ORDER BY model, file_bytes, kld_mean, cell_id"),
            # each plug-in's views (extras.Extra.views), for its own report section
            "plugin_views": {name: q(f"SELECT * FROM {name}") for name in plugins.provider.views()},
        }
    finally:
        con.close()
    data["names"] = labels(data["stacks"])
    data["model_of"] = {c["cell_id"]: c["model"] for c in data["stacks"]}
    return data


def labels(cells: list[dict]) -> dict[str, str]:
    """{cell_id: a short label, unique}: its stack's readable name; several cells of one stack (replicas,
    other runs or builds) add what follows the stack id in their cell id (`.r1@<build>`). A cell
    written before cells had a stack id is a stack of its own."""
    rows = [{**c, "stack_id": c.get("stack_id") or c["cell_id"]} for c in cells]
    by_stack = names(rows) if rows else {}
    out = {c["cell_id"]: by_stack[c["stack_id"]] for c in rows}
    seen = Counter(out.values())
    for c in rows:
        if seen[out[c["cell_id"]]] > 1:
            tail = c["cell_id"][len(c["stack_id"]) :] if c["cell_id"].startswith(c["stack_id"]) else ""
            out[c["cell_id"]] += tail or "@" + c["cell_id"]
    return out


def terminal_table(data: dict) -> str:
    cols = ["stack", "rows", "kld mean", "kld p99", "top-1", "JS", "to centroid", "rank", "bit-repro", "note"]
    body = []
    for c in data["cells"]:
        note = "reference" if c["is_reference"] else ("below resolution" if c["below_resolution"] else "")
        if c.get("nonfinite_rows"):
            note = (note + "; " if note else "") + f"{c['nonfinite_rows']} NaN/Inf row(s) left out"
        body.append(
            [
                data["names"].get(c["cell_id"], c["cell_id"]),
                c["rows"],
                T.fmt(c["kld_mean"]),
                T.fmt(c["kld_p99"]),
                T.fmt(c["top1_agreement"]),
                T.fmt(c["js_mean"]),
                T.fmt(c["kld_centroid_stack"]),
                c["rank_closest"],
                T.fmt(c["bit_reproducible"]),
                note,
            ]
        )
    return table(cols, body)


def _models(data: dict) -> list[str]:
    return sorted({c["model"] for c in data["cells"]})


def _measured(data: dict, model: str) -> list[dict]:
    """The model's stacks other than its reference, closest first."""
    return [c for c in data["cells"] if c["model"] == model and not c["is_reference"]]


def model_charts(data: dict, model: str, k: int) -> str:
    """The charts of one model's stacks against its reference, its centroid and each other."""
    name = data["names"]
    mine = _measured(data, model)
    every = {c["cell_id"] for c in data["cells"] if c["model"] == model}
    js = {
        (name[p["cell_a"]], name[p["cell_b"]]): p["mean_js"]
        for p in data["pairs"]
        if p["cell_a"] in every and p["cell_b"] in every
    }
    if not mine:
        return P.no_data("Only this model's reference was measured: nothing to compare it with.")
    return (
        _kld_charts(data, mine, k)
        + "<h3>Top-1 agreement with the reference</h3>"
        + P.dots(
            [(name[c["cell_id"]], {"top-1": c["top1_agreement"]}) for c in mine],
            f"top1-{k}",
            "share of rows whose most likely token is the reference's",
            log=False,
        )
        + "<h3>Distance to the centroid</h3>"
        + P.dots(
            [
                (name[c["cell_id"]], {"KL(centroid ‖ stack)": c["kld_centroid_stack"]})
                for c in data["cells"]
                if c["model"] == model
            ],
            f"centroid-{k}",
            "KL(centroid ‖ stack), nats",
        )
        + _pairwise_chart(name, every, js, k)
    )


def _curves(data: dict, ids: set[str]) -> dict[str, dict]:
    """cell id -> its KL-by-position series (median, 10th and 90th percentile over prompts)."""
    name = data["names"]
    curves: dict[str, dict] = {}
    for r in data["curves"]:
        if r["cell_id"] in ids:
            p = curves.setdefault(
                r["cell_id"],
                {"label": name[r["cell_id"]], "position": [], "median": [], "p10": [], "p90": [], "prompts": []},
            )
            for key in ("position", "median", "p10", "p90", "prompts"):
                p[key].append(r[key])
    return curves


def _kld_charts(data: dict, mine: list[dict], k: int) -> str:
    """KL from the reference: its mean and p99 per stack, its distribution over rows, and by position."""
    name = data["names"]
    ids = {c["cell_id"] for c in mine}
    dist = {d["cell_id"]: d for d in data["distribution"] if d["cell_id"] in ids}
    curves = _curves(data, ids)
    summary = [(name[c["cell_id"]], {"mean": c["kld_mean"], "p99": c["kld_p99"]}) for c in mine]
    err = {name[c["cell_id"]]: 2 * c["kld_stderr"] for c in mine if c["kld_stderr"] is not None}
    same = [name[c["cell_id"]] for c in mine if c["kld_max"] == 0]
    return (
        "<h3>KL divergence from the reference: mean ± 2 s.e., and p99</h3>"
        + (
            f'<p class="same">KL 0 on every row (no point on a log axis): {html.escape(", ".join(same))}.</p>'
            if same
            else ""
        )
        + P.dots(summary, f"kld-summary-{k}", "KL(reference ‖ stack), nats", err=err)
        + "<h3>Distribution over rows (CDF)</h3>"
        + P.cdf([(name[c], dist[c]["q"], QUANTILES) for c in (c["cell_id"] for c in mine) if c in dist], f"kld-cdf-{k}")
        + "<h3>KL against position</h3><p>Each panel: the median over prompts of a row's KL at that position "
        "(line) and its 10th to 90th percentile (band). Grey: fewer than two prompts reach that position, so "
        "the line is one prompt's there, not a median.</p>"
        + P.by_position([curves[c["cell_id"]] for c in mine if c["cell_id"] in curves], f"kld-position-{k}")
        + B.chart(data, mine, k)
    )


def _pairwise_chart(name: dict, every: set[str], js: dict, k: int) -> str:
    """The heatmap of every pair's mean JS divergence, or why there is none."""
    return "<h3>Every pair of stacks: mean Jensen-Shannon divergence</h3>" + (
        P.heatmap(sorted(name[c] for c in every), js, f"pairwise-js-{k}", "mean JS divergence, nats")
        if js
        else P.no_data(
            "No pairwise divergences for this model's stacks: analysis measures the pairs of "
            "each centroid group, and a spec with centroid: none asks for none."
        )
    )


STACK_KEYS = (
    "cell_id",
    "stack_id",
    "model",
    "engine",
    "dtype",
    "attention",
    "tp",
    "device",
    "options",
    "status",
    "host",
    "is_reference",
    "reference_cell_id",
    "centroid",
    "storage",
)


def _embedded(data: dict) -> str:
    """What the charts were drawn from, as JSON a script can parse (a <script> is raw text: no HTML
    escaping, only "</" kept from closing it); of each cell, what names its stack."""
    small = {**data, "stacks": [{k: c.get(k) for k in STACK_KEYS} for c in data["stacks"]]}
    return json.dumps(small, default=str).replace("</", "<\\/")


def write_html(data: dict, out_dir: Path, warehouse: str, sections: list[str] = (), model_parts=None) -> Path:
    """sections: the HTML of each plug-in's part (extras: Extra.report), in registry order;
    model_parts(data, model, k): the plug-ins' parts of a model's section (Extra.model_report)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    models = _models(data)
    parts = model_parts or (lambda data, model, k: "")
    body = "".join(
        f'<section class="model"><h2>Model {html.escape(m)}</h2>{T.stacks_table(data, m)}'
        f"{model_charts(data, m, k)}{F.section(data, m, k)}{parts(data, m, k)}{T.ranges_tables(data, m)}</section>"
        for k, m in enumerate(models)
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>logit-matrix report</title>
<style>{P.font_face()}
body{{font-family:'DejaVu Sans',sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse;font-size:13px;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
span.id{{font-size:11px;color:#666;white-space:nowrap}}details{{margin:.5em 0}}h2{{margin-top:1.8em}}
h3{{margin:1.4em 0 .3em;font-size:15px}}
svg.chart{{display:block;max-width:100%;height:auto}}p.empty{{color:#666}}</style></head><body>
<h1>logit-matrix report</h1>
{T.intro(data, warehouse)}
{T.metadata(data)}
{body}
{"".join(sections)}
<script type="application/json" id="data">{_embedded(data)}</script>
</body></html>"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path
