"""The cheap task the driver sends to a node before a cell is placed: which engine build is there.

It runs in the cell's own runtime_env (e.g. vLLM's interpreter), so it sees the libraries the
cell's actor would import, and only reads package metadata: no engine is imported.
"""

from __future__ import annotations

import socket

import ray

from common.builds import engine_build


@ray.remote(num_cpus=0, max_retries=0)
def node_build(libraries: tuple[str, ...]) -> dict:
    """{"node_id", "host", "build", "libraries"} of the node this task runs on."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), **engine_build(libraries)}
