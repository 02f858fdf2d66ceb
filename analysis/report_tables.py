"""The report's text: its introduction (what KL and the centroid mean in this warehouse), the run
metadata (runs, hosts, engine versions, models) and the per-model tables."""

from __future__ import annotations

import html
import json
from collections import Counter

CENTROID_MEANS = {
    "mean_prob": "the normalised mean of the stacks' probabilities at that row",
    "mean_logprob": "the normalised geometric mean of the stacks' probabilities (the mean of their "
    "log-probabilities, renormalised)",
}


def _e(v) -> str:
    return html.escape("" if v is None else str(v))


def fmt(v, digits=4) -> str:
    """A table value as text: floats to `digits` significant digits, booleans as yes / no."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _g(v, digits=4) -> str:
    return html.escape(fmt(v, digits))


def html_table(ident: str, head: list[str], rows: list[list[str]]) -> str:
    """rows hold HTML already escaped."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table id="{ident}"><tr>{th}</tr>{body}</table>'


def intro(data: dict, warehouse: str) -> str:
    return (
        f"<p>Warehouse <code>{_e(warehouse)}</code>. A stack's KL is KL(P<sub>ref</sub> ‖ P<sub>stack</sub>) "
        "in nats of each captured row (repeat 0) against its model's reference cell, from log-softmax in float64. "
        "Each stack is named by what tells it apart from the others here (engine and dtype, then attention, "
        "options such as fp32 activations, ...); the stacks table gives each one's cell id.</p>"
        f'<p id="centroid-definition">{centroid_text(data)}</p>'
    )


def centroid_text(data: dict) -> str:
    """What the centroid is in this warehouse: the definition its centroid rows were computed with."""
    used = sorted({c["centroid"] for c in data["centroids"] if c["centroid"]})
    if not used:
        asked = sorted({c.get("centroid") or "" for c in data["stacks"]} - {""})
        return (
            "No centroid was computed"
            + (f" (the spec asked for centroid: {_e(', '.join(asked))})" if asked else "")
            + ": the charts compare each stack with its reference only."
        )
    groups = sorted({c["centroid_group"] for c in data["centroids"]})
    means = "; ".join(f"{_e(u)}: {CENTROID_MEANS.get(u, 'see docs/analysis.md')}" for u in used)
    return (
        f"The centroid of a group of stacks, at each row, is {means}; it is formed by the stacks that captured "
        f"that row. Groups here: {_e(', '.join(groups))}."
    )


def metadata(data: dict) -> str:
    return (
        "<h2>Runs, hosts and versions</h2>"
        + _runs(data["runs"])
        + _hosts(data["stacks"], data["names"])
        + _engines(data["stacks"])
        + _models(data["stacks"])
    )


def _runs(runs: list[dict]) -> str:
    rows = [
        [
            _e(r["run_id"]),
            _e(r["status"]),
            _e(r["started_at"]),
            _e(r["finished_at"]),
            _e(r["spec_name"]),
            _e((r["spec_sha256"] or "")[:12]),
            _e(r["executor"]),
            _e(r["host"]),
            _e(r["logit_matrix_version"]),
            f"{r['cells_done']}/{r['cells_total']}",
        ]
        for r in runs
    ]
    return html_table(
        "runs",
        [
            "run",
            "status",
            "started",
            "finished",
            "spec",
            "spec sha256",
            "executor",
            "driver host",
            "logit-matrix",
            "cells done",
        ],
        rows,
    )


def _hosts(cells: list[dict], names: dict) -> str:
    """One row per host that captured: its CPU, its GPU, the stacks it ran."""
    by: dict[str, dict] = {}
    for c in cells:
        if c["status"] != "done":
            continue
        fp = json.loads(c.get("fingerprint") or "{}")
        cpu = fp.get("cpu") or {}
        flags = [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sme") if (cpu.get("flags") or {}).get(f)
        ]
        gpus = _gpus(fp)
        h = by.setdefault(
            c["host"] or "?",
            {
                "cpu": f"{cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} cores "
                f"({' '.join(flags) or 'no vector flags recorded'})",
                "gpu": gpus,
                "stacks": [],
            },
        )
        h["stacks"].append(names.get(c["cell_id"], c["cell_id"]))
    rows = [
        [_e(host), _e(h["cpu"]), _e(h["gpu"]), _e(", ".join(sorted(set(h["stacks"]))))]
        for host, h in sorted(by.items())
    ]
    return html_table("hosts", ["host", "CPU", "GPU", "stacks"], rows)


