"""The Ray actor that hosts one loaded stack: StackHost, with the node facts Ray knows.

Its class name shows in the worker's process title (`ray::StackActor.capture`), which is how
benchmarks/process_watch.py (ActorPeak, for vs_llama_perplexity) finds the actors' processes.
"""

from __future__ import annotations

import ray

from actors.stack_actor import StackHost


@ray.remote
class StackActor(StackHost):
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray assigned this actor (physical ids on its node)."""
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
