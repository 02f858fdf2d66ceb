"""KL against size: every measured stack whose weights file has a recorded size (a GGUF's, the
settings' `gguf_size`: file bytes, tensor bytes, parameters, bits per weight) with its KL to the
reference, and whether it is on the Pareto front of its model (no smaller file has a KL as low).
Quant authors and their readers choose a file by this chart (exllamav3's compare_q.py and
Unsloth's benchmark pages plot it). The view `frontier`, its card table and its report chart."""

from __future__ import annotations

import html

from analysis import report_plots as P
from analysis import report_tables as T
from common.output import fmt_number

VIEW = "frontier"
# Pareto: its KL is below the lowest KL of every smaller file of its model (a tie in size: the lower KL first)
VIEW_SQL = """
    WITH f AS (
        SELECT s.model, s.cell_id, s.engine, s.dtype,
               CAST(json_extract(c.settings, '$.gguf_size.file_bytes') AS BIGINT) AS file_bytes,
               CAST(json_extract(c.settings, '$.gguf_size.tensor_bytes') AS BIGINT) AS tensor_bytes,
               CAST(json_extract(c.settings, '$.gguf_size.parameters') AS BIGINT) AS parameters,
               CAST(json_extract(c.settings, '$.gguf_size.bits_per_weight') AS DOUBLE) AS bits_per_weight,
               s.kld_mean, s.kld_stderr, s.kld_p99, s.kld_p999, s.top1_agreement, s.ppl_ratio
        FROM summary s JOIN cells c USING (cell_id)
        WHERE NOT s.is_reference AND json_extract(c.settings, '$.gguf_size') IS NOT NULL)
    SELECT f.*, coalesce(f.kld_mean < min(f.kld_mean) OVER (
               PARTITION BY f.model ORDER BY f.file_bytes, f.kld_mean, f.cell_id
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), true) AS pareto
    FROM f"""
VIEW_ABOUT = (
    "every measured stack with a sized weights file (a GGUF): file and tensor bytes, parameters, bits per "
    "weight, its KL to the reference (mean, s.e., p99, p99.9), and whether no smaller file of its model "
    "has a KL as low (pareto)"
)
CARD_SQL = f"SELECT * FROM {VIEW} WHERE model = ? ORDER BY file_bytes, kld_mean, cell_id"
MIB = 2**20


def card_lines(rows: list[dict], cell_id: str, names: dict[str, str] | None = None) -> list[str]:
    """The card's table of its model's files by size (this cell marked), empty without sized files."""
    if not rows:
        return []
    out = [
        "",
        "| file (KL against size) | MiB | bits/weight | mean KLD ± s.e. | p99.9 KLD | Pareto |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = (names or {}).get(r["cell_id"], r["cell_id"])
        mark = " (this card)" if r["cell_id"] == cell_id else ""
        out.append(
            f"| {name}{mark} | {r['file_bytes'] / MIB:.1f} | {r['bits_per_weight']:.3f} | "
            f"{r['kld_mean']:.4g} ± {r['kld_stderr'] or 0:.2g} | {fmt_number(r['kld_p999'])} | "
            f"{'yes' if r['pareto'] else ''} |"
        )
    return out


def section(data: dict, model: str, k: int) -> str:
    """The report's chart of a model's files: KL (mean and p99.9, log axis) against file size and
    bits per weight, the Pareto front joined and labelled."""
    rows = [r for r in data.get("frontier", []) if r["model"] == model and r["kld_mean"]]
    if not rows:
        return ""
    names = data["names"]
    head = "<h3>KL against size</h3>"
    note = (
        f"<p>{len(rows)} file(s); the Pareto front (no smaller file has a KL as low) is joined and labelled. "
        "KL in nats on a log axis: the mean as circles, p99.9 as triangles.</p>"
    )
    with P.drawing(9.6, 3.6) as fig:
        axes = fig.subplots(1, 2, sharey=True)
        for ax, (key, label, scale) in zip(
            axes, (("file_bytes", "file size (MiB)", MIB), ("bits_per_weight", "bits per weight", 1))
        ):
            _panel(ax, rows, names, key, scale, labelled=ax is axes[-1])
            ax.set_xlabel(label)
        axes[0].set_ylabel("KL to the reference (nats)")
        chart = P.svg(fig, f"frontier-{k}")
    return head + note + chart + _table(rows, names, k)


def _panel(ax, rows: list[dict], names: dict, key: str, scale: float, labelled: bool) -> None:
    for i, (metric, marker) in enumerate((("kld_mean", "o"), ("kld_p999", "^"))):
        pts = [(r[key] / scale, r[metric]) for r in rows if r[metric]]
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker,
            color=P.COLOURS[i],
            ms=4,
            linestyle="none",
            label="mean" if metric == "kld_mean" else "p99.9",
            gid=f"series-{i}",
        )
    front = sorted((r[key] / scale, r["kld_mean"], names.get(r["cell_id"], r["cell_id"])) for r in rows if r["pareto"])
    ax.plot([x for x, _, _ in front], [y for _, y, _ in front], "-", color=P.COLOURS[0], lw=1, gid="pareto")
    ax.set_yscale("log")
    P.log_ticks(ax.yaxis)
    if not labelled:  # the legend where no leader line crosses it
        ax.legend(loc="upper right", frameon=False)
        return
    # the front's names in a column right of the panel, top to bottom in the order of their KL,
    # each with a leader line to its point: labels beside the points overlap where files crowd
    ordered = sorted(front, key=lambda p: -p[1])
    for j, (x, y, name) in enumerate(ordered):
        ax.annotate(
            name,
            xy=(x, y),
            xytext=(1.04, 1 - (j + 0.5) / len(ordered)),
            textcoords="axes fraction",
            fontsize=7,
            va="center",
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.6", "shrinkA": 0, "shrinkB": 2},
        )


def _table(rows: list[dict], names: dict, k: int) -> str:
    head = ["stack", "MiB", "bits/weight", "mean KLD", "p99.9 KLD", "Pareto"]
    body = [
        [
            html.escape(names.get(r["cell_id"], r["cell_id"])),
            f"{r['file_bytes'] / MIB:.1f}",
            f"{r['bits_per_weight']:.3f}",
        ]
        + [T.fmt(r["kld_mean"]), T.fmt(r["kld_p999"]), "yes" if r["pareto"] else ""]
        for r in rows
    ]
    return T.html_table(f"frontier-rows-{k}", head, body)
