"""A card's block of the kld_by_confidence view: a cell's KL and top-1 agreement by how sure its
reference was (the reference's top-1 probability, in the buckets of common/metric_defs.py
CONFIDENCE_EDGES). Its columns are the registry's aggregates shown there, named by their labels."""

from __future__ import annotations

from common import metric_defs as D

CARD_SQL = "SELECT * FROM kld_by_confidence WHERE cell_id = ? ORDER BY lo"


def columns(shown: str = D.BY_CONFIDENCE) -> list[tuple[str, list[str], str]]:
    """(header, the aliases it shows, format) per column of a card block of the view `shown`: a mean
    and its s.e. share one."""
    out = []
    for metric in D.REGISTRY:
        aggs = {a.kind: a.alias for a in metric.aggs if shown in a.shown}
        if "mean" in aggs and "stderr" in aggs:
            out.append((f"mean {metric.label} ± s.e.", [aggs.pop("mean"), aggs.pop("stderr")], "{:.4g} ± {:.2g}"))
        for kind, alias in aggs.items():
            fmt = "{:.4f}" if kind == "share" else "{:.4g}"
            out.append((f"{D.KIND_WORDS[kind]} {metric.label}".strip(), [alias], fmt))
    return out


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines (none without rows: metrics older than the reference's top-1 probability)."""
    if not rows:
        return []
    cols = columns()
    out = [
        "",
        "| reference top-1 probability | rows | " + " | ".join(h for h, _, _ in cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for r in rows:
        cells = [fmt.format(*(r[a] or 0 for a in aliases)) for _, aliases, fmt in cols]
        out.append(f"| {r['lo']:.1f}–{r['hi']:.1f} | {r['rows']} | " + " | ".join(cells) + " |")
    return out
