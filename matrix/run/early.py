"""The first host of a local run, started while the driver still prepares the run.

Before the first cell can capture, the driver tokenises the corpus (for a GGUF's llama.cpp
tokenizer, a vocabulary load of its own) and its host starts a process and loads the engine
(docs/benchmark-notes.md times both). Neither needs the other, so the
local executor starts that host now: the run's first cell is its first model's reference
(matrix/run/execute.py starts references first), and the executor hands the host over when
the run asks for that cell with the same arguments (matrix/run/local.py LocalExecutor.prestart).

Only where the cell's arguments can be had without the corpus (a model from a GGUF alone, one
tensor-parallel rank, no per-cell extras), for a CPU cell (a GPU is not taken before the run holds
the warehouse's lock: another run may be using it), and a cell the warehouse does not hold done.
"""

from __future__ import annotations

from typing import Callable

from common import ids
from matrix.run import builds, placement
from matrix.spec.cells import Matrix, model_copy, stack_desc
from store import Warehouse


def first_cell(matrix: Matrix):
    """The first model's reference cell (a spec Cell, not yet bound to a build), or None."""
    model = next(iter(matrix.spec.models), None)
    sid = matrix.reference_stacks.get(model)
    return next((c for c in matrix.cells if c.stack_id == sid and not c.replica), None)


def start_first_host(matrix: Matrix, wh: Warehouse, ex, log: Callable[[str], None]) -> str | None:
    """Start the host of the run's first cell on ex (a LocalExecutor), engine load included;
    -> the nonce the run must use (its rows' Delivery is part of the host's arguments), or None
    when nothing was started."""
    from matrix.spec import gguf_model
    from matrix.spec.models import fetch

    cell = first_cell(matrix)
    if (
        cell is None
        or cell.tp != 1
        or cell.extras
        or placement.NEEDS[cell.device].gpu
        or not gguf_model.hf_free(matrix, cell.model)
    ):
        return None
    model = fetch(matrix.spec.models[cell.model], log=log, dequantise=False)
    rows = wh.read_all("cells") if wh.check() else []
    nodes = ex.nodes()
    answers = builds.probe([cell], {cell.model: model}, nodes, log, ex, own_cluster=True)
    bound, _, _ = builds.bind([cell], answers, builds.captured_builds(rows), lambda line: None)
    if not bound or any(r["cell_id"] == bound[0].cell_id and r["status"] == "done" for r in rows):
        return None  # left out, or done before: the run may not start it at all
    nonce = ids.probe_nonce()
    c = bound[0]
    ex.prestart(c, stack_desc(c, model), model_copy(model), placement.cell_threads(c, nodes), ex.open(wh.where, nonce))
    return nonce
