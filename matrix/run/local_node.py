"""This machine as the local executor sees it: its CPUs, its NVIDIA GPUs (those a scheduler left
visible) and its device labels, as a placement node (matrix/run/placement.py)."""

from __future__ import annotations

import os
import platform
import socket
import sys

from matrix.run import placement

NODE_ID = "local:" + socket.gethostname()  # what actors/stack_actor.py StackHost.node_id says


def gpu_pool() -> tuple[list[str], list[str]]:
    """(the GPU ids workers may be given, their names): every NVIDIA GPU (nvidia-ml-py), or only
    those CUDA_VISIBLE_DEVICES lists when it is set (a scheduler's share of the machine), as Ray
    counts them."""
    names = _nvidia_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(len(names))], names
    ids = [g.strip() for g in visible.split(",") if g.strip()]
    return ids, [names[int(g)] if g.isdigit() and int(g) < len(names) else (names or ["GPU"])[0] for g in ids]


def local_node() -> placement.Node:
    """This machine as a placement node: its CPUs, NVIDIA GPUs and device labels."""
    resources: dict[str, float] = {"CPU": float(os.cpu_count() or 1)}
    labels: dict[str, str] = {}
    ids, names = gpu_pool()
    if ids:
        resources["GPU"] = float(len(ids))
        # Ray's accelerator type from the name ("NVIDIA H200" -> H200): the same device labels match
        labels[placement.RAY_ACCEL] = names[0].removeprefix("NVIDIA ").strip().replace(" ", "-")
    elif sys.platform == "darwin" and platform.machine() == "arm64":
        resources.update({"GPU": 1.0, "mps": 1.0})
        labels[placement.RAY_ACCEL] = "Apple-Silicon"
    if os.environ.get("LOGIT_MATRIX_DEVICE"):  # the label a cluster.yaml would set (placement.LABEL)
        labels[placement.LABEL] = os.environ["LOGIT_MATRIX_DEVICE"]
    return placement.Node(NODE_ID, socket.gethostname(), resources, labels)


def _nvidia_gpus() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a CPU machine
        return []
    try:
        return [
            str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()


def available_memory() -> int:
    """Bytes this machine can still give a process without swapping: MemAvailable on Linux (free
    memory and reclaimable cache), else the free pages' count (macOS: SC_AVPHYS_PAGES); within
    the room left under this process's cgroup (v2) limit where it has one (a container's)."""
    free = None
    if os.path.isfile("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return free if room is None else min(free, room)


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup v2 ("0::/path" in /proc/self/cgroup),
    or None without one or without a limit."""
    if not os.path.isfile("/proc/self/cgroup"):
        return None
    with open("/proc/self/cgroup") as f:
        path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    where = os.path.join("/sys/fs/cgroup", (path or "").lstrip("/"))
    limit, used = os.path.join(where, "memory.max"), os.path.join(where, "memory.current")
    if path is None or not (os.path.isfile(limit) and os.path.isfile(used)):
        return None
    with open(limit) as f:
        cap = f.read().strip()
    if cap == "max":
        return None
    with open(used) as f:
        return int(cap) - int(f.read().strip())
