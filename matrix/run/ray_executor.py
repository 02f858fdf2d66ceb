"""The Ray executor: each cell's hosts are Ray actors placed on the cluster's nodes (under `hosts: shared`,
one actor serves the cells of one loaded model in turn: reuse()).

One path per kind of start, chosen by what the backend class declares (backends/base.py):

    tp == 1                       one actor with the cell's device
    tp > 1, tp_workers "ranks"    one actor per rank in a STRICT_PACK group (torch.distributed)
    tp > 1, tp_workers "engine"   one actor holding all tp devices; the engine starts its own workers
    workers_in_group(cell)        the engine starts Ray workers into the cell's group (vLLM's Ray executor)

Rows of a node that cannot see the warehouse reach it through the driver's depot (actors/depot.py).
matrix.api connects to Ray and shuts down what it opened (matrix/run/cluster.py); nothing here does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from backends import backend_class
from common.stack import Cell, ModelCopy, StackDesc
from matrix.run import placement
from matrix.run.launch import Call, Kind, Started, Work, measures_in_host, queue_calls, reuse_host


def _ranks(cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, delivery) -> Started:
    """One actor per rank, all in one STRICT_PACK group; every rank loads and runs the (collective)
    forwards, rank 0 also checks parity and writes the rows. Rank 0's address reaches the other
    ranks' load() as an object ref."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.ray_actor import StackActor

    pg = placement.placement_group_for(cell.device, cell.tp, threads, nodes, cell.pin)
    gpu = {"num_gpus": 1} if placement.NEEDS[cell.device].gpu else {}
    ranks = [
        StackActor.options(
            num_cpus=threads,
            **gpu,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(desc, model, threads, delivery)
        for i in range(cell.tp)
    ]
    started = Started(ranks[0], ranks[1:], pg)
    started.calls[ranks[0].__ray_ready__.remote()] = Call(Kind.READY, cell.cell_id)  # first in its queue
    rendezvous = ranks[0].rendezvous.remote()
    gpus = [a.gpu_ids.remote() for a in ranks] if gpu else []  # each rank sees them all (NCCL P2P)
    for i, a in enumerate(ranks):
        started.calls[a.load.remote({"rank": i, "world_size": cell.tp}, rendezvous, *gpus)] = Call(
            Kind.LOAD if i == 0 else Kind.RANK, cell.cell_id
        )
    return started


def _one_actor(
    cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work, warm: int | None = None
) -> Started:
    """warm: the vocabulary of a cell that measures its rows in the actor (its kernel loads beside
    the model). A tp 1 cell's actor takes 1/work.gpu_share of a GPU (`cells_per_gpu`)."""
    delivery = work.delivery
    from actors.ray_actor import StackActor

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
        elif "num_gpus" in opts and work.gpu_share > 1:  # Ray gives fractional GPUs of one device
            opts["num_gpus"] = 1 / work.gpu_share
    env = cls.runtime_env(desc, threads)  # e.g. vLLM's own interpreter: its pins stay out of ours
    if env:
        opts["runtime_env"] = env
    actor = StackActor.options(**opts).remote(desc, model, threads, delivery)
    ready = actor.__ray_ready__.remote()  # first in its queue: returns once the actor is placed and started
    if warm:  # returns at once (a thread); its failure comes back with the first measurement
        actor.warm_metrics.remote(warm)
    return Started(
        actor,
        group=pg,
        calls={ready: Call(Kind.READY, cell.cell_id), actor.load.remote(): Call(Kind.LOAD, cell.cell_id)},
    )


class RayExecutor:
    name = "ray"

    def __init__(self, cluster_config: str | Path | None = None):
        self.cluster_config = cluster_config
        self.depot = None

    def nodes(self) -> list:
        return placement.known_nodes(placement.cluster_nodes(), self.cluster_config)

    def here(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def node_build(self, opts: dict, env: dict | None, libraries: tuple[str, ...]):
        """The engine build of a node (actors/probe.py), in the cell's runtime_env."""
        from actors.probe import node_build

        return node_build.options(**opts, **({"runtime_env": env} if env else {})).remote(libraries)

    def open(self, where: str, nonce: str):
        from actors.depot import DriverDepot, depot_options
        from actors.stack_actor import Delivery

        self.depot = DriverDepot.options(**depot_options(ray.get_runtime_context().get_node_id())).remote(where)
        return Delivery(where, nonce, self.depot)

    def start(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work) -> Started:
        """Start the cell's actors and queue load, parity and every missing capture."""
        ranks = cell.tp > 1 and backend_class(cell.engine).tp_workers == "ranks"
        started = (
            _ranks(cell, desc, model, threads, nodes, work.delivery)
            if ranks
            else _one_actor(
                cell, desc, model, threads, nodes, work, work.vocab if measures_in_host(cell, work) else None
            )
        )
        return queue_calls(started, cell, work, lambda a, method, *args: getattr(a, method).remote(*args))

    def reuse(self, started: Started, cell: Cell, desc: StackDesc, work: Work) -> Started:
        return reuse_host(started, cell, desc, work, lambda a, method, *args: getattr(a, method).remote(*args))

    def load_ahead(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, delivery) -> bool:
        """Nothing loads ahead on a cluster: an actor is placed where its CPUs are free, and a node's
        memory is the node's (the local executor's load_ahead is for one machine)."""
        return False

    def stop(self, started: Started) -> None:
        """Kill the cell's actors and free its group (pending calls on them fail; nobody waits on them)."""
        from ray.util.placement_group import remove_placement_group

        for a in started.actors:
            ray.kill(a)
        if started.group is not None:
            remove_placement_group(started.group)

    def close(self, started: Started) -> None:
        ray.get([a.close.remote() for a in started.actors])

    def wait(self, futures: list, timeout: float) -> list:
        return ray.wait(list(futures), num_returns=1, timeout=timeout)[0]

    def get(self, future: Any) -> Any:
        return ray.get(future)

    def wait_gone(self, hosts: list, timeout_s: float = 15.0) -> None:
        """Return once killed actors are dead (a call on each fails), so none still writes a temp file."""
        pings = [a.__ray_ready__.remote() for a in hosts]
        ray.wait(pings, num_returns=len(pings), timeout=timeout_s)

    def shutdown(self) -> None:
        if self.depot is not None:
            ray.kill(self.depot)
            self.depot = None
