"""A card's block of the batch_drift view: the card's stack evaluated among other sequences at each
batch size the warehouse holds, against the same stack at batch 1 (graded: bit-identical, or its KL)."""

from __future__ import annotations

# every batch size of the card cell's stack (its batch-1 stack id, at any size of its own) captured by
# the card cell's engine build; a batch-free cell has no batch_of, so no rows
CARD_SQL = """WITH me AS (SELECT batch_of, build FROM cells WHERE cell_id = ?)
              SELECT d.batch_size, d.fill, d.rows, d.identical_rows, d.bit_identical, d.kld_mean, d.kld_stderr,
                     d.kld_max, d.top1_agreement
              FROM batch_drift d JOIN cells c USING (cell_id) JOIN me ON d.stack_id_batch_1 = me.batch_of
              WHERE c.build IS NOT DISTINCT FROM me.build
              ORDER BY d.batch_size"""


def line(r: dict) -> str:
    """One batch size's line: "batch 1 vs 8: bit-identical (40 rows)" or its KL."""
    head = f"batch 1 vs {r['batch_size']} ({r['fill']} fill)"
    if r["bit_identical"]:
        return f"{head}: bit-identical ({r['rows']} rows)"
    return (
        f"{head}: KL {r['kld_mean']:.3g} ± {r['kld_stderr'] or 0:.2g} nats (max {r['kld_max']:.3g}), "
        f"top-1 {r['top1_agreement']:.4f}, {r['identical_rows']} of {r['rows']} rows bit-identical"
    )


def card_lines(rows: list[dict]) -> list[str]:
    """The block's markdown lines; none for a batch-free stack."""
    if not rows:
        return []
    return ["", "Batch composition (each prompt among batch - 1 other sequences, against batch 1):", ""] + [
        f"- {line(r)}" for r in rows
    ]
