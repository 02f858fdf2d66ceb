"""`matrix report`: terminal tables and a self-contained HTML report (inline SVG, no network).

Reads only the warehouse's SQL views (analysis never imports a backend).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from analysis.report_layers import PALETTE
from analysis.sql import connect
from common.output import table



def gather(warehouse: str) -> dict:
    con = connect(warehouse)
    try:
        def rows(sql):
            rel = con.execute(sql)
            cols = [d[0] for d in rel.description]
            return [dict(zip(cols, r)) for r in rel.fetchall()]

        cells = rows("""
            SELECT s.cell_id, s.engine, s.dtype, s.attention, s.rows, s.kld_mean, s.kld_stderr, s.kld_p99,
                   s.top1_agreement, s.js_mean, s.below_resolution, s.is_reference, s.bit_reproducible,
                   s.storage_floor, s.reference_repeat_kld, s.nonfinite_rows, cs.kld_centroid_stack, cs.js_centroid, cs.rank_closest
            FROM summary s LEFT JOIN centroid_summary cs USING (cell_id) ORDER BY s.kld_mean, s.cell_id""")
        curves = rows("""SELECT cell_id, position, avg(kld) AS kld FROM metrics WHERE repeat = 0
                         GROUP BY ALL ORDER BY cell_id, position""")
        pairs = rows("SELECT cell_a, cell_b, mean_js, top1_agreement FROM pairwise")
        ranges = rows("""SELECT cell_id, range, lo, rows, kld_mean, kld_p99, top1_agreement FROM summary_by_range
                         WHERE category IS NULL ORDER BY cell_id, lo""")
        layers = rows("""SELECT cell_id, layer, layer_index, rows, cosine_min, cosine_mean, norm_ratio_dev_max
                         FROM layer_summary ORDER BY cell_id, layer_index""")
        paths = rows("""SELECT cell_id, rows_of, path, rows, kld_mean, cached_tokens_mean, kld_vs_prefill_mean, max_abs_diff_vs_prefill,
                                identical_share FROM summary_by_path ORDER BY cell_id, rows_of, path""")
    finally:
        con.close()
    return {"cells": cells, "curves": curves, "pairs": pairs, "ranges": ranges, "layers": layers, "paths": paths}


def _fmt(v, digits=4):
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def terminal_table(data: dict) -> str:
    cols = ["cell", "rows", "kld mean", "kld p99", "top-1", "JS", "to centroid", "rank", "bit-repro", "note"]
    body = []
    for c in data["cells"]:
        note = "reference" if c["is_reference"] else ("below resolution" if c["below_resolution"] else "")
        if c.get("nonfinite_rows"):
            note = (note + "; " if note else "") + f"{c['nonfinite_rows']} NaN/Inf row(s) left out"
        body.append([c["cell_id"], c["rows"], _fmt(c["kld_mean"]), _fmt(c["kld_p99"]),
                     _fmt(c["top1_agreement"]), _fmt(c["js_mean"]), _fmt(c["kld_centroid_stack"]),
                     c["rank_closest"], _fmt(c["bit_reproducible"]), note])
    return table(cols, body)


def svg_lines(curves: list[dict], w=760, h=320) -> str:
    series: dict[str, list] = {}
    for r in curves:
        if r["kld"] and r["kld"] > 0:
            series.setdefault(r["cell_id"], []).append((r["position"], r["kld"]))
    if not series:
        return "<p>No non-zero KLD rows.</p>"
    xs = [p for s in series.values() for p, _ in s]
    ys = [math.log10(k) for s in series.values() for _, k in s]
    x0, x1, y0, y1 = min(xs), max(xs) or 1, math.floor(min(ys)), math.ceil(max(ys))
    px = lambda x: 50 + (x - x0) / max(x1 - x0, 1) * (w - 70)  # noqa: E731
    py = lambda y: h - 30 - (y - y0) / max(y1 - y0, 1e-9) * (h - 50)  # noqa: E731
    out = [f'<svg class="plot" id="kld-position" width="{w}" height="{h + 20 * len(series)}" '
           f'xmlns="http://www.w3.org/2000/svg">']
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="50" x2="{w - 20}" y1="{py(e):.1f}" y2="{py(e):.1f}" stroke="#eee"/>'
                   f'<text x="5" y="{py(e) + 4:.1f}" font-size="11">1e{e}</text>')
    out.append(f'<text x="{w / 2:.0f}" y="{h - 5}" font-size="11">position</text>')
    for i, (cid, pts) in enumerate(sorted(series.items())):
        col = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{px(p):.1f},{py(math.log10(k)):.1f}" for p, k in pts)
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.3" points="{path}"/>')
        out.append(f'<text x="55" y="{h + 15 + 20 * i}" font-size="12" fill="{col}">{html.escape(cid)}</text>')
    out.append("</svg>")
    return "".join(out)


def svg_bars(items: list[tuple[str, float]], ident: str, fmt=".3g", w=760) -> str:
    items = [(k, v) for k, v in items if v is not None]
    if not items:
        return "<p>No data.</p>"
    top = max(v for _, v in items) or 1.0
    h = 22 * len(items) + 10
    out = [f'<svg class="plot" id="{ident}" width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    for i, (k, v) in enumerate(items):
        bw = (w - 420) * v / top
        out.append(f'<text x="0" y="{22 * i + 15}" font-size="12">{html.escape(k)}</text>'
                   f'<rect x="330" y="{22 * i + 4}" width="{bw:.1f}" height="14" fill="{PALETTE[0]}"/>'
                   f'<text x="{335 + bw:.1f}" y="{22 * i + 15}" font-size="11">{v:{fmt}}</text>')
    out.append("</svg>")
    return "".join(out)


def svg_heatmap(pairs: list[dict], cells: list[str], ident="pairwise-js") -> str:
    if len(cells) < 2:
        return "<p>One stack: no pairs.</p>"
    val = {}
    for p in pairs:
        val[(p["cell_a"], p["cell_b"])] = val[(p["cell_b"], p["cell_a"])] = p["mean_js"]
    top = max((v for v in val.values() if v), default=1.0) or 1.0
    n, s, left = len(cells), 26, 300
    out = [f'<svg class="plot" id="{ident}" width="{left + s * n + 20}" height="{s * n + 20}" '
           f'xmlns="http://www.w3.org/2000/svg">']
    for i, a in enumerate(cells):
        out.append(f'<text x="0" y="{s * i + 17}" font-size="11">{html.escape(a)}</text>')
        for j, b in enumerate(cells):
            v = 0.0 if a == b else val.get((a, b))
            shade = 255 if v is None else int(255 * (1 - math.sqrt(max(v, 0) / top)))
            out.append(f'<rect x="{left + s * j}" y="{s * i}" width="{s - 1}" height="{s - 1}" '
                       f'fill="rgb(255,{shade},{shade})"><title>{html.escape(a)} vs {html.escape(b)}: '
                       f'JS {_fmt(v)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def write_html(data: dict, out_dir: Path, warehouse: str, sections: list[str] = ()) -> Path:
    """sections: the HTML of each per-cell extra's part (extras: Extra.report), in registry order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = data["cells"]
    ids = [c["cell_id"] for c in cells]
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c[k]))}</td>" for k in (
            "cell_id", "rows", "kld_mean", "kld_stderr", "kld_p99", "top1_agreement", "js_mean",
            "kld_centroid_stack", "rank_closest", "bit_reproducible", "below_resolution")) + "</tr>"
        for c in cells)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>logit-matrix report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:first-child{{text-align:left}}
