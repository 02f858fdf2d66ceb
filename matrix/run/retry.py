"""The retry policy of a run: what a cell's error means for that cell, and how long its engine may take.

A cell's error is judged alone: skip it (the engine cannot build it as asked), start it again (its
actor or node died, up to the spec's `retries`), or record it failed. The warehouse's own disk
filling up is not a cell's fault: it ends the run. Pure functions; the run loop acts on them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import extras
from backends.base import SkipCell
from common.stack import Cell
from matrix.run.failures import Failure, StorageError, classify, storage_error, storage_line

# Without capture_timeout_s: this long per token fed in one repeat, at least CAPTURE_FLOOR_S. Two
# seconds a token leaves room over the slowest capture measured (docs/benchmark-notes.md).
CAPTURE_S_PER_TOKEN = 2.0
CAPTURE_FLOOR_S = 600.0


class Verdict(enum.Enum):
    SKIP = "skip"  # the engine cannot build the cell as asked: recorded skipped, never retried
    RETRY = "retry"  # started again, keeping the shards already complete
    FAIL = "fail"  # recorded failed; the next run tries it again


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str = ""  # SKIP: the engine's reason
    failure: Failure | None = None  # RETRY / FAIL: what happened


def judge(exc: Exception, attempt: int, retries: int, where: str) -> Judgement:
    """What one of a cell's calls raising `exc` on its `attempt`-th start means for that cell.
    Raises StorageError when the warehouse's disk (at `where`) is full: every cell would fail."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, SkipCell):
        # After a failed load every later call of the cell raises the load's own exception
        # (StackActor._loaded), so a SkipCell from any of them is the load's outcome.
        return Judgement(Verdict.SKIP, reason=str(cause).splitlines()[0])
    full = storage_error(exc)
    if full is not None:
        raise StorageError(storage_line(full, where)) from None
    failure = classify(exc)
    return Judgement(Verdict.RETRY if attempt <= failure.retries_allowed(retries) else Verdict.FAIL, failure=failure)


def capture_limit(capture_timeout_s: float | None, prompts: list, cell: Cell) -> float:
    """Seconds one repeat may take: the spec's, or scaled by the tokens of each prompt up to
    max_tokens (what a capture's forwards, its extras' included, may run over), times the sequences
    each forward holds (extras.Extra.sequences)."""
    if capture_timeout_s:
        return capture_timeout_s
    fed = sum(min(len(p.token_ids), cell.max_tokens or len(p.token_ids)) for p in prompts)
    fed *= math.prod(x.sequences(v) for x, v in extras.of(cell))
    return max(CAPTURE_FLOOR_S, CAPTURE_S_PER_TOKEN * fed)


def limit(phase: str, load_timeout_s: float, capture_limit_s: float) -> tuple[float, str] | None:
    """(seconds, spec key) for what a cell's actor is doing now; None while it is being placed
    (waiting for a node has no limit)."""
    if phase == "placing":
        return None
    if phase == "loading":
        return load_timeout_s, "load_timeout_s"
    return capture_limit_s, "capture_timeout_s"


def timed_out(phase: str, lim: tuple[float, str]) -> Failure:
    """A cell whose engine ran past its limit: failed, and not retried (it would run as long again)."""
    return Failure(
        "Timeout", f"{phase} ran past {lim[0]:.0f}s ({lim[1]}); its engine was stopped", infrastructure=False
    )
