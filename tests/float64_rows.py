"""The float64 side of the tests that check a view against the stored rows: a shard's rows widened
to float64, their log-softmax, and the position bucket a row falls in."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from common.metric_defs import POSITION_BUCKETS
from store.values import logits_matrix


def matrix(column, dtype=np.float64) -> np.ndarray:
    """A shard's `logits` column as one (rows, vocab) array of `dtype`, widened exactly by numpy
    (store.values.logits_matrix: refuses rows not kept and rows of other lengths), not row by row
    through Python floats (seconds a shard)."""
    return logits_matrix(column).astype(dtype)


def stored(wh, cell_id: str) -> dict[tuple[str, int], tuple[np.ndarray, int | None]]:
    """(prompt, position) -> (its logits widened to float64, its next token), as the shard holds them."""
    t = pq.read_table(
        wh / "logits" / cell_id / "r0.parquet", columns=["prompt_id", "position", "next_token_id", "logits"]
    )
    x = matrix(t["logits"])  # (rows, vocab)
    keys = zip(t["prompt_id"].to_pylist(), t["position"].to_pylist(), t["next_token_id"].to_pylist())
    return {(p, q): (x[i], n) for i, (p, q, n) in enumerate(keys)}


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def bucket(position: int) -> str:
    return next(label for label, lo, hi in POSITION_BUCKETS if position >= lo and (hi is None or position < hi))
