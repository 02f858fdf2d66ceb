"""What the API's calls return: plain frozen records, each with `to_dict()` for JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunResult:
    """One `run()`: what the spec expanded to and what happened to each cell.

    cells_done counts every complete cell of the spec (captured now or before); cells_run the ones this
    call started. failed maps a cell id to its one-line reason; bad_input is set when a failure is the
    input's fault (a node's weights, a file refused where it ran): the CLI exits 2 on it."""

    cells_total: int
    cells_done: int
    cells_run: int
    rows_written: int
    wall_s: float  # the whole call: planning, binding and the sweep
    run_id: str | None = None  # None: nothing was left to capture, so no run was recorded
    seconds: float = 0.0  # the sweep alone (the runs table's duration)
    rows_per_second: float = 0.0
    rows_delivery: dict = field(default_factory=dict)  # how the rows reached the warehouse: {way: rows}
    metrics_in_actor: int = 0  # cells measured where they were captured (reference_metrics: in_actor)
    skipped: tuple[dict, ...] = ()  # {axes..., "stack_id": combination, "reason": why} the spec cannot run
    left_out: dict = field(default_factory=dict)  # stack id -> why it does not run this time
    reused: dict = field(default_factory=dict)  # stack id -> the other build's cell it counts as done
    failed: dict = field(default_factory=dict)  # cell id -> one line
    bad_input: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AnalyzeResult:
    """One `analyze()`: cells measured, metric rows written, seconds, and each per-cell extra's own
    summary under its name (extras/)."""

    cells: int
    metric_rows: int
    seconds: float
    details: dict = field(default_factory=dict)  # everything analysis.analyze reported, as it reported it

    def to_dict(self) -> dict[str, Any]:
        return dict(self.details)


@dataclass(frozen=True)
class QueryResult:
    """One `sql()` statement's result: column names and rows (tuples of DuckDB's Python values)."""

    columns: tuple[str, ...]
    rows: tuple[tuple, ...]

    def to_dict(self) -> list[dict[str, Any]]:
        """The rows as {column: value}, what `matrix sql --format json` prints."""
        return [dict(zip(self.columns, r)) for r in self.rows]


@dataclass(frozen=True)
class CandidateResult:
    """One candidate file of a `kld()` job, measured against the reference over the text."""

    candidate: str  # the file (or checkpoint) as given
    label: str
    reference: str
    cell_id: str
    chunks: int
    statistics: dict  # llama-perplexity's figures, as values (analysis/kld_stats.py cell_stats)
    card: dict  # its model card (analysis/card.py build_card)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KldResult:
    """One `kld()` job: the spec it wrote, each completed candidate's statistics and card, and the
    candidates whose cell did not complete (the run's log says why)."""

    spec: str
    warehouse: str
    n_ctx: int
    results: tuple[CandidateResult, ...]
    incomplete: tuple[str, ...] = ()
    run: RunResult | None = None  # None: the job was refused before anything ran
    refused: str | None = None  # the input's fault, said in one line (the CLI exits 2 on it)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "warehouse": self.warehouse,
            "n_ctx": self.n_ctx,
            "results": [r.to_dict() for r in self.results],
            "incomplete": list(self.incomplete),
        }


@dataclass(frozen=True)
class AttributeResult:
    """One `attribute()` job: the base quant, each group's variant ranked, and the cumulative frontier
    (analysis/attribution.py says how each is ranked and measured)."""

    reference: str  # the float GGUF quantised from
    reference_sha256: str
    recipe: str
    text: str
    n_ctx: int
    warehouse: str
    base: dict
    variants: tuple[dict, ...]  # raises, then lowers, each in ranking order, dropped ones last
    frontier: tuple[dict, ...]  # step 0 the base
    incomplete: tuple[str, ...] = ()  # frontier files whose cell did not complete

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def tensor_type_file(self, step: int) -> str:
        """The --tensor-type-file that rebuilds a frontier step with llama-quantize."""
        return "".join(f"{line}\n" for line in self.frontier[step]["lines"])
