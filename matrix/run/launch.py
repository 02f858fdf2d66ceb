"""Starting a cell on the cluster: its actors, and every call it will need, queued at once.

One path per kind of start, chosen by what the backend class declares (backends/base.py):

    tp == 1                       one actor with the cell's device
    tp > 1, tp_workers "ranks"    one actor per rank in a STRICT_PACK group (torch.distributed)
    tp > 1, tp_workers "engine"   one actor holding all tp devices; the engine starts its own workers
    workers_in_group(cell)        the engine starts Ray workers into the cell's group (vLLM's Ray executor)

Nothing here blocks: actors start when their group is placed, and an actor runs its calls in
order (load, parity, captures). Calls after a failed load raise the load's own exception
(actors/stack_actor.py), so whatever comes back first tells the cell's outcome.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backends import backend_class
from common.positions import Positions
from common.stack import Cell, ModelCopy, StackDesc
from matrix.run import placement


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
    """A cell's actors and placement group, and the calls queued on them (future -> Call)."""

    actor: Any  # rank 0: loads, checks parity, writes the rows
    followers: list = field(default_factory=list)  # ranks 1.. of a "ranks" cell
    group: Any = None  # its placement group, when it has one
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


def _ranks(cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, delivery) -> Started:
    """One actor per rank, all in one STRICT_PACK group; every rank loads and runs the (collective)
    forwards, rank 0 also checks parity and writes the rows. Rank 0's address reaches the other
    ranks' load() as an object ref."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.stack_actor import StackActor

    pg = placement.placement_group_for(cell.device, cell.tp, threads, nodes, cell.pin)
    gpu = {"num_gpus": 1} if placement.NEEDS[cell.device].gpu else {}
    ranks = [StackActor.options(num_cpus=threads, **gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=i)).remote(desc, model, threads, delivery) for i in range(cell.tp)]
    started = Started(ranks[0], ranks[1:], pg)
    started.calls[ranks[0].__ray_ready__.remote()] = Call(Kind.READY, cell.cell_id)  # first in its queue
    rendezvous = ranks[0].rendezvous.remote()
    gpus = [a.gpu_ids.remote() for a in ranks] if gpu else []  # each rank sees them all (NCCL P2P)
    for i, a in enumerate(ranks):
        started.calls[a.load.remote({"rank": i, "world_size": cell.tp}, rendezvous, *gpus)] = \
            Call(Kind.LOAD if i == 0 else Kind.RANK, cell.cell_id)
    return started


def _one_actor(cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, delivery,
               warm: int | None = None) -> Started:
    """warm: the vocabulary of a cell that measures its rows in the actor (its kernel loads beside
    the model)."""
    from actors.stack_actor import StackActor

    cls = backend_class(cell.engine)
    pg = None
    if cls.workers_in_group(cell):
        # The engine's own Ray workers go into this cell's group, found from inside the actor,
        # not into a group nested in ours (that deadlocks).
        pg = placement.placement_group_for(cell.device, cell.tp, threads, nodes, cell.pin)
        opts = placement.engine_driver_options(pg)
    else:
        opts = placement.actor_options(cell.device, cell.tp, threads, nodes, cell.pin)
        if cell.tp > 1:  # the engine's own tp workers ("engine"): one actor holds all their devices
            opts["num_cpus"] = threads * cell.tp
            if "num_gpus" in opts:
                opts["num_gpus"] = cell.tp
    env = cls.runtime_env(desc, threads)  # e.g. vLLM's own interpreter: its pins stay out of ours
    if env:
        opts["runtime_env"] = env
    actor = StackActor.options(**opts).remote(desc, model, threads, delivery)
    ready = actor.__ray_ready__.remote()  # first in its queue: returns once the actor is placed and started
    if warm:  # returns at once (a thread); its failure comes back with the first measurement
        actor.warm_metrics.remote(warm)
    return Started(actor, group=pg, calls={ready: Call(Kind.READY, cell.cell_id),
                                           actor.load.remote(): Call(Kind.LOAD, cell.cell_id)})


def start(cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work) -> Started:
    """Start the cell's actors and queue load, parity and every missing capture."""
    ranks = cell.tp > 1 and backend_class(cell.engine).tp_workers == "ranks"
    measures = work.metrics_ref is not None and work.metrics_ref != cell.cell_id
    started = _ranks(cell, desc, model, threads, nodes, work.delivery) if ranks else \
        _one_actor(cell, desc, model, threads, nodes, work.delivery, work.vocab if measures else None)
    ids = [(pid, toks) for pid, _, toks in work.prompts]
    for a in started.followers:
        for r in work.repeats:
            started.calls[a.capture.remote(work.run_id, r, ids, work.keep, work.store)] = Call(Kind.RANK, cell.cell_id, r)
    a = started.actor
    started.calls[a.parity.remote(work.prompts, work.special, work.vocab)] = Call(Kind.PARITY, cell.cell_id)
    for r in work.repeats:
        started.calls[a.capture.remote(work.run_id, r, ids, work.keep, work.store, work.metrics_ref)] = Call(Kind.CAPTURE, cell.cell_id, r)
    return started


def stop(started: Started) -> None:
    """Kill the cell's actors and free its group (pending calls on them fail; nobody waits on them)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in started.actors:
        ray.kill(a)
    if started.group is not None:
        remove_placement_group(started.group)


def wait_gone(actors: list, timeout_s: float = 15.0) -> None:
    """Return once killed actors are dead (a call on each fails), so none still writes a temp file."""
    import ray

    pings = [a.__ray_ready__.remote() for a in actors]
    ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
