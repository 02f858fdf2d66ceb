"""`reference_metrics: in_actor`: a stack's metrics against its reference, measured in the
capturing actor as each prompt's rows come out, against the reference's repeat 0 read from the
warehouse, as llama-perplexity's --kl-divergence pass does. No shard is read back for it.

The rows measured are the rows stored (bf16-rounded where `store: bf16`, with their shift added
back), read as `matrix analyze` reads them from a shard, through the same per-prompt code
(analysis/compare.py RepeatMetrics): the numbers are analyze's. A problem here (a node that
cannot read the warehouse, a damaged reference) is reported in the manifest and leaves the
capture alone; `matrix analyze` then computes the metrics.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from common.buffers import room
from common.errors import first_line
from store.values import Bf16Rows, rows_at
from store.warehouse import Warehouse, unshift, widen


class Warmup:
    """The metric kernel built (or loaded from its cache) on a thread while the actor loads its
    model: a first build then overlaps the load instead of the capture (docs/benchmark-notes.md)."""

    def __init__(self, vocab: int):
        self.error: Exception | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(vocab,), name="metrics-warmup", daemon=True)
        self.thread.start()

    def _run(self, vocab: int) -> None:
        t0 = time.perf_counter()
        try:
            from analysis import metrics

            metrics.warm(vocab)
        except Exception as e:  # noqa: BLE001 - kept, and reported by the first measurement (wait)
            self.error = e
        self.seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the kernel is ready; the warm-up's own failure is raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error


class InlineMetrics:
    def __init__(
        self,
        warehouse: str | None,
        ref_id: str,
        cell_id: str,
        repeat: int,
        warmup: Warmup | None = None,
        required: bool = False,
    ):
        """required: the capture keeps no values of its rows (keep_rows: references), so nothing can
        measure them later: a failure here is raised, and fails the capture, instead of reported."""
        self.ref_id, self.cell_id, self.repeat, self.warmup, self.required = ref_id, cell_id, repeat, warmup, required
        self.acc, self.error, self.wh, self.ref, self.seconds = None, None, None, None, 0.0
        self.wide = None  # a prompt's rows widened, reused prompt after prompt: fresh memory costs page faults
        if warehouse is None:
            self.error = "this node cannot read the warehouse (its rows go through the driver)"
            return
        from store.stream import shard_index

        try:
            self.wh = Warehouse(warehouse)
            self.ref = shard_index(self.wh, ref_id, 0)
        except Exception as e:  # noqa: BLE001 - reported in the manifest; analyze measures the cell instead
            self.error = f"reference {ref_id} repeat 0: {first_line(str(e), type(e).__name__)}"
        self._raise_if_required()

    def _raise_if_required(self) -> None:
        if self.required and self.error is not None:
            raise RuntimeError(
                f"{self.cell_id}: measuring against {self.ref_id} in the capture failed ({self.error}); "
                "keep_rows: references keeps no values to measure later"
            )

    def observe(self, prompt_id: str, positions: list[int], stored: np.ndarray, shift: np.ndarray | None) -> None:
        if self.error is not None:
            return
        from analysis.compare import RepeatMetrics

        t0 = time.perf_counter()
        try:
            if self.acc is None:
                if self.warmup is not None:
                    self.warmup.wait()
                self.acc = RepeatMetrics(self.wh, self.ref, self.cell_id, self.repeat, stored.shape[1])
            self.acc.add(prompt_id, np.asarray(positions, np.int64), self._rows(stored, shift))
        except Exception as e:  # noqa: BLE001 - the capture goes on; analyze measures the cell instead
            self.error, self.acc = first_line(str(e), type(e).__name__), None
        self.seconds += time.perf_counter() - t0
        self._raise_if_required()

    def _rows(self, stored: np.ndarray, shift: np.ndarray | None):
        """take(idx) -> those rows of the prompt as analyze reads them from a shard: bf16 as stored
        (bits and shift, no widened copy), any other dtype widened and unshifted."""
        if stored.dtype == np.uint16:
            rows = Bf16Rows.of(stored, shift)
            return rows.at
        self.wide = room(self.wide, stored.size)
        wide = widen(stored, self.wide)  # (rows, vocab) float32, as a shard reader widens them
        raw = unshift(wide, shift, inplace=wide is not stored)  # the raw logits back (in place: our buffer)
        return lambda idx: rows_at(raw, idx)

    def outcome(self) -> dict[str, Any]:
        """{"table", "counts"} (storage_floor still 0: the driver sets the cell's), or {"error"}."""
        if self.error is not None:
            return {"error": self.error, "reference": self.ref_id}
        if self.acc is None:  # no prompt had rows
            from analysis.compare import RepeatMetrics

            self.acc = RepeatMetrics(self.wh, self.ref, self.cell_id, self.repeat, 0)
        table, counts = self.acc.result(0.0)
        return {
            "table": table,
            "counts": counts,
            "reference": self.ref_id,
            "seconds": self.seconds,
            "warmup_seconds": None if self.warmup is None else self.warmup.seconds,
        }
