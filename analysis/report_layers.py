"""The report's per-layer and off-prefill parts. Per layer: 1 - cosine and |norm ratio - 1| by layer, one line per
stack, against the reference's same layer (the layer_summary view); log scale, because the stacks
of a quant ladder sit orders of magnitude apart and the gates are thresholds on these very numbers.
Off the prefill: for a path of the d<repeat> file, each cell's KL to the reference on its prefill rows
and on that path's rows at the same positions (summary_by_path), with how far its two paths are apart."""

from __future__ import annotations

import html

from analysis import report_plots as P


def _label(names: dict, cell_id: str) -> str:
    return names.get(cell_id, cell_id)


def layer_lines(rows: list[dict], key: str, ident: str, label: str, names: dict) -> str:
    """One line per stack of rows[key] by layer, the layers in their order on a categorical x axis."""
    order = {r["layer_index"]: r["layer"] for r in rows}
    xs = sorted(order)
    series: dict[str, tuple[list, list]] = {}
    for r in sorted(rows, key=lambda r: r["layer_index"]):
        s = series.setdefault(_label(names, r["cell_id"]), ([], []))
        s[0].append(xs.index(r["layer_index"]))
        s[1].append(r[key])
    return P.lines(
        [(lab, x, y) for lab, (x, y) in sorted(series.items())], ident, "state", label, xticks=[order[x] for x in xs]
    )


def per_model(rows: list[dict], model_of: dict | None, ident: str) -> list[tuple[str, list[dict]]]:
    """(chart id, rows) per model of rows, in model order: stacks of two models never share a chart
    (their layers and vocabularies differ). One model keeps `ident`; several get ident-0, ident-1, ..."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault((model_of or {}).get(r["cell_id"], ""), []).append(r)
    models = sorted(by)
    return [(ident if len(models) == 1 else f"{ident}-{k}", by[m]) for k, m in enumerate(models)]


def layers_section(rows: list[dict], names: dict | None = None, model_of: dict | None = None) -> str:
    """The HTML of the per-layer section, or "" when no cell recorded layer states."""
    if not rows:
        return ""
    names = names or {}
    for r in rows:
        r["cosine_deficit"] = None if r["cosine_mean"] is None else 1.0 - r["cosine_mean"]
    charts = "".join(
        layer_lines(mine, "cosine_deficit", ident, "1 − cosine (mean over rows)", names)
        + layer_lines(
            mine,
            "norm_ratio_dev_max",
            ident.replace("layers-cosine", "layers-norm-ratio"),
            "|norm ratio − 1| (max over rows)",
            names,
        )
        for ident, mine in per_model(rows, model_of, "layers-cosine")
    )
    return (
        "<h2>Where divergence starts: per-layer agreement with the reference</h2>"
        "<p>Each stack's residual stream after each decoder layer (and the final norm's output) against the "
        "reference's same rows: 1 &#8722; mean cosine, and the largest |&#8214;stack&#8214; / &#8214;ref&#8214; "
        "&#8722; 1| (the two gates: cosine is blind to a scale factor, the norm ratio is not; "
        "<code>matrix layers STACK</code> gives the verdict). One chart per model.</p>" + charts
    )


def paths_figure(
    rows: list[dict], path: str, ident: str, names: dict | None = None, model_of: dict | None = None
) -> str:
    """One d-file path's charts, one per model (each stack's KL to the reference on its prefill rows and on
    `path`'s, log scale), and its table (rows: summary_by_path rows of that rows_of)."""
    names = names or {}
    charts = []
    for chart, mine in per_model(rows, model_of, ident):
        by: dict[str, dict[str, float]] = {}
        for r in mine:
            by.setdefault(_label(names, r["cell_id"]), {})[r["path"]] = r["kld_mean"]
        charts.append(
            P.dots(
                [(lab, {"prefill": d.get("prefill"), path: d.get(path)}) for lab, d in sorted(by.items())],
                chart,
                "KL(reference ‖ stack) mean, nats",
            )
        )
    body = "".join(
        f"<tr><td>{html.escape(_label(names, r['cell_id']))}</td><td>{r['rows']}</td>"
        f"<td>{r['kld_vs_prefill_mean']:.3g}</td>"
        f"<td>{r['max_abs_diff_vs_prefill']:.3g}</td><td>{r['identical_share']:.0%}</td></tr>"
        for r in rows
        if r["path"] == path
    )
    return (
        "".join(charts)
        + f'<table id="{path}"><tr><th>stack</th><th>{path} rows</th><th>KL(prefill || {path}) mean</th>'
        f"<th>max |{path} - prefill|</th><th>bit-identical</th></tr>" + body + "</table>"
    )