def _gpus(fp: dict) -> str:
    """The host's GPUs by name, NVIDIA or AMD (actors/fingerprint.py), else Apple's
    Metal device, else what NVML said."""
    for vendor in ("nvidia", "rocm"):
        found = (fp.get(vendor) or {}).get("gpus") or []
        if found:
            return ", ".join(str(g.get("name") or "?") for g in found)
    metal = (fp.get("apple") or {}).get("metal")
    if isinstance(metal, dict):
        return str(metal.get("device_name") or metal.get("architecture") or "Apple GPU (Metal)")
    return str((fp.get("nvidia") or {}).get("status", ""))


def _engines(cells: list[dict]) -> str:
    """Each engine's library versions as its cells recorded them (several builds: each listed)."""
    seen: dict[str, Counter] = {}
    for c in cells:
        v = json.loads(c.get("versions") or "{}")
        seen.setdefault(c["engine"], Counter())[", ".join(f"{k} {x}" for k, x in sorted(v.items()) if x)] += 1
    rows = [[_e(e), "<br>".join(_e(s) for s in sorted(cnt))] for e, cnt in sorted(seen.items())]
    return html_table("engines", ["engine", "libraries"], rows)


def _models(cells: list[dict]) -> str:
    by: dict[str, dict] = {}
    for c in cells:
        by.setdefault(
            c["model"],
            {
                "vocab": c.get("vocab_size"),
                "weights": (c.get("weights_sha256") or "")[:16],
                "source": c.get("model_source"),
                "license": c.get("model_license"),
            },
        )
    rows = [[_e(m), _g(d["vocab"]), _e(d["source"]), _e(d["weights"]), _e(d["license"])] for m, d in sorted(by.items())]
    return html_table("models", ["model", "vocabulary", "source", "weights sha256", "license"], rows)


def stacks_table(data: dict, model: str) -> str:
    name = data["names"]
    rows = [
        [
            f"{_e(name.get(c['cell_id'], c['cell_id']))}",
            _g(c["rows"]),
            _g(c["kld_mean"]),
            _g(c["kld_stderr"], 2),
            _g(c["kld_p99"]),
            _g(c["top1_agreement"]),
            _g(c["js_mean"]),
            _g(c["ppl_ratio"], 5),
            _g(c["kld_centroid_stack"]),
            _g(c["rank_closest"]),
            _g(c["bit_reproducible"]),
            "reference" if c["is_reference"] else _g(c["below_resolution"]),
            f'<span class="id">{_e(c["cell_id"])}</span>',
        ]
        for c in data["cells"]
        if c["model"] == model
    ]
    return html_table(
        f"stacks-{_slug(model)}",
        [
            "stack",
            "rows",
            "KLD mean",
            "± s.e.",
            "KLD p99",
            "top-1",
            "JS",
            "PPL ratio",
            "KL to centroid",
            "rank",
            "bit-reproducible",
            "below resolution",
            "cell id",
        ],
        rows,
    )


def ranges_tables(data: dict, model: str) -> str:
    """KL per position range, and per range and prompt category (summary_by_range)."""
    ids = {c["cell_id"] for c in data["cells"] if c["model"] == model and not c["is_reference"]}
    name = data["names"]
    out = []
    for title, pick, ident in (
        ("By position range", lambda r: r["category"] is None, "ranges"),
        ("By position range and prompt category", lambda r: r["category"] is not None, "categories"),
    ):
        rows = [
            [
                _e(name.get(r["cell_id"], r["cell_id"])),
                _e(r["range"]),
                _e(r["category"] or ""),
                _g(r["rows"]),
                _g(r["kld_mean"]),
                _g(r["kld_stderr"], 2),
                _g(r["kld_p99"]),
                _g(r["top1_agreement"]),
            ]
            for r in data["ranges"]
            if r["cell_id"] in ids and pick(r)
        ]
        if rows:
            t = html_table(
                f"{ident}-{_slug(model)}",
                ["stack", "positions", "category", "rows", "KLD mean", "± s.e.", "KLD p99", "top-1"],
                rows,
            )
            out.append(
                f"<h3>{title}</h3>{t}"
                if ident == "ranges"
                else f"<details><summary>{title} ({len(rows)} rows)</summary>{t}</details>"
            )
    return "".join(out)


def _slug(s: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in s)
