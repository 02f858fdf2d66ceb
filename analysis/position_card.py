"""A card's block of the position_buckets view: a cell's KL, top-1 agreement and mean Δp by how far
into its prompt a row is (common/metric_defs.py POSITION_BUCKETS). Its columns are the registry's
aggregates shown there, named by their labels, as the confidence block's are."""

from __future__ import annotations

from analysis.confidence import columns
from common import metric_defs as D

CARD_SQL = """SELECT bucket, lo, hi, rows, nonfinite_rows, kld_mean, kld_stderr, top1_agreement, delta_p_mean
              FROM position_buckets WHERE cell_id = ? ORDER BY lo"""


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines; none where the rows lie in one bucket (the card's mean says it all)."""
    if len(rows) < 2:
        return []
    cols = columns(D.BY_POSITION)
    out = [
        "",
        "| positions | rows | " + " | ".join(h for h, _, _ in cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for r in rows:
        cells = [fmt.format(*(r[a] or 0 for a in aliases)) for _, aliases, fmt in cols]
        out.append(f"| {r['bucket']} | {r['rows']} | " + " | ".join(cells) + " |")
    return out