h2{{margin-top:1.6em}}</style></head><body>
<h1>logit-matrix report</h1>
<p>Warehouse <code>{html.escape(str(warehouse))}</code>. KLD is KL(P<sub>ref</sub> &#8214; P<sub>stack</sub>)
in nats, log-softmax in float64, per captured row (repeat 0), against each model's reference cell;
the centroid is the normalised mean of the stacks' probabilities at each row.</p>
<h2>Stacks</h2>
<table id="cells"><tr><th>cell</th><th>rows</th><th>KLD mean</th><th>&#177; s.e.</th><th>KLD p99</th>
<th>top-1</th><th>JS</th><th>KL to centroid</th><th>rank</th><th>bit-reproducible</th><th>below resolution</th></tr>
{rows}</table>
<h2>KLD against position</h2>{svg_lines(data["curves"])}
<h2>Pairwise Jensen-Shannon</h2>{svg_heatmap(data["pairs"], ids)}
<h2>Top-1 agreement with the reference</h2>{svg_bars([(c["cell_id"], c["top1_agreement"]) for c in cells], "top1")}
<h2>Distance to the centroid (KL(centroid &#8214; stack))</h2>
{svg_bars([(c["cell_id"], c["kld_centroid_stack"]) for c in cells], "centroid")}
{"".join(sections)}
<script type="application/json" id="data">{html.escape(json.dumps(data, default=str))}</script>
</body></html>"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path
