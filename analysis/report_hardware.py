"""The report's drift atlas of a model: its stacks (rows) against the hardware (columns: the CPU code
paths, then other devices, a GPU merged in from its own warehouse), each
square coloured by the stack's KL against itself on the reference hardware, a bit-identical one marked ≡;
beside it, on one log axis, each stack's largest KL across paths and every stack's KL against the
reference (the quant ladder's), so a reader sees whether another CPU moves a stack more or less than
quantising it; then the hardware_drift rows as a table."""

from __future__ import annotations

import html

from analysis import report_plots as P
from analysis import report_tables as T
from analysis.hardware_drift import VIEW
from common import cpu_paths

IDENTICAL = "≡"


def section(data: dict, model: str, k: int) -> str:
    """The model's hardware section; empty where nothing was measured against the reference hardware."""
    rows = [r for r in (data.get("plugin_views") or {}).get(VIEW) or [] if r["model"] == model]
    if not rows:
        return ""
    names = data.get("names") or {}
    stack = {
        r["reference_hardware_cell_id"]: names.get(r["reference_hardware_cell_id"], r["reference_hardware_cell_id"])
        for r in rows
    }
    seen = {r["hardware"] for r in rows}
    paths = [p for p in cpu_paths.NAMES if p in seen] + sorted(seen - set(cpu_paths.NAMES))  # then devices
    grid = {(stack[r["reference_hardware_cell_id"]], r["hardware"]): (r["kld_mean"], r["bit_identical"]) for r in rows}
    head = "stack|hardware|kernels|oneDNN bf16|rows|bit-identical rows|KL vs reference hardware|± s.e.|p99|max|top-1"
    head += "|KL vs reference"
    keys = ("hardware", "kernels", "onednn_isa", "rows", "identical_rows", "kld_mean", "kld_stderr")
    body = [
        [html.escape(T.fmt(v)) for v in (stack[r["reference_hardware_cell_id"]], *(r[k] for k in keys))]
        + [html.escape(T.fmt(r[k])) for k in ("kld_p99", "kld_max", "top1_agreement", "kld_vs_reference")]
        + [html.escape(T.fmt(r[k])) for k in ("first_layer_differing", "first_layer_max_abs_diff")]
        for r in sorted(rows, key=lambda r: (stack[r["reference_hardware_cell_id"]], paths.index(r["hardware"])))
    ]
    return (
        "<h3>Across hardware: each stack against itself on the reference hardware</h3>"
        f"<p>{IDENTICAL}: every row bit-identical to the reference hardware's; blank: not measured.</p>"
        + atlas(sorted(set(stack.values())), paths, grid, f"hardware-atlas-{k}")
        + "<h3>Changing the CPU against quantising: KL on one axis</h3>"
        + P.dots(_ladder(data, model, rows, stack), f"hardware-ladder-{k}", "KL, nats")
        + T.html_table(f"hardware-rows-{k}", [*head.split("|"), "first layer apart", "its max |Δ|"], body)
    )


def _ladder(data: dict, model: str, rows: list[dict], stack: dict) -> list[tuple[str, dict]]:
    """Each stack's largest KL across CPU paths beside its KL against the reference, then every other
    measured stack of the model (the quant ladder) with its KL against the reference."""
    paths = {r["cell_id"] for r in rows}
    kl = {c["cell_id"]: c.get("kld_mean") for c in data["cells"] if c["model"] == model}
    out = []
    for home, label in sorted(stack.items(), key=lambda s: s[1]):
        most = max(r["kld_mean"] or 0.0 for r in rows if r["reference_hardware_cell_id"] == home)
        out.append((label, {"largest across hardware": most, "against the reference": kl.get(home)}))
    names = data.get("names") or {}
    for c in data["cells"]:
        if c["model"] == model and c["cell_id"] not in paths and c["cell_id"] not in stack:
            out.append((names.get(c["cell_id"], c["cell_id"]), {"against the reference": kl.get(c["cell_id"])}))
    return out


def atlas(stacks: list[str], paths: list[str], grid: dict, ident: str) -> str:
    """stacks x hardware squares, a log colour scale of KL against the reference hardware; ≡ where bit-identical."""
    import numpy as np
    from matplotlib.colors import LogNorm

    values = np.full((len(stacks), len(paths)), np.nan)
    for (s, p), (kl, _) in grid.items():
        if kl:
            values[stacks.index(s), paths.index(p)] = kl
    longest = max(len(s) for s in stacks) * 0.065
    with P.drawing(1.6 + longest + 0.55 * len(paths), 0.9 + 0.4 * len(stacks)) as fig:
        ax = fig.subplots()
        shown = values[~np.isnan(values)]
        lo, hi = (shown.min(), shown.max()) if shown.size else (1e-12, 1e-11)
        im = ax.imshow(
            np.ma.masked_invalid(values), cmap="viridis", norm=LogNorm(lo, hi if hi > lo else lo * 10), gid="series-0"
        )
        for (s, p), (_, same) in grid.items():
            if same:
                ax.text(paths.index(p), stacks.index(s), IDENTICAL, ha="center", va="center", fontsize=12)
        ax.set_xticks(range(len(paths)), paths, rotation=30, ha="right")
        ax.set_yticks(range(len(stacks)), stacks)
        ax.grid(False)
        ax.tick_params(length=0)
        bar = fig.colorbar(im, ax=ax, shrink=0.9)
        bar.set_label("KL(reference hardware ‖ hardware), nats")
        P.log_ticks(bar.ax.yaxis)
        return P.svg(fig, ident)
