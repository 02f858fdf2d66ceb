"""`matrix analyze --workers N | --address ADDR`: analysis units as Ray tasks.

Each task opens the warehouse where it lives and hands back small tables; the driver writes
them (analysis/analyze.py). A warehouse in a local directory is only readable on this machine,
so its tasks are pinned to the driver's node; an object-store warehouse is read from any node.
"""

from __future__ import annotations

from typing import Callable

from common.errors import UserError
from store.verify import DamagedShard

HEARTBEAT_S = 60


def _task(where: str, task, skip_damaged: bool):
    """Inside a Ray task: one piece of a unit, with the task's one CPU. Bad input comes back as a value,
    so the driver raises it as the one-line error it is, not as a wrapped traceback."""
    import os

    import torch

    from analysis.analyze import run_task

    torch.set_num_threads(1)  # the centroid's log-softmax
    os.environ["LOGIT_MATRIX_KERNEL_THREADS"] = "1"  # the metric kernel (analysis/metrics_native.py)
    try:
        return "ok", run_task(where, task, skip_damaged)
    except DamagedShard as e:
        return "damaged", str(e)
    except UserError as e:
        return "user", str(e)


def ray_runner(address: str | None, workers: int, log: Callable[[str], None]) -> Callable:
    """A run_units for analysis.analyze.analyze that spreads the units' pieces over Ray tasks,
    at most `workers` at once (0: as many as the cluster has CPUs)."""

    def run(where: str, units: list, skip_damaged: bool, done: Callable) -> None:
        from matrix.run.cluster import init_ray
        from store import Warehouse

        if not units:
            return
        ray = init_ray(address)  # before any `import ray`: Ray reads its auth settings at import
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts = {"num_cpus": 1, "max_retries": 2}
        cpus = ray.cluster_resources().get("CPU", 0)
        if not Warehouse(where).remote:
            here = ray.get_runtime_context().get_node_id()
            cpus = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == here and n["Alive"]), 0)
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
        if cpus < 1:  # a task would wait for a CPU forever
            log("analyze: the Ray node that can read this warehouse has no CPU for tasks; computing in this process")
            from analysis.analyze import run_locally

            return run_locally(where, units, skip_damaged, done)
        task = ray.remote(**opts)(_task)
        width = workers or int(cpus)
        log(
            f"analyze on Ray: {len(units)} piece(s), {width} at a time"
            + ("" if Warehouse(where).remote else " (a local warehouse: on this node only)")
        )
        queue, pending = sorted(units, key=lambda t: -t.work), {}  # largest first: no long piece left for last
        while queue or pending:
            while queue and len(pending) < width:
                u = queue.pop(0)
                pending[task.remote(where, u, skip_damaged)] = u
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=HEARTBEAT_S)
            for ref in ready:
                u = pending.pop(ref)
                status, value = ray.get(ref)
                if status == "damaged":
                    raise DamagedShard(value)
                if status == "user":
                    raise UserError(value)
                done(u, value)

    return run
