"""Each cell's part of a run, worked out once before the first cell starts: where it runs, the host
it may share, what its host is asked to do, and how long a capture may take.

The scheduler (matrix/run/execute.py) prepares these records; the run loop (matrix/run/sweep.py)
only passes them along, so a cell started again, or queued on a shared host, starts as it was
prepared. What changes while the run goes (the repeats still missing, the reference a cell
measures against) the loop sets on the record's Work when the cell starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends import backend_class
from common.stack import Cell, ModelCopy, StackDesc
from matrix.run import launch, placement, retry
from matrix.run.placement import Node
from matrix.run.plan import Plan
from matrix.spec.cells import model_copy, stack_desc


@dataclass(frozen=True)
class CellWork:
    """One cell as the run starts it: its stack, threads, shared host and limits."""

    cell: Cell
    threads: int  # the spec's, else the smallest node's CPU count (placement.cell_threads)
    # what cells sharing one host have in common; None: the cell loads in a host of its own
    host_key: str | None
    desc: StackDesc  # what the cell's backend is given
    model: ModelCopy  # what a node is told about the cell's reference weights
    work: launch.Work  # what its host is asked, with the repeats the plan left to capture
    capture_limit_s: float  # capture_timeout_s, or its default for this cell's tokens


def prepare(plan: Plan, nodes: list[Node], run_id: str, delivery) -> list[CellWork]:
    """Every unfinished cell of the plan, the references first (their cells may wait for them).
    delivery: actors.stack_actor.Delivery, how this run's rows reach the warehouse."""
    cells = {c.cell_id: c for c in plan.cells}
    todo = [cells[cid] for cid in plan.todo]
    todo.sort(key=lambda c: c.cell_id not in plan.reference_cells.values())
    return [_prepared(plan, cell, nodes, run_id, delivery) for cell in todo]


def _prepared(plan: Plan, cell: Cell, nodes: list[Node], run_id: str, delivery) -> CellWork:
    spec, mp = plan.spec, plan.models[cell.model]
    threads = placement.cell_threads(cell, nodes)
    # Backend.weights_key, the build, the device, the threads, the nodes it may run on, the replica
    weights = backend_class(cell.engine).weights_key(cell.stack) if spec.hosts == "shared" else None
    return CellWork(
        cell,
        threads,
        host_key=None if weights is None else repr((cell.engine, threads, cell.pin, cell.replica, weights)),
        desc=stack_desc(cell, mp.resolved),
        model=model_copy(mp.resolved),
        work=launch.Work(
            run_id,
            delivery,
            spec.positions,
            list(plan.todo[cell.cell_id]),
            [(p.prompt_id, p.text, p.token_ids) for p in mp.prompts],
            mp.special,
            mp.vocab,
            spec.store,
            gpu_share=spec.cells_per_gpu,
        ),
        capture_limit_s=retry.capture_limit(spec.capture_timeout_s, mp.prompts, cell),
    )
