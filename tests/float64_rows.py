"""The float64 side of the tests that check a view against the stored rows: a shard's rows widened
to float64, their log-softmax, and the position bucket a row falls in."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from common.metric_defs import POSITION_BUCKETS


def matrix(column, dtype=np.float64) -> np.ndarray:
    """A shard's `logits` column as one (rows, vocab) array of `dtype`: the stored float32 values,
    converted by numpy (a row as Python floats costs a second per few thousand rows)."""
    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return flat.astype(dtype).reshape(len(col), -1)


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
