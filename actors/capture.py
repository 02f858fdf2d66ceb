"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from typing import Any

from backends.base import Backend
from common.positions import Positions


def fed_ids(ids: list[int], keep: Positions | int, max_tokens: int | None) -> tuple[list[int], list[int]]:
    """The ids a stack is fed and the positions kept (keep: the spec's positions, or a plain
    stride); only the prefix the last kept position needs is fed. ([], []) when none is kept."""
    keep = Positions.every(keep) if isinstance(keep, int) else keep
    positions = keep.of(len(ids))
    if max_tokens is not None:
        positions = [p for p in positions if p < max_tokens]
    return (ids[:positions[-1] + 1], positions) if positions else ([], [])


def capture_shard(backend: Backend, writer, prompts: list[tuple[str, list[int]]], keep: Positions | int,
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
            fed, positions = fed_ids(ids, keep, max_tokens)
            if not positions:  # the window misses this prompt: no rows, no forward
                continue
            # Row p holds the prediction for ids[p + 1] of the whole prompt (a window or a prefix
            # feeds less); only the prompt's last row has no next token.
            next_ids = [ids[p + 1] if p + 1 < len(ids) else None for p in positions]
            ids = fed
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
