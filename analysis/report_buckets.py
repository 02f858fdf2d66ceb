"""The report's long-context chart: each stack's mean KL per position bucket (the position_buckets
view), one line per stack across the buckets its model's rows reach."""

from __future__ import annotations

from analysis import report_plots as P
from common import metric_defs as D

SQL = """SELECT model, cell_id, bucket, lo, hi, rows, kld_mean, kld_stderr, top1_agreement, delta_p_mean
         FROM position_buckets ORDER BY model, cell_id, lo"""


def chart(data: dict, mine: list[dict], k: int) -> str:
    """The section of one model's measured stacks (mine), or nothing where their rows all lie in
    one bucket: a chart of one bucket per stack repeats the summary's mean."""
    ids = {c["cell_id"] for c in mine}
    rows = [r for r in data["buckets"] if r["cell_id"] in ids]
    buckets = sorted({(r["lo"], r["bucket"]) for r in rows})  # [(lo, label)] in position order
    if len(buckets) < 2:
        return ""
    at = {label: i for i, (_, label) in enumerate(buckets)}
    name = data["names"]
    series = []
    for c in mine:
        own = [r for r in rows if r["cell_id"] == c["cell_id"] and r["kld_mean"] is not None and r["kld_mean"] > 0]
        if own:
            xs = [at[r["bucket"]] for r in own]
            series.append(
                (name[c["cell_id"]], xs, [r["kld_mean"] for r in own], [2 * (r["kld_stderr"] or 0.0) for r in own])
            )
    every = ", ".join(b[0] for b in D.POSITION_BUCKETS)
    return (
        "<h3>KL divergence by position bucket: mean ± 2 s.e.</h3><p>Each row's KL by how far into its prompt "
        f"the row is (positions {every}; the position_buckets view): whether a stack drifts from its reference "
        "as the context grows.</p>"
        + (
            lines_with_errors(series, [label for _, label in buckets], f"kld-buckets-{k}")
            if series
            else P.no_data("KL is 0 in every bucket of every stack.")
        )
    )


def lines_with_errors(series: list[tuple[str, list[int], list[float], list[float]]], xticks: list[str], ident: str):
    """One line with markers per (label, xs, ys, ± half-widths), x categorical (xticks), log y."""
    with P.drawing(6.4, 2.8) as fig:
        ax = fig.subplots()
        for i, (lab, xs, ys, err) in enumerate(series):
            lo = [min(e, y * 0.999) for y, e in zip(ys, err)]  # a log axis has no room below 0
            ax.errorbar(
                xs, ys, yerr=[lo, err], marker="o", ms=3, lw=1.2, capsize=2, label=lab, gid=f"series-{i}", **P.style(i)
            )
        ax.set_yscale("log")
        P.log_ticks(ax.yaxis)
        ax.set_xticks(range(len(xticks)), xticks)
        ax.set_xlim(-0.4, len(xticks) - 0.6)
        ax.set_xlabel("position in the prompt")
        ax.set_ylabel("KL(reference ‖ stack), nats")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        return P.svg(fig, ident)
