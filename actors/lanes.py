"""Several prompts' forwards at once in one capture, on the engine's lanes (Backend.lanes): prompt
k runs on lane k mod n, at most n at once, and each prompt's rows are handed over in prompt order,
as the one-at-a-time loop (actors/capture.py) hands them over. The rows are the engine's own for
that prompt whichever lane ran it (tests/test_lanes.py).

Where it runs: no extra taps or reads the forward (each extra's capturer keeps per-prompt state in
prompt order), no prompt's rows are streamed, and a prompt's rows are small enough to hold two per
lane (Backend.keep_outputs(2) per lane: a lane's buffer comes round again two of its prompts later,
by when the prompt's row work is done).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterable, Iterator

from common.positions import next_ids as predicted

ROW_BYTES = 4  # float32: what an engine that offers lanes hands over (llama.cpp's logits)
# A prompt's rows up to this size run on lanes. Each lane holds two prompts' rows and a context with
# its own output buffer: Gemma 3 270M's 256 rows of 262,144 logits (256 MiB) on two lanes took
# 3.0 GB for 26.1 s where one lane took 1.9 GB for 26.8 s (2-core Xeon): its rows' own work, not
# the forward, is what fills the cores there (docs/benchmark-notes.md).
LANE_BYTES = 128 << 20


class Ahead:
    """One thread a lane, each bound to its lane of the engine before its first forward."""

    def __init__(self, backend, n: int):
        self.pools = [
            ThreadPoolExecutor(1, thread_name_prefix=f"forward-lane{i}", initializer=backend.bind_lane, initargs=(i,))
            for i in range(n)
        ]
        self.pending: deque = deque()  # forwards submitted and not yet taken, in prompt order

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """fn(item) for each item, item k on lane k mod n, yielded in order. Item k + n is asked of a
        lane only once the caller has taken item k's result and asked for the next one."""
        pending = self.pending
        for k, item in enumerate(items):
            pending.append(self.pools[k % len(self.pools)].submit(fn, item))
            if len(pending) == len(self.pools):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def settle(self, error: BaseException) -> None:
        """After a failure: wait for the forwards not yet taken; those that failed too go on error's notes."""
        self.close()
        while self.pending:
            f = self.pending.popleft()
            if not f.cancelled() and (other := f.exception()) is not None and other is not error:
                error.add_note(f"a forward on another lane failed too: {type(other).__name__}: {other}")

    def close(self) -> None:
        """Wait for the forwards still running (a failure elsewhere leaves them to finish, never
        cut off inside the engine) and drop those not started."""
        for p in self.pools:
            p.shutdown(wait=True, cancel_futures=True)


def lanes_for(
    backend, extras_run: bool, plan: list[tuple], streams: Callable[[int], bool], most_bytes: int = LANE_BYTES
) -> int:
    """How many prompts' forwards run at once: the engine's lanes, or 1 where extras run, fewer
    than two prompts have rows, a prompt's rows are streamed or are over most_bytes."""
    n = backend.lanes()
    if n < 2 or extras_run or len(plan) < 2:
        return 1
    rows = max(len(positions) for *_, positions in plan)
    if streams(rows) or rows * ROW_BYTES * backend.vocab_size() > most_bytes:
        return 1
    return n


def forward_ahead(
    ahead: Ahead, plan: list[tuple], forward, feed, limit, hand_over, refused
) -> tuple[str | None, float]:
    """Each planned prompt (prompt_id, ids, need, positions) fed on the lanes (feed(forward(prompt_id,
    fed, positions=...), ids, need, ...) as the loop feeds it), handed over in prompt order.

    -> (the rows' dtype or None, the forwards' seconds summed over the lanes: more than the wall
    time they took, since they overlap)."""

    def one(item: tuple):
        prompt_id, ids, need, positions, most = item
        t = time.perf_counter()
        got = feed(partial(forward, prompt_id, positions=positions), ids, need, most)
        return got, time.perf_counter() - t

    dtype, forward_s = None, 0.0
    items = [(pid, ids, need, positions, limit(ids)) for pid, ids, need, positions in plan]
    for (prompt_id, ids, need, positions, _), (got, seconds) in zip(items, ahead.map(one, items)):
        refused.add(prompt_id, need, len(positions), got)
        forward_s += seconds
        if got.rows is not None:
            dtype = str(got.rows.dtype)
            hand_over(prompt_id, positions, predicted(ids, positions), got.rows)  # (rows, vocab)
    return dtype, forward_s
