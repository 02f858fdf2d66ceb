"""`batch: [1, 8, 32]`: batch composition, an axis of the sweep graded against a partner cell.

A cell of batch B evaluates each prompt in the same forward as B - 1 other sequences, chosen by its
fill policy (common/batching.py), and keeps the measured prompt's rows only, so its rows compare
with batch 1's and with every other stack's. Each size is a cell of its own (the axis sweeps), and
each is graded against its partner: the same stack at batch 1 (cells.batch_of), row by row, into
batch_metrics, which the batch_drift view sums (analysis/batch_drift.py).

The engine's hook is `forward_batch`; `Backend.batch_unsupported` says where an engine cannot, and
`Backend.max_batch` the most sequences a batch may hold on a device (more is the spec's error).
A batch cell records its rows alone: it takes no other extra.
"""

from __future__ import annotations

from typing import Any, Mapping

from common import batching
from extras import Capturer, PartnerGraded
from store.cell_rows import CellRow


class Batched(Capturer):
    """Each prompt's forward in one batch with the sequences its fill policy picks."""

    taps_forward = True

    def __init__(self, backend, batch: batching.Batch):
        self.backend, self.batch, self.others = backend, batch, {}

    def start(self, prompts: list[tuple[str, list[int]]], max_tokens: int | None) -> None:
        ids = [p[1][:max_tokens] for p in prompts]  # each as a batch-free cell feeds it (None: whole)
        n = len(prompts)
        self.others = {pid: [ids[j] for j in self.batch.others(i, n)] for i, (pid, _) in enumerate(prompts)}

    def forward(self, prompt_id: str, fed: list[int], positions: list[int]):
        from backends.base import LengthRefused, SkipCell

        # `repeat`: B identical sequences, each fed what sequence 0 is fed
        others = [fed] * (self.batch.size - 1) if self.batch.fill == "repeat" else self.others[prompt_id]
        try:
            return self.backend.forward_batch(fed, positions, others)  # (rows, vocab), native dtype
        except LengthRefused as e:
            # the batch's shape, not the measured prompt's length, decided it: a longer prefix would not help
            raise SkipCell(f"batch {self.batch.size}: {e}") from e


class Batch(PartnerGraded):
    key = "batch"
    grading = "analysis.batch_drift"
    partner_about = "the stack id of the same stack at batch 1, what batch_drift compares it with"
    hook = "forward_batch"
    table = None  # its rows are the cell's own logits
    sweeps = True
    shares = False
    rank = 60
    order = 10  # its forward gives the rows
    about = "evaluate each prompt among B - 1 others: sizes, fill, seed"
    json_schema = batching.JSON_SCHEMA

    # the spec
    def parse(self, value: Any, fail) -> batching.BatchAxis | None:
        return batching.parse(value, fail)

    def expand(self, value: batching.BatchAxis) -> list[batching.Batch]:
        return value.cells()

    def id_part(self, value: batching.Batch) -> dict:
        return value.id_part()

    def describe(self, value: batching.Batch) -> dict:
        return value.id_part()

    def partner(self, value: batching.Batch) -> batching.Batch:
        return batching.Batch(1)

    def check(self, cell, value: batching.Batch, fail) -> None:
        from backends import backend_class

        cls = backend_class(cell.engine)
        limit = cls.max_batch(cell.device) if cls is not None else None
        if limit is not None and value.size > limit[0]:
            raise fail(
                f"engine {cell.engine} takes at most {limit[0]} sequences in one batch on {cell.device} ({limit[1]})",
                value.size,
            )

    def sequences(self, value: batching.Batch) -> int:
        return value.size

    # engines
    def unsupported(self, engine_cls, cell, value) -> str | None:
        others = [k for k, v in cell.extras if k != self.key and v is not None]
        if others:  # layers, decode and prefix-cache rows are one sequence's own
            return f"per-cell extras ({', '.join(others)}) record a sequence evaluated alone; a batch cell takes none"
        return engine_cls.batch_unsupported(cell)

    # the capture
    def capturer(self, backend, value: batching.Batch, writer) -> Batched:
        return Batched(backend, value)

    # the outcome: the batch as its id holds it, and (PartnerGraded) the stack id of the same stack at batch 1
    def cell_columns(self) -> list[tuple[str, Any, str]]:
        import pyarrow as pa

        return [
            ("batch_size", pa.int32(), "`batch:` the sequences each forward held, null: alone (batch-free)"),
            (
                "batch",
                pa.string(),
                'the batch as its id holds it: JSON {"size"} at 1, {"size", "fill"} above ("seed" too for fill random)',
            ),
            *super().cell_columns(),
        ]

    def cell_record(self, cell, value: batching.Batch) -> dict[str, Any]:
        return {"batch_size": value.size, "batch": value.to_json(), **super().cell_record(cell, value)}

    def active_in(self, cell_row: Mapping | CellRow) -> bool:
        return cell_row.get("batch_size") is not None

    # the report (analyze, views and card: PartnerGraded, from analysis/batch_drift.py)
    def model_report(self, data: dict, model: str, k: int) -> str:
        from analysis.report_batch import section

        return section(data, model, k)

    def name_words(self, cell_row: dict) -> list[str]:
        return [f"batch{cell_row['batch_size']}"] if cell_row.get("batch_size") else []  # batch-free: no word

    def brief(self, value: dict) -> list[str]:
        """`8 corpus`, `1` (`matrix cells`' batch column; value: describe()'s)."""
        return [str(value[k]) for k in ("size", "fill", "seed") if k in value]


EXTRA = Batch
