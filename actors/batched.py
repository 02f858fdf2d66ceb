"""A batch cell's capture (common/batching.py): each prompt's forward in one batch with the
sequences its fill policy picks, in place of the per-cell extras' forward (a batch cell has none)."""

from __future__ import annotations

import numpy as np

from backends.base import Backend, LengthRefused, SkipCell


class Batched:
    """What capture_shard calls around each prompt's forward, for a cell whose stack has a batch."""

    parts = ()

    def __init__(self, backend: Backend, prompts: list[tuple[str, list[int]]], max_tokens: int | None):
        self.backend = backend
        self.batch = batch = backend.stack.batch
        ids = [p[1][:max_tokens] for p in prompts]  # each as a batch-free cell feeds it (None: whole)
        self.others = {pid: [ids[j] for j in batch.others(i, len(prompts))] for i, (pid, _) in enumerate(prompts)}

    def forward(self, prompt_id: str, fed: list[int], positions: list[int]) -> np.ndarray:
        # `repeat`: B identical sequences, each fed what sequence 0 is fed
        others = [fed] * (self.batch.size - 1) if self.batch.fill == "repeat" else self.others[prompt_id]
        try:
            return self.backend.forward_batch(fed, positions, others)  # (rows, vocab), native dtype
        except LengthRefused as e:
            # the batch's shape, not the measured prompt's length, decided it: a longer prefix would not help
            raise SkipCell(f"batch {self.batch.size}: {e}") from e

    def streams(self, rows: int) -> bool:
        return False  # the batch's rows come whole: one forward holds every sequence

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], rows) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def summary(self) -> dict:
        return {}
