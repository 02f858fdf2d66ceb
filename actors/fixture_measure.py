"""A stack measured against a fixture where its logits are made (in this process, or inside the
cell's Ray actor on whatever node runs it): the full-vocabulary rows never leave; only the
fixture's top-k rows come in and per-row metrics go out."""

from __future__ import annotations

from typing import Any

import numpy as np

from analysis.truncated import truncated_metrics
from store.warehouse import widen


def stack_rows(backend, prompts: list[tuple[list[int], list[int], list[int]]], n_rows: int, vocab: int) -> np.ndarray:
    """prompts: (token ids, fixture row indices, positions) -> the stack's logits (rows, vocab) float32."""
    stack = np.empty((n_rows, vocab), dtype=np.float32)
    for ids, idx, positions in prompts:
        stack[idx] = widen(backend.forward(ids, positions))[:, :vocab]
    return stack


def measure(
    backend,
    prompts: list[tuple[list[int], list[int], list[int]]],
    topk_ids: np.ndarray,
    topk_logits: np.ndarray,
    lse: np.ndarray,
    vocab: int,
) -> dict[str, Any]:
    stack = stack_rows(backend, prompts, len(lse), vocab)  # (rows, vocab)
    return {
        "metrics": truncated_metrics(topk_ids, topk_logits, lse, stack),
        "rows": len(stack),
        "nonfinite": int((~np.isfinite(stack).all(-1)).sum()),
    }
