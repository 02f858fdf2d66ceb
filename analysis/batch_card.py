"""A card's block of the batch_drift view: the card's stack evaluated among other sequences at each
batch size the warehouse holds, against the same stack at batch 1 (graded: bit-identical, or its KL)."""

from __future__ import annotations

# every batch size of the card cell's stack: its own batch-1 stack id, whatever batch the cell itself is
CARD_SQL = """SELECT batch_size, fill, rows, identical_rows, bit_identical, kld_mean, kld_se, kld_max, top1_agreement
              FROM batch_drift WHERE stack_id_batch_1 = (SELECT batch_of FROM cells WHERE cell_id = ?)
              ORDER BY batch_size"""


def line(r: dict) -> str:
    """One batch size's line: "batch 1 vs 8: bit-identical (40 rows)" or its KL."""
    head = f"batch 1 vs {r['batch_size']} ({r['fill']} fill)"
    if r["bit_identical"]:
        return f"{head}: bit-identical ({r['rows']} rows)"
    return (
        f"{head}: KL {r['kld_mean']:.3g} ± {r['kld_se'] or 0:.2g} nats (max {r['kld_max']:.3g}), "
        f"top-1 {r['top1_agreement']:.4f}, {r['identical_rows']} of {r['rows']} rows bit-identical"
    )


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines; none for a batch-free stack."""
    if not rows:
        return []
    return ["", "Batch composition (each prompt among batch - 1 other sequences, against batch 1):", ""] + [
        f"- {line(r)}" for r in rows
    ]
