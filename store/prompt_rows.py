"""One prompt's rows as they travel from a capture to a shard: the record every shard writer takes
(store/shards.py ShardWriter, actors/depot.py RemoteShard) and rows_table builds a table of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from store.values import native_dtype_of


@dataclass(frozen=True, eq=False)
class PromptRows:
    """A prompt's rows at `positions`, each with the prompt's next token there (None at its end).
    native: (rows, vocab) as the backend returned them, or as stored (`store: bf16`) with `shift`
    (rows,) what was subtracted from each row; path / step per row for a side file (None: a
    capture's own rows)."""

    prompt_id: str
    positions: Sequence[int]
    next_ids: Sequence[int | None]
    native: np.ndarray
    shift: np.ndarray | None = None
    path: Sequence[str] | None = None
    step: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.positions)

    def part(self, lo: int, hi: int) -> PromptRows:
        """Rows lo..hi-1 (a message's worth, a streamed block)."""

        def cut(x):
            return None if x is None else x[lo:hi]

        ids = list(self.next_ids)
        return PromptRows(
            self.prompt_id,
            list(self.positions)[lo:hi],
            ids[lo:hi],
            self.native[lo:hi],
            cut(self.shift),
            cut(self.path),
            cut(self.step),
        )

    def columns(self, run_id: str, cell_id: str, repeat: int) -> dict[str, pa.Array]:
        """Every column of the rows in the shard of (cell, repeat) but the logits and row_hash."""
        n = len(self.positions)
        return {
            "run_id": pa.array([run_id] * n),
            "cell_id": pa.array([cell_id] * n),
            "prompt_id": pa.array([self.prompt_id] * n),
            "position": pa.array(list(self.positions), pa.int32()),
            "next_token_id": pa.array(list(self.next_ids), pa.int32()),
            "repeat": pa.array([repeat] * n, pa.int32()),
            "logits_dtype": pa.array([native_dtype_of(self.native)] * n),
            "shift": pa.array(self.shift if self.shift is not None else np.full(n, None), pa.float32()),
            "path": pa.array(list(self.path) if self.path is not None else [None] * n, pa.string()),
            "step": pa.array(list(self.step) if self.step is not None else [None] * n, pa.int32()),
        }
