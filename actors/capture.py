"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from typing import Any

from backends.base import Backend, sampled_positions


def fed_ids(ids: list[int], stride: int, max_tokens: int | None) -> tuple[list[int], list[int]]:
    """The ids a stack is fed and the positions kept: every stride-th and the last; with
    max_tokens only the prefix those positions need."""
    positions = sampled_positions(len(ids), stride)
    if max_tokens is not None:
        positions = [p for p in positions if p < max_tokens]
        ids = ids[:positions[-1] + 1]
    return ids, positions


def capture_shard(backend: Backend, writer, prompts: list[tuple[str, list[int]]], stride: int,
                  max_tokens: int | None = None) -> dict[str, Any]:
    """Every prompt's rows into writer (a ShardWriter, or a RemoteShard on a node that cannot
    see the warehouse), committed at the end; returns a small manifest (no arrays).

    max_tokens: keep only the sampled positions below it and feed just the prefix they
    need; logits at p depend on ids[0..p] only, so those rows mean what the full run's do."""
    t0 = time.perf_counter()
    forward_s = 0.0
    try:
        dtype = None
        for prompt_id, ids in prompts:
            ids, positions = fed_ids(ids, stride, max_tokens)
            # Row p holds the prediction for ids[p + 1]; the last row has no next token.
            next_ids = [ids[p + 1] if p + 1 < len(ids) else None for p in positions]
            tf = time.perf_counter()
            native = backend.forward(ids, positions)  # (rows, vocab), native dtype
            forward_s += time.perf_counter() - tf
            writer.add(prompt_id, positions, next_ids, native)
            dtype = str(native.dtype)
        path = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"path": str(path), "rows": writer.rows, "seconds": time.perf_counter() - t0,
            "forward_seconds": forward_s, "array_dtype": dtype}
