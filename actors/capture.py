"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

import extras
from backends.base import Backend
from common.positions import Positions
from store.floors import Storage

OVERLAP_BYTES = 1 << 29  # a prompt's rows up to this size are kept while the next forward runs


class Overlap:
    """A prompt's row work (fn(prompt_id, positions, next_ids, rows, ...)) on one worker thread
    while the next prompt's forward runs. One prompt in flight, in prompt order, so at most two
    prompts' rows are in memory; rows over OVERLAP_BYTES are done on the spot, and so is every
    prompt's when not beside (then between forwards). A failure there surfaces at the next
    hand-over, and a failure anywhere waits out the prompt in flight before the writer is
    touched again."""

    def __init__(self, beside: bool = True):
        self.beside = beside
        self.pending = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="capture-keep")

    def submit(self, fn, prompt_id: str, positions: list[int], next_ids: list, rows: np.ndarray, *more) -> None:
        self.drain()
        if not self.beside or rows.nbytes > OVERLAP_BYTES:
            fn(prompt_id, positions, next_ids, rows, *more)
        else:
            self.pending = self.pool.submit(fn, prompt_id, positions, next_ids, rows, *more)

    def drain(self) -> None:
        """Wait for the prompt in flight; its exception is raised here, as raised there."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def settle(self, error: BaseException) -> None:
        """After a failure elsewhere: wait the prompt in flight out; its own failure goes on error's notes."""
        pending, self.pending = self.pending, None
        if pending is not None and (other := pending.exception()) is not None and other is not error:
            error.add_note(f"the rows of the prompt before failed too: {type(other).__name__}: {other}")

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def capture_shard(
    backend: Backend,
    writer,
    prompts: list[tuple[str, list[int]]],
    keep: Positions | int,
    max_tokens: int | None = None,
    store: str = "native",
    observe=None,
    side_writers: dict | None = None,
) -> dict[str, Any]:
    """Every prompt's rows into writer (a ShardWriter, or a RemoteShard on a node that cannot
    see the warehouse), committed at the end; returns a small manifest (no arrays).

    side_writers: {table: the same kind of writer} for the per-cell extras the stack asks for
    (extras/): each extra's capturer sees every prompt's rows and writes its own to its table
    (lossless). They commit first: a logits shard then never exists without them.

    max_tokens: keep only the sampled positions below it and feed just the prefix they
    need; logits at p depend on ids[0..p] only, so those rows mean what the full run's do.
    observe(prompt_id, positions, stored, shift): called with each prompt's rows as stored, in
    prompt order, beside the shard's write of them (see _rows_beside for when)."""
    t0 = time.perf_counter()
    side = Extras(backend, side_writers or {})
    work = RowWork(Storage(store, reuse=True), writer, observe)  # done with a prompt's stored rows before the next
    stage = Overlap(beside=_rows_beside(backend, observe))
    if not side.parts:  # only this loop calls forward(): a prompt's rows are done with two forwards later
        backend.keep_outputs(2)
    try:
        dtype, forward_s = _forward_each(prompts, keep, max_tokens, side, partial(stage.submit, work))
        stage.drain()
        side.commit()
        path = writer.commit()
    except BaseException as e:
        stage.settle(e)  # the writer is never aborted under a write still in flight
        writer.abort()
        side.abort()
        raise
    finally:
        stage.close()
        work.close()
        backend.keep_outputs(0)
    return {
        "path": str(path),
        "rows": writer.rows,
        "seconds": time.perf_counter() - t0,
        "forward_seconds": forward_s,
        "array_dtype": dtype,
        "storage": work.storage.summary(),
        "extras": side.summary(),
    }


def _rows_beside(backend: Backend, observe) -> bool:
    """Whether a prompt's row work runs beside the next forward (Overlap) rather than between forwards.

    A reference's rows are written beside the next forward; a candidate's are also measured, and
    where the engine's threads keep their cores while they wait, that work goes between forwards
    instead (Backend.rows_beside_forward)."""
    return observe is None or backend.rows_beside_forward()


def _forward_each(
    prompts: list[tuple[str, list[int]]], keep: Positions | int, max_tokens: int | None, side: Extras, hand_over
) -> tuple[str | None, float]:
    """Each prompt's forward over the prefix its kept positions need, its rows handed over in
    prompt order (hand_over(prompt_id, positions, next_ids, rows)).

    -> (the rows' array dtype, or None when no prompt had a row; seconds spent in forward)."""
    keep = Positions.every(keep) if isinstance(keep, int) else keep
    dtype, forward_s = None, 0.0
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
        hand_over(prompt_id, positions, next_ids, native)
    return dtype, forward_s


class RowWork:
    """What becomes of a prompt's rows: rounded (Storage), then written to the shard and, when
    the capture measures against its reference, measured, the two side by side (both only
    read the stored rows; the writer's encoding is one thread, the comparison another)."""

    def __init__(self, storage: Storage, writer, observe):
        self.storage, self.writer, self.observe = storage, writer, observe
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="capture-write") if observe is not None else None

    def __call__(self, prompt_id: str, positions: list[int], next_ids: list, native: np.ndarray) -> None:
        stored, shift = self.storage.keep(native)
        if self.pool is None:
            self.writer.add(prompt_id, positions, next_ids, stored, shift)
            return
        written = self.pool.submit(self.writer.add, prompt_id, positions, next_ids, stored, shift)
        try:
            self.observe(prompt_id, positions, stored, shift)
        finally:
            written.result()  # the write's own failure is raised here, after the measurement's

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class Extras:
    """The per-cell extras of one capture (extras/): their capturers in order, around each prompt's
    forward. One that taps the forward gives the rows; the others read them after."""

    def __init__(self, backend: Backend, writers: dict):
        self.writers = writers
        asked = [(x, v) for x, v in extras.of(backend.stack) if x.table in writers] if writers else []
        self.parts = [
            (x.key, x.capturer(backend, v, writers[x.table])) for x, v in sorted(asked, key=lambda xv: xv[0].order)
        ]
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
