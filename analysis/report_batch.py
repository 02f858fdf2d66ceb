"""The report's batch section of a model: KL against batch 1 by batch size, one line per stack (log
y: a size whose rows are bit-identical to batch 1's has no point), and the batch_drift rows as a
table, so a stack bit-identical at every size is there too."""

from __future__ import annotations

import html

from analysis import report_plots as P
from analysis import report_tables as T
from analysis.batch_drift import VIEW


def section(data: dict, model: str, k: int) -> str:
    """The model's batch section; empty where it has no batch cell measured against batch 1."""
    rows = [r for r in (data.get("plugin_views") or {}).get(VIEW) or [] if r["model"] == model]
    if not rows:
        return ""
    # each row's stack: the label of its batch-1 cell without its batch word
    stack = {b1: _stack(data["names"].get(b1, b1)) for b1 in {r["batch_1_cell_id"] for r in rows}}
    rows.sort(key=lambda r: (stack[r["batch_1_cell_id"]], r["batch_size"]))
    by_stack: dict[str, list[dict]] = {}
    for r in rows:
        by_stack.setdefault(stack[r["batch_1_cell_id"]], []).append(r)
    sizes = sorted({1} | {r["batch_size"] for r in rows})
    series = [
        (label, [sizes.index(r["batch_size"]) for r in rs], [r["kld_mean"] for r in rs])
        for label, rs in by_stack.items()
    ]
    head = "stack|batch|fill|rows|bit-identical rows|KL vs batch 1|± s.e.|max|top-1|KL vs reference".split("|")
    body = [[html.escape(T.fmt(v)) for v in _cells(r, stack)] for r in rows]
    return (
        "<h3>Batch drift: each stack among other sequences, against itself at batch 1</h3>"
        + P.lines(series, f"batch-{k}", "batch size", "KL(batch 1 ‖ batch B), nats", [str(s) for s in sizes])
        + T.html_table(f"batch-rows-{k}", head, body)
    )


def _cells(r: dict, stack: dict) -> tuple:
    """One table row: the stack (by its batch-1 cell), the batch, and its drift."""
    keys = ("batch_size", "fill", "rows", "kld_mean", "kld_stderr", "kld_max", "top1_agreement", "kld_vs_reference")
    got = [r[k] for k in keys]
    return stack[r["batch_1_cell_id"]], *got[:3], f"{r['identical_rows']} of {r['rows']}", *got[3:]


def _stack(label: str) -> str:
    """A batch-1 cell's label without its batch word: the stack the line follows."""
    return "/".join(w for w in label.split("/") if w != "batch1")
