"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

import extras
from actors.lanes import Ahead, forward_ahead, lanes_for
from backends.base import Backend, LengthRefused
from common.positions import Positions
from common.positions import next_ids as predicted  # the local name next_ids is the list it gives
from store.floors import Storage
from store.prompt_rows import PromptRows

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
    prompt order, beside the shard's write of them (see _rows_beside for when).

    A forward the engine refuses for its length (LengthRefused) is fed a longer prefix of the
    prompt, or, where none is taken, that prompt's rows are left out (feed()); the manifest's
    length_refusals says which (None: none), and the logits shard's footer names the prompts
    left out (store/schema.py REFUSED_KEY)."""
    t0 = time.perf_counter()
    side = Extras(backend, side_writers or {}, prompts, max_tokens)
    work = RowWork(Storage(store, reuse=True), writer, observe)  # done with a prompt's stored rows before the next
    stage = Overlap(beside=_rows_beside(backend, observe))
    refused = Refusals()
    if not side.parts:  # only this loop calls forward(): a prompt's rows are done with two forwards later (a lane's)
        backend.keep_outputs(2)
    try:
        plan = _plan(prompts, keep, max_tokens)
        dtype, forward_s, lanes = _forward_all(backend, plan, max_tokens, side, stage, work, refused)
        stage.drain()
        side.commit()
        path = writer.commit(refused.skipped or None)
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
        "lanes": lanes,
        "array_dtype": dtype,
        "storage": work.storage.summary(),
        "extras": side.summary(),
        "length_refusals": refused.summary(),
    }


def _rows_beside(backend: Backend, observe) -> bool:
    """Whether a prompt's row work runs beside the next forward (Overlap) rather than between forwards.

    A reference's rows are written beside the next forward; a candidate's are also measured, and
    where the engine's threads keep their cores while they wait, that work goes between forwards
    instead (Backend.rows_beside_forward)."""
    return observe is None or backend.rows_beside_forward()


def _forward_all(
    backend: Backend, plan: list[tuple], max_tokens: int | None, side: Extras, stage: Overlap, work, refused
):
    """Every planned prompt's forward, on the engine's lanes where they run (actors/lanes.py), else
    one after the other; returns, or raises, once no forward runs any more.

    -> (the rows' dtype or None, seconds spent in forward, the lanes used)."""
    hand_over = partial(stage.submit, work)
    lanes = lanes_for(backend, bool(side.parts), plan, side.streams)
    if lanes == 1:
        return (*_forward_each(plan, max_tokens, side, hand_over, refused, partial(_stream, stage, work)), 1)
    ahead = Ahead(backend, lanes)
    try:
        most = partial(limit, max_tokens=max_tokens)
        return (*forward_ahead(ahead, plan, side.forward, feed, most, hand_over, refused), lanes)
    except BaseException as e:
        ahead.settle(e)  # the other lanes' forwards waited out; their own failures go on e's notes
        raise
    finally:
        ahead.close()


def _plan(prompts: list[tuple[str, list[int]]], keep: Positions | int, max_tokens: int | None) -> list[tuple]:
    """(prompt_id, ids, need, positions) of each prompt with kept rows: the length of the prefix its
    kept positions need and those positions; a prompt the window misses has no rows and no forward."""
    keep = Positions.every(keep) if isinstance(keep, int) else keep
    planned = ((prompt_id, ids, keep.fed(ids, max_tokens)) for prompt_id, ids in prompts)
    return [(prompt_id, ids, len(fed), positions) for prompt_id, ids, (fed, positions) in planned if positions]


def _forward_each(
    plan: list[tuple],
    max_tokens: int | None,
    side: Extras,
    hand_over,
    refused: Refusals,
    stream_over=None,
) -> tuple[str | None, float]:
    """Each planned prompt's forward over the prefix its kept positions need (longer where the
    engine refuses that length: feed()), its rows handed over in prompt order (hand_over(prompt_id,
    positions, next_ids, rows)); a prompt whose every length is refused hands over nothing.
    Rows the engine streams (Backend.streams) go to stream_over(prompt_id, positions, next_ids,
    blocks) block by block as the forward gives them, where no extra needs them whole.

    -> (the rows' array dtype, or None when no prompt had a row; seconds spent in forward)."""
    dtype, forward_s = None, 0.0
    for prompt_id, ids, need, positions in plan:
        next_ids = predicted(ids, positions)
        tf = time.perf_counter()
        streamed = stream_over is not None and side.streams(len(positions))
        forward = side.forward_blocks if streamed else side.forward
        got = feed(partial(forward, prompt_id, positions=positions), ids, need, limit(ids, max_tokens))
        if got.rows is not None and not streamed:  # the extras' own work, once, on the rows kept
            side.after(prompt_id, ids, ids[: got.tokens], positions, got.rows)
        refused.add(prompt_id, need, len(positions), got)
        if got.rows is not None and streamed:  # stored as the forward goes: its time is the forward's too
            dtype = str(got.rows.dtype)
            stream_over(prompt_id, positions, next_ids, got.rows)
        forward_s += time.perf_counter() - tf
        if got.rows is not None and not streamed:
            dtype = str(got.rows.dtype)
            hand_over(prompt_id, positions, next_ids, got.rows)  # (rows, vocab), native dtype
    return dtype, forward_s


def _stream(stage: Overlap, work: RowWork, prompt_id: str, positions: list[int], next_ids: list, blocks) -> None:
    """A streamed prompt's rows, written as they come: the prompt before is done first (one
    writer, one Storage buffer), and nothing of this one is left for the next forward."""
    stage.drain()
    work.stream(prompt_id, positions, next_ids, blocks)


class Primed:
    """A streamed forward's blocks with the first one already asked for, so that a length the
    engine refuses (LengthRefused) is raised inside feed(), before anything is stored."""

    def __init__(self, blocks):
        self.blocks, self.first = blocks, next(blocks, None)
        if self.first is None:
            raise RuntimeError("a streamed forward gave no rows")
        self.dtype = self.first.dtype

    def __iter__(self):
        first, self.first = self.first, None
        yield first  # (block rows, vocab), valid until the next block is asked for
        yield from self.blocks


def limit(ids: list[int], max_tokens: int | None) -> int:
    """The most of a prompt's ids a forward may be fed: all of them, or max_tokens."""
    return len(ids) if max_tokens is None else min(len(ids), max_tokens)


@dataclass
class Fed:
    """What feed() ran: the rows (None: every length refused), the tokens of the forward that
    gave them, the lengths refused before, and the engine's reason for the last refusal."""

    rows: np.ndarray | None
    tokens: int
    refused: list[int]
    reason: str | None


def feed(forward, ids: list[int], need: int, most: int) -> Fed:
    """forward(ids[:n]) -> rows, from n = need (the prefix the kept rows need); where the engine
    refuses that length (LengthRefused), again with twice as many tokens, up to `most`. The rows
    kept mean the same whatever the prefix: logits at p depend on ids[0..p] only (causal
    attention), so a longer prefix leaves rows 0..need-1 what they are, up to the arithmetic a
    longer sequence's kernels do. Each try is a whole forward; the refused ones end where the
    kernel refuses them (usually the first attention layer)."""
    n, refused, reason = need, [], None
    while True:
        try:
            rows = forward(ids[:n])
        except LengthRefused as e:
            refused.append(n)
            reason = str(e)
            if n >= most:
                return Fed(None, n, refused, reason)
            n = min(2 * n, most)
        else:
            return Fed(rows, n, refused, reason)


class Refusals:
    """The lengths an engine refused in one capture (feed()): the prompts fed a longer prefix
    than their rows need, and those no prefix up to the whole prompt got past, whose rows the
    shard leaves out. Both repeats of a cell refuse the same (the kernel decides by shape), so
    their shards hold the same rows."""

    def __init__(self):
        self.longer: dict[str, dict] = {}  # prompt -> {"needed", "fed", "refused": [lengths], "reason"}
        self.skipped: dict[str, dict] = {}  # prompt -> {"rows", "refused": [lengths], "reason"}

    def add(self, prompt_id: str, need: int, rows: int, got: Fed) -> None:
        if got.rows is None:
            self.skipped[prompt_id] = {"rows": rows, "refused": got.refused, "reason": got.reason}
        elif got.refused:
            self.longer[prompt_id] = {"needed": need, "fed": got.tokens, "refused": got.refused, "reason": got.reason}

    def summary(self) -> dict[str, Any] | None:
        """The manifest's length_refusals (None: the engine took every length it was fed)."""
        if not self.longer and not self.skipped:
            return None
        rows = sum(s["rows"] for s in self.skipped.values())
        return {"longer_feeds": self.longer, "skipped": self.skipped, "skipped_rows": rows}


class RowWork:
    """What becomes of a prompt's rows: rounded (Storage), then written to the shard and, when
    the capture measures against its reference, measured, the two side by side (both only
    read the stored rows; the writer's encoding is one thread, the comparison another)."""

    def __init__(self, storage: Storage, writer, observe):
        self.storage, self.writer, self.observe = storage, writer, observe
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="capture-write") if observe is not None else None

    def __call__(self, prompt_id: str, positions: list[int], next_ids: list, native: np.ndarray) -> None:
        stored, shift = self.storage.keep(native)
        rows = PromptRows(prompt_id, positions, next_ids, stored, shift)
        if self.pool is None:
            self.writer.add(rows)
            return
        written = self.pool.submit(self.writer.add, rows)
        try:
            self.observe(prompt_id, positions, stored, shift)
        finally:
            written.result()  # the write's own failure is raised here, after the measurement's

    def stream(self, prompt_id: str, positions: list[int], next_ids: list, blocks) -> None:
        """A prompt's rows block by block (Primed): each rounded and measured, then written before
        the next block is decoded (ShardWriter.add_blocks), so one block is held, not the prompt."""

        def kept():
            at = 0
            for native in blocks:  # (block rows, vocab)
                stored, shift = self.storage.keep(native)
                if self.observe is not None:
                    self.observe(prompt_id, positions[at : at + len(native)], stored, shift)
                at += len(native)
                yield stored, shift

        self.writer.add_blocks(prompt_id, positions, next_ids, kept())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class Extras:
    """The per-cell extras of one capture (extras/): their capturers in order, around each prompt's
    forward. One that taps the forward gives the rows; the others read them after."""

    def __init__(self, backend: Backend, writers: dict, prompts: list, max_tokens: int | None):
        self.writers = writers
        # an extra with a side table runs where the caller gave its writer; one without (batch) always
        asked = [(x, v) for x, v in extras.of(backend.stack) if x.table is None or x.table in writers]
        made = [
            (x.key, x.capturer(backend, v, writers.get(x.table))) for x, v in sorted(asked, key=lambda xv: xv[0].order)
        ]
        self.parts = [(key, c) for key, c in made if c is not None]  # None: nothing runs in the capture
        for _, c in self.parts:
            c.start(prompts, max_tokens)
        self.backend = backend
        self.tap = next((c for _, c in self.parts if c.taps_forward), None)

    def forward(self, prompt_id: str, fed: list[int], positions: list[int]) -> np.ndarray:
        """The prompt's rows: (rows, vocab), native dtype. A length the engine refuses raises
        LengthRefused before any extra has kept anything of it."""
        return self.tap.forward(prompt_id, fed, positions) if self.tap else self.backend.forward(fed, positions)

    def streams(self, rows: int) -> bool:
        """Whether a prompt's rows are streamed: where the engine streams that many and no extra
        needs them whole."""
        return not self.parts and self.backend.streams(rows)

    def forward_blocks(self, prompt_id: str, fed: list[int], positions: list[int]) -> Primed:
        return Primed(self.backend.forward_blocks(fed, positions))

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], rows) -> None:
        """Each extra's work on the prompt's rows (fed: what the forward that gave them was fed)."""
        for _, c in self.parts:
            c.after(prompt_id, whole, fed, positions, rows)

    def commit(self) -> None:
        for w in self.writers.values():
            w.commit()

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()

    def summary(self) -> dict[str, Any]:
        return {key: got for key, c in self.parts if (got := c.summary()) is not None}
