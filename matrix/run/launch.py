"""Starting a cell: its hosts, and every call it will need, queued at once, on either executor.

An executor runs cells' hosts (actors/stack_actor.py StackHost) somewhere and hands back futures:
matrix/run/ray_executor.py on a Ray cluster, matrix/run/local.py in worker processes of this
machine. Both give the run loop the same verbs (`Executor` below) and queue the same calls in
the same order (queue_calls), so a cell lands the same rows whichever ran it.

Nothing here blocks: a host starts when its resources are free, and runs its calls in order
(load, parity, captures). Calls after a failed load raise the load's own exception
(StackHost._loaded), so whatever comes back first tells the cell's outcome.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from common.positions import Positions
from common.stack import Cell, ModelCopy, StackDesc


class Kind(enum.Enum):
    READY = "ready"  # rank 0's actor exists (placed and started): the load's clock starts
    LOAD = "load"  # rank 0's load: the cell's settings, versions, host
    RANK = "rank"  # another rank's load or forwards: only its failure matters
    PARITY = "parity"  # the engine's own tokenizer against the canonical ids
    CAPTURE = "capture"  # one repeat's shard, written by the actor


@dataclass(frozen=True)
class Call:
    kind: Kind
    cell_id: str
    repeat: int | None = None


@dataclass
class Started:
    """A cell's hosts (Ray actors or local workers), and the calls queued on them (future -> Call)."""

    actor: Any  # rank 0: loads, checks parity, writes the rows
    followers: list = field(default_factory=list)  # ranks 1.. of a "ranks" cell
    group: Any = None  # its Ray placement group, when it has one
    calls: dict = field(default_factory=dict)

    @property
    def actors(self) -> list:
        return [self.actor] + self.followers


@dataclass(frozen=True)
class Work:
    """What every cell of a run is asked to do (the same for each cell of a model)."""

    run_id: str
    delivery: Any  # actors.stack_actor.Delivery: the warehouse, this run's nonce, the driver's depot
    keep: Positions  # the positions each prompt keeps (the spec's stride or window)
    repeats: list[int]  # the repeats still missing for this cell
    prompts: list[tuple[str, str, list[int]]]  # (prompt_id, text, canonical ids)
    special: dict[str, Any]  # the reference tokenizer's bos / eos ids
    vocab: int  # the reference's vocabulary size
    store: str = "native"  # how rows are stored: native | bf16 (matrix/spec/parse.py STORES)
    metrics_ref: str | None = None  # reference_metrics: in_actor: the reference cell whose repeat 0 is stored
    values: bool = True  # False (keep_rows: references, measured in its host): rows hashed, values not stored
    gpu_share: int = 1  # cells_per_gpu: a tp 1 cell's host takes 1/gpu_share of a GPU


class Executor(Protocol):
    """What the run loop asks of wherever cells run. A future is the executor's own (Ray's
    ObjectRef, or a local one); get() raises what the host raised, wrapped with `.cause`."""

    name: str  # "ray" | "local": recorded in the run's row

    def nodes(self) -> list: ...  # placement.Node of every machine that can host a cell now
    def open(self, where: str, nonce: str) -> Any: ...  # the Delivery of this run's rows
    def start(
        self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work
    ) -> Started: ...
    def reuse(
        self, started: Started, cell: Cell, desc: StackDesc, work: Work
    ) -> Started: ...  # the next cell of a shared host, on the same host (its switch first)
    def load_ahead(
        self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, delivery: Any
    ) -> bool: ...  # a host for a cell the run starts later, loading now where it can: whether it did
    def stop(self, started: Started) -> None: ...  # kill the cell's hosts (their calls fail)
    def close(self, started: Started) -> None: ...  # close the engines, wait for them
    def wait(self, futures: list, timeout: float) -> list: ...  # the first ready future(s), or []
    def get(self, future: Any) -> Any: ...
    def wait_gone(self, hosts: list) -> None: ...  # killed hosts are dead (no temp file still written)
    def shutdown(self) -> None: ...  # the run is over: free what open() made


def queue_calls(started: Started, cell: Cell, work: Work, call: Callable[..., Any]) -> Started:
    """Queue parity and every missing capture on a started cell; call(host, method, *args)
    returns the executor's future for one call."""
    ids = [(pid, toks) for pid, _, toks in work.prompts]
    for a in started.followers:
        for r in work.repeats:
            started.calls[call(a, "capture", work.run_id, r, ids, work.keep, work.store)] = Call(
                Kind.RANK, cell.cell_id, r
            )
    a = started.actor
    started.calls[call(a, "parity", work.prompts, work.special, work.vocab)] = Call(Kind.PARITY, cell.cell_id)
    for r in work.repeats:
        started.calls[call(a, "capture", work.run_id, r, ids, work.keep, work.store, work.metrics_ref, work.values)] = (
            Call(Kind.CAPTURE, cell.cell_id, r)
        )
    return started


def reuse_host(started: Started, cell: Cell, desc: StackDesc, work: Work, call: Callable[..., Any]) -> Started:
    """The calls of the next cell of a shared host (`hosts: shared`), queued after its last cell's:
    switch (the loaded model taken over, or loaded afresh), then parity and captures."""
    host = started.actor
    nxt = Started(host, group=started.group)
    if measures_in_host(cell, work):  # returns at once (a thread), as before a load
        call(host, "warm_metrics", work.vocab)
    nxt.calls[call(host, "switch", desc)] = Call(Kind.LOAD, cell.cell_id)
    return queue_calls(nxt, cell, work, call)


def measures_in_host(cell: Cell, work: Work) -> bool:
    """Whether the cell measures its rows against its reference as it captures (in_actor)."""
    return work.metrics_ref is not None and work.metrics_ref != cell.cell_id
