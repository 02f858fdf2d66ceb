"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import extras
from backends.base import Backend
from common.positions import Positions
from store.floors import Storage


def capture_shard(backend: Backend, writer, prompts: list[tuple[str, list[int]]], keep: Positions | int,
                  max_tokens: int | None = None, store: str = "native", observe=None,
                  side_writers: dict | None = None) -> dict[str, Any]:
    """Every prompt's rows into writer (a ShardWriter, or a RemoteShard on a node that cannot
    see the warehouse), committed at the end; returns a small manifest (no arrays).

    side_writers: {table: the same kind of writer} for the per-cell extras the stack asks for
    (extras/): each extra's capturer sees every prompt's rows and writes its own to its table
    (lossless). They commit first: a logits shard then never exists without them.

    max_tokens: keep only the sampled positions below it and feed just the prefix they
    need; logits at p depend on ids[0..p] only, so those rows mean what the full run's do.
    observe(prompt_id, positions, stored, shift): called with each prompt's rows as written."""
    t0 = time.perf_counter()
    forward_s = 0.0
    storage = Storage(store)
    keep = Positions.every(keep) if isinstance(keep, int) else keep
    side = Extras(backend, side_writers or {})
    try:
        dtype = None
        for prompt_id, ids in prompts:
            fed, positions = keep.fed(ids, max_tokens)
            if not positions:  # the window misses this prompt: no rows, no forward
                continue
            # Row p holds the prediction for ids[p + 1] of the whole prompt (a window or a prefix
            # feeds less); only the prompt's last row has no next token.
            next_ids = [ids[p + 1] if p + 1 < len(ids) else None for p in positions]
            tf = time.perf_counter()
            native = side.forward(prompt_id, ids, fed, positions)  # (rows, vocab), native dtype
            forward_s += time.perf_counter() - tf
            dtype = str(native.dtype)
            stored, shift = storage.keep(native)
            writer.add(prompt_id, positions, next_ids, stored, shift)
            if observe is not None:
                observe(prompt_id, positions, stored, shift)
        side.commit()
        path = writer.commit()
    except BaseException:
        writer.abort()
        side.abort()
        raise
    return {"path": str(path), "rows": writer.rows, "seconds": time.perf_counter() - t0,
            "forward_seconds": forward_s, "array_dtype": dtype, "storage": storage.summary(), "extras": side.summary()}


class Extras:
    """The per-cell extras of one capture (extras/): their capturers in order, around each prompt's
    forward. One that taps the forward gives the rows; the others read them after."""

    def __init__(self, backend: Backend, writers: dict):
        self.writers = writers
        asked = [(x, v) for x, v in extras.of(backend.stack) if x.table in writers] if writers else []
        self.parts = [(x.key, x.capturer(backend, v, writers[x.table]))
                      for x, v in sorted(asked, key=lambda xv: xv[0].order)]
        self.backend = backend
        self.tap = next((c for _, c in self.parts if c.taps_forward), None)

    def forward(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int]) -> np.ndarray:
        rows = self.tap.forward(prompt_id, fed, positions) if self.tap else self.backend.forward(fed, positions)
        for _, c in self.parts:
            c.after(prompt_id, whole, fed, positions, rows)
        return rows

    def commit(self) -> None:
        for w in self.writers.values():
            w.commit()

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()

    def summary(self) -> dict[str, Any]:
        return {key: got for key, c in self.parts if (got := c.summary()) is not None}
