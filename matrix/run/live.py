"""One cell in flight: its actors, what has come back from them, and where rank 0's queue stands.
The run loop (matrix/run/sweep.py) schedules with it; matrix/run/outcome.py writes its row from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.stack import Cell
from matrix.run import launch
from matrix.run.cellwork import CellWork


@dataclass
class Live:
    """One cell in flight: its actors, what has come back, and how many captures are still out."""

    prepared: CellWork  # the cell as the run prepared it: started again from this when retried
    started: launch.Started
    left: int
    loaded: dict | None = None
    parity: dict | None = None
    capture_s: float = 0.0
    storage: list = field(default_factory=list)  # each capture's store.floors.Storage.summary()
    # What rank 0's actor is doing now (its calls run in order) and since when; "placing" has no
    # time limit (it waits for a node), the others have the spec's.
    phase: str = "placing"
    since: float = field(default_factory=time.perf_counter)
    repeats: list[int] = field(default_factory=list)  # captures not back yet, in queue order
    inline: dict = field(default_factory=dict)  # repeat -> metrics its actor measured (reference_metrics: in_actor)
    extras: dict = field(default_factory=dict)  # per-cell extra key -> its part of each capture's manifest
    refusals: dict = field(default_factory=dict)  # repeat -> its manifest's length_refusals (None: none)

    @property
    def cell(self) -> Cell:
        return self.prepared.cell

    @property
    def threads(self) -> int:
        return self.prepared.threads

    @property
    def host_key(self) -> str | None:
        """Its host's key when the host is shared (Host), else None."""
        return self.prepared.host_key


@dataclass
class Host:
    """A host shared by the cells of one loaded model (spec `hosts: shared`): the cell it runs now
    (`started`) and the cells queued to take it over in turn, each with the reference it measures
    against (or None)."""

    started: launch.Started
    queue: list[tuple[CellWork, str | None]] = field(default_factory=list)
