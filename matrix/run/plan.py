"""A run's plan: the spec's cells, resolved models and tokenised prompts, and, once bound
(matrix/run/runner.bind), each cell's engine build and what is left to capture. Its own module so
that the planner (runner) and the run loop (sweep) both use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from common import ids
from common.stack import Cell
from matrix.spec.cells import Matrix
from matrix.spec.corpus import Prompt
from matrix.spec.models import ResolvedModel
from matrix.spec.parse import Spec


@dataclass(frozen=True)
class ModelPlan:
    """One model of a run, as prepared once before anything runs (runner.prepare)."""

    resolved: ResolvedModel  # where its reference weights (and GGUF) are on the driver, and their hashes
    prompts: tuple[Prompt, ...]  # the corpus tokenised once by the reference tokenizer
    special: dict  # the reference's bos / eos ids
    vocab: int  # the reference's vocabulary size: logits per row
    hidden: int  # its hidden size: values per layer-state row


@dataclass(frozen=True)
class Plan:
    """Each stage returns a new Plan (runner.prepare -> bind -> find_todo): nothing changes one in
    place, and the run loop keeps its own progress (matrix/run/sweep.py)."""

    matrix: Matrix  # the spec's cells, resolved against each model (runner.prepare)
    models: dict[str, ModelPlan]  # model name -> what the run prepared for it
    # Set by bind(): the spec's cells bound to an engine build (cell_id = stack@build)
    cells: tuple[Cell, ...] = ()
    reference_cells: dict[str, str] = field(default_factory=dict)  # model -> bound cell id
    builds: dict[str, dict] = field(default_factory=dict)  # cell id -> its build's libraries
    left_out: dict[str, str] = field(default_factory=dict)  # stack id -> why it does not run this time
    # Set by find_todo(): what is left, what is complete, and captures of other builds reused
    todo: dict[str, tuple[int, ...]] = field(default_factory=dict)  # cell_id -> repeats to capture
    complete: tuple[str, ...] = ()
    reused: dict[str, str] = field(default_factory=dict)  # stack id -> the other build's cell it reuses
    aside: str = field(default_factory=ids.aside_dir)  # where this run moves damaged shards

    @property
    def spec(self) -> Spec:
        """The parsed spec the run follows."""
        return self.matrix.spec

    def resolved(self) -> dict[str, ResolvedModel]:
        """model name -> its resolved weights (what the engine builds are probed with)."""
        return {name: m.resolved for name, m in self.models.items()}
