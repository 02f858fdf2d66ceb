"""The report's per-layer and off-prefill plots. Per layer: 1 - cosine and |norm ratio - 1| by layer, one line per
stack, against the reference's same layer (the layer_summary view); log scale, because the stacks
of a quant ladder sit orders of magnitude apart and the gates are thresholds on these very numbers.
Off the prefill: for a path of the d<repeat> file, each cell's KL to the reference on its prefill rows
and on that path's rows at the same positions (summary_by_path), with how far its two paths are apart."""

from __future__ import annotations

import html
import math

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]


def svg_layer_panel(rows: list[dict], key: str, ident: str, label: str, w=760, h=280) -> str:
    series: dict[str, list] = {}
    names: dict[int, str] = {}
    for r in rows:
        v = r[key]
        if v is not None and v > 0:
            series.setdefault(r["cell_id"], []).append((r["layer_index"], v))
            names[r["layer_index"]] = r["layer"]
    if not series:
        return f"<p>No per-layer rows for {html.escape(label)}.</p>"
    xs = sorted(names)
    ys = [math.log10(v) for s in series.values() for _, v in s]
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))
    y1 = y1 if y1 > y0 else y0 + 1
    px = lambda x: 60 + xs.index(x) / max(len(xs) - 1, 1) * (w - 90)  # noqa: E731
    py = lambda y: h - 40 - (y - y0) / (y1 - y0) * (h - 60)  # noqa: E731
    out = [f'<svg class="plot" id="{ident}" width="{w}" height="{h + 20 * len(series)}" '
           f'xmlns="http://www.w3.org/2000/svg"><text x="5" y="12" font-size="12">{html.escape(label)}</text>']
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="60" x2="{w - 20}" y1="{py(e):.1f}" y2="{py(e):.1f}" stroke="#eee"/>'
                   f'<text x="5" y="{py(e) + 4:.1f}" font-size="11">1e{e}</text>')
    for x in xs:
        out.append(f'<text x="{px(x) - 18:.1f}" y="{h - 22}" font-size="10">{html.escape(names[x])}</text>')
    for i, (cid, pts) in enumerate(sorted(series.items())):
        col = PALETTE[i % len(PALETTE)]
        pts = sorted(pts)
        path = " ".join(f"{px(x):.1f},{py(math.log10(v)):.1f}" for x, v in pts)
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.5" points="{path}"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(math.log10(v)):.1f}" r="2.5" fill="{col}"/>' for x, v in pts]
        out.append(f'<text x="65" y="{h + 15 + 20 * i}" font-size="12" fill="{col}">{html.escape(cid)}</text>')
    out.append("</svg>")
    return "".join(out)


def layers_section(rows: list[dict]) -> str:
    """The HTML of the per-layer section, or "" when no cell recorded layer states."""
    if not rows:
        return ""
    for r in rows:
        r["cosine_deficit"] = None if r["cosine_mean"] is None else 1.0 - r["cosine_mean"]
    return ("<h2>Where divergence starts: per-layer agreement with the reference</h2>"
            "<p>Each stack's residual stream after each decoder layer (and the final norm's output) against the "
            "reference's same rows: 1 &#8722; mean cosine, and the largest |&#8214;stack&#8214; / &#8214;ref&#8214; "
            "&#8722; 1| (the two gates: cosine is blind to a scale factor, the norm ratio is not; "
            "<code>matrix layers CELL</code> gives the verdict).</p>"
            + svg_layer_panel(rows, "cosine_deficit", "layers-cosine", "1 - cosine (mean over rows)")
            + svg_layer_panel(rows, "norm_ratio_dev_max", "layers-norm-ratio", "|norm ratio - 1| (max over rows)"))


def svg_paths(rows: list[dict], path: str, ident: str, w=760) -> str:
    """Two bars per stack, log scale: KL(ref || stack) on the prefill path and on `path`."""
    by: dict[str, dict[str, float]] = {}
    for r in rows:
        by.setdefault(r["cell_id"], {})[r["path"]] = r["kld_mean"]
    vals = [v for d in by.values() for v in d.values() if v and v > 0]
    if not vals:
        return f"<p>No {html.escape(path)} rows with a reference to compare.</p>"
    lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    hi = hi if hi > lo else lo + 1
    bx = lambda v: (w - 420) * (math.log10(v) - lo + 0.05) / (hi - lo + 0.05)  # noqa: E731
    h = 44 * len(by) + 30
    out = [f'<svg class="plot" id="{ident}" width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="330" y="{h - 5}" font-size="11">KL(ref || stack), log10 from 1e{lo} to 1e{hi}</text>']
    for i, (cid, d) in enumerate(sorted(by.items())):
        out.append(f'<text x="0" y="{44 * i + 24}" font-size="12">{html.escape(cid)}</text>')
        for j, name in enumerate(("prefill", path)):
            v = d.get(name)
            if v is None or v <= 0:
                continue
            y = 44 * i + 4 + 19 * j
            out.append(f'<rect x="330" y="{y}" width="{bx(v):.1f}" height="15" fill="{PALETTE[j]}"/>'
                       f'<text x="{335 + bx(v):.1f}" y="{y + 12}" font-size="11">{name} {v:.3g}</text>')
    out.append("</svg>")
    return "".join(out)


def paths_figure(rows: list[dict], path: str, ident: str) -> str:
    """One d-file path's bars and table (rows: summary_by_path rows of that rows_of)."""
    mine = [r for r in rows if r["path"] == path]
    body = "".join(
        f"<tr><td>{html.escape(r['cell_id'])}</td><td>{r['rows']}</td><td>{r['kld_vs_prefill_mean']:.3g}</td>"
        f"<td>{r['max_abs_diff_vs_prefill']:.3g}</td><td>{r['identical_share']:.0%}</td></tr>" for r in mine)
    return (svg_paths(rows, path, ident)
            + f"<table id=\"{path}\"><tr><th>cell</th><th>{path} rows</th><th>KL(prefill || {path}) mean</th>"
              f"<th>max |{path} - prefill|</th><th>bit-identical</th></tr>" + body + "</table>")
