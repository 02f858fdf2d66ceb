"""Which Ray node can host a cell: device class and TP degree -> labels, resources, bundles.

A node advertises its device class one of three ways, in this order of preference:
  1. our label  `logit-matrix.io/device: h200`          (cluster.yaml sets it per node type)
  2. Ray's label `ray.io/accelerator-type: H200`       (Ray sets it from the GPU it detects)
  3. a custom resource `apple-m3: 1`                   (Apple Silicon before Ray typed it)
A cell asks for its device's GPUs (`tp` of them, in one STRICT_PACK placement group when tp > 1)
and a selector that only matching nodes satisfy. Cells no node can ever host are reported
before the sweep starts instead of pending forever.

"Can ever host" counts the node types of the cluster's launcher config as well as live nodes:
with `min_workers: 0` an autoscaling cluster has no h200 node until a cell asks for one. The
launcher leaves that config on the head as ~/ray_bootstrap_config.yaml; `--cluster-config`
names another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.errors import UserError, read_yaml_file

LABEL = "logit-matrix.io/device"
RAY_ACCEL = "ray.io/accelerator-type"
NODE_ID = "ray.io/node-id"  # every node carries it (Ray >= 2.49): how a cell is pinned to nodes
BOOTSTRAP_CONFIG = Path.home() / "ray_bootstrap_config.yaml"  # where `ray up` leaves cluster.yaml on the head


@dataclass(frozen=True)
class Need:
    gpu: bool = False
    accel: tuple[str, ...] = ()  # Ray accelerator-type values that mean this device
    resource: str | None = None  # custom resource for devices Ray does not type


# Ray >= 2.5x types Apple Silicon itself (resource GPU: 1, ray.io/accelerator-type M3-Max, ...).
APPLE = {
    f"apple-{m}": tuple(f"{m.upper()}{v}" for v in ("", "-Pro", "-Max", "-Ultra")) for m in ("m1", "m2", "m3", "m4")
}
APPLE_ALL = tuple(a for v in APPLE.values() for a in v) + ("Apple-Silicon",)

NEEDS: dict[str, Need] = {
    "cpu": Need(),
    "cuda": Need(gpu=True),
    "h100": Need(gpu=True, accel=("H100",)),
    "h200": Need(gpu=True, accel=("H200",)),
    "b200": Need(gpu=True, accel=("B200",)),
    # Ray's names: "NVIDIA RTX PRO 6000 ..." -> RTX-PRO-6000, "NVIDIA GeForce RTX 5090" -> GeForce-RTX-5090
    "sm120": Need(
        gpu=True,
        accel=(
            "RTX-PRO-6000",
            "RTX-PRO-6000-Blackwell",
            "RTX-PRO-5000",
            "RTX-PRO-4000",
            "GeForce-RTX-5090",
            "GeForce-RTX-5080",
            "RTX-5090",
        ),
    ),
    "mi300x": Need(gpu=True, accel=("AMD-Instinct-MI300X-OAM", "AMD-Instinct-MI300X-HF", "AMD-Instinct-MI300X")),
    "rocm": Need(gpu=True),
    **{d: Need(resource=d, accel=a) for d, a in APPLE.items()},
    "mps": Need(resource="mps", accel=APPLE_ALL),
}


def _vendor(accel: str | None) -> str | None:
    """nvidia | amd | apple from a Ray accelerator type; None when the node has none."""
    if not accel:
        return None
    return "apple" if accel in APPLE_ALL else "amd" if accel.startswith("AMD-") else "nvidia"


@dataclass
class Node:
    node_id: str
    host: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)
    node_type: str | None = None  # set: not running yet, a type the autoscaler can start


def node_types(path: str | Path) -> list[Node]:
    """The node types of a Ray cluster launcher config that can run workers, as would-be nodes."""
    data = read_yaml_file(path, "cluster config")
    types = data.get("available_node_types") if isinstance(data, dict) else None
    if not isinstance(types, dict) or not types:
        raise UserError(f"{path}: available_node_types: expected a mapping of node types, got {types!r}")
    out = []
    for name, t in types.items():
        if not isinstance(t, dict):
            raise UserError(f"{path}: available_node_types.{name}: expected a mapping, got {t!r}")
        res, labels = t.get("resources") or {}, t.get("labels") or {}
        if not isinstance(res, dict) or not all(isinstance(v, (int, float)) for v in res.values()):
            raise UserError(f"{path}: available_node_types.{name}.resources: expected name: number, got {res!r}")
        if not isinstance(labels, dict):
            raise UserError(f"{path}: available_node_types.{name}.labels: expected a mapping, got {labels!r}")
        most = t.get("max_workers", data.get("max_workers", 0))
        if isinstance(most, bool) or not isinstance(most, int):
            raise UserError(f"{path}: available_node_types.{name}.max_workers: expected an integer, got {most!r}")
        if name != data.get("head_node_type") and most < 1:
            continue  # the launcher will never start one
        out.append(
            Node(
                f"type:{name}",
                f"node type {name}",
                {k: float(v) for k, v in res.items()},
                {str(k): str(v) for k, v in labels.items()},
                node_type=name,
            )
        )
    return out


def known_nodes(live: list[Node], config: str | Path | None) -> list[Node]:
    """Live nodes plus the node types the launcher config can still start."""
    return live + (node_types(config) if config else [])


def default_cluster_config(address: str | None) -> Path | None:
    """On a launcher-made head node, its config; elsewhere none (live nodes only)."""
    return BOOTSTRAP_CONFIG if address and BOOTSTRAP_CONFIG.is_file() else None


def cluster_nodes() -> list[Node]:
    import ray

    return [
        Node(n["NodeID"], n.get("NodeManagerHostname", ""), dict(n.get("Resources") or {}), dict(n.get("Labels") or {}))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def selector(device: str, node: Node) -> dict[str, str] | None:
    """The label selector by which `node` is a `device` node; None if it is not one."""
    need = NEEDS[device]
    if device == "cpu":
        return {}
    if node.labels.get(LABEL) == device:
        return {LABEL: device}
    if need.accel and node.labels.get(RAY_ACCEL) in need.accel:
        return {RAY_ACCEL: node.labels[RAY_ACCEL]}
    if need.resource and node.resources.get(need.resource, 0) >= 1:
        return {}
    if device in ("cuda", "rocm") and node.resources.get("GPU", 0) > 0 and LABEL not in node.labels:
        # any GPU node not claimed by a specific class, of the right vendor where Ray says which
        vendor = _vendor(node.labels.get(RAY_ACCEL))
        if vendor is None:
            return {}
        if vendor == ("nvidia" if device == "cuda" else "amd"):
            return {RAY_ACCEL: node.labels[RAY_ACCEL]}
        return None
    return None


def typed_nodes(device: str, nodes: list[Node]) -> list[tuple[Node, dict[str, str]]]:
    """The nodes that are `device` nodes, whatever their size, with their selector.

    A cpu cell goes to any node's CPUs, unless some nodes are labelled cpu: then only to those
    (the autoscaler must not start an 8-GPU machine for a CPU cell)."""
    if device == "cpu" and any(n.labels.get(LABEL) == "cpu" for n in nodes):
        return [(n, {LABEL: "cpu"}) for n in nodes if n.labels.get(LABEL) == "cpu"]
    return [(n, sel) for n in nodes if (sel := selector(device, n)) is not None]


def hosts(device: str, tp: int, threads: int, nodes: list[Node]) -> list[tuple[Node, dict[str, str]]]:
    """Device nodes big enough for the cell (live first, then launchable types), with their selector."""
    out = []
    for n, sel in typed_nodes(device, nodes):
        need = NEEDS[device]
        if need.gpu and n.resources.get("GPU", 0) < tp:
            continue
        if not need.gpu and n.resources.get("CPU", 0) < threads * (tp if tp > 1 else 1):
            continue
        out.append((n, sel))
    return sorted(out, key=lambda h: h[0].node_type is not None)


def _problem(device: str, tp: int, threads: int, nodes: list[Node]) -> tuple[str, str | None] | None:
    """(why no node of this cluster can ever host the cell, what was looked for), or None."""
    if device not in NEEDS:
        return f"device {device}: no placement rule (known: {', '.join(NEEDS)})", None
    if hosts(device, tp, threads, nodes):
        return None
    need = NEEDS[device]
    typed = [n for n, _ in typed_nodes(device, nodes)]
    if not typed:
        how = (
            [f"label {LABEL}={device}"]
            + [f"{RAY_ACCEL}={a}" for a in need.accel]
            + ([f"resource {need.resource}"] if need.resource else [])
        )
        where = "no node of the cluster" + (
            " and no node type of its config" if any(n.node_type for n in nodes) else ""
        )
        return f"device {device}: {where} is one", f"looked for {' or '.join(how)}"
    if need.gpu:
        most = max(int(n.resources.get("GPU", 0)) for n in typed)
        return f"device {device}: tp {tp} needs {tp} GPUs on one node; the largest {device} node has {most}", None
    most = max(int(n.resources.get("CPU", 0)) for n in typed)
    return f"device {device}: needs {threads * max(tp, 1)} CPUs on one node; the largest has {most}", None


def problem(device: str, tp: int, threads: int, nodes: list[Node]) -> str | None:
    """Why no node of this cluster can ever host the cell, or None."""
    p = _problem(device, tp, threads, nodes)
    return None if p is None else p[0] + (f" ({p[1]})" if p[1] else "")


@dataclass(frozen=True)
class Where:
    """Where a cell would run: live hosts, else the node types the autoscaler can start, else why nowhere."""

    live: tuple[str, ...] = ()
    launchable: tuple[str, ...] = ()
    problem: str | None = None  # set when nothing can ever host the cell
    looked_for: str | None = None

    @property
    def waits_for_autoscaler(self) -> bool:
        return not self.live and bool(self.launchable)

    def brief(self) -> str:
        if self.problem:
            return f"UNPLACEABLE: {self.problem}"
        if self.live:
            return ", ".join(self.live[:3]) + (f" (+{len(self.live) - 3})" if len(self.live) > 3 else "")
        return "autoscaler: " + ", ".join(self.launchable)

    def __str__(self) -> str:
        return self.brief() + (f" ({self.looked_for})" if self.problem and self.looked_for else "")


def where(device: str, tp: int, threads: int, nodes: list[Node]) -> Where:
    found = hosts(device, tp, threads, nodes)
    if not found:
        why, looked = _problem(device, tp, threads, nodes) or ("", None)
        return Where(problem=why, looked_for=looked)
    live = tuple(sorted({n.host or n.node_id[:8] for n, _ in found if n.node_type is None}))
    return Where(live=live, launchable=tuple(sorted({n.node_type for n, _ in found if n.node_type is not None})))


def pinned(pin: tuple[str, ...] | list[str]) -> dict[str, str]:
    """A label selector for "one of these nodes" (a cell bound to the nodes of one engine build)."""
    if not pin:
        return {}
    return {NODE_ID: pin[0] if len(pin) == 1 else f"in({','.join(sorted(pin))})"}


def actor_options(device: str, tp: int, threads: int, nodes: list[Node], pin: tuple[str, ...] = ()) -> dict[str, Any]:
    """Ray options for the cell's actor (tp == 1), or for each rank's bundle (tp > 1); `pin`:
    the node ids it may use (matrix/run/builds.py)."""
    found = hosts(device, tp, threads, nodes)
    sel = found[0][1] if found else {}
    if sel and RAY_ACCEL in sel:  # every accelerator type among the hosts, not just the first's
        types = sorted({h[1][RAY_ACCEL] for h in found if RAY_ACCEL in h[1]})
        sel = {RAY_ACCEL: types[0] if len(types) == 1 else f"in({','.join(types)})"}
    need = NEEDS[device]
    opts: dict[str, Any] = {"num_cpus": threads}
    if need.gpu:
        opts["num_gpus"] = 1
    if need.resource and found and found[0][0].resources.get(need.resource, 0) >= 1:
        opts["resources"] = {need.resource: 1}  # a node that advertises the device by resource
    sel = {**sel, **pinned(pin)}
    if sel:
        opts["label_selector"] = sel
    return opts


def placement_group_for(device: str, tp: int, threads: int, nodes: list[Node], pin: tuple[str, ...] = ()):
    """tp bundles on one node (STRICT_PACK): every rank of a tensor-parallel stack shares a host.

    Engines that start their own Ray workers (vLLM's Ray executor) get this group handed to them
    (engine_driver_options) rather than creating one inside it: a group inside a group deadlocks."""
    from ray.util.placement_group import placement_group

    opts = actor_options(device, tp, threads, nodes, pin)
    bundle = {"CPU": float(threads)}
    if opts.get("num_gpus"):
        bundle["GPU"] = 1.0
    for k, v in (opts.get("resources") or {}).items():
        bundle[k] = float(v)
    sel = opts.get("label_selector")
    return placement_group(
        [dict(bundle) for _ in range(tp)],
        strategy="STRICT_PACK",
        bundle_label_selector=[dict(sel) for _ in range(tp)] if sel else None,
    )


def engine_driver_options(pg) -> dict[str, Any]:
    """Ray options for the actor of an engine that starts its own Ray workers into `pg`.

    It sits in bundle 0 with one CPU and no device (the workers take the devices, one per bundle),
    and captures child tasks, so the engine's get_current_placement_group() returns `pg` and its
    workers join it instead of a group of their own."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 1,
        "num_gpus": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        ),
    }


def cell_threads(cell, nodes: list[Node]) -> int:
    """The spec's threads, else the smallest node's CPU count (live nodes; types when none is)."""
    if cell.threads:
        return cell.threads
    live = [n for n in nodes if n.node_type is None] or nodes
    cpus = [n.resources.get("CPU", 0) for n in live]
    return max(1, int(min(c for c in cpus if c > 0))) if any(cpus) else 1


def check_placement(cells: list, nodes: list[Node], log: Callable[[str], None]) -> None:
    """Before anything is written: a cell no node (or node type) can host would wait forever."""
    unplaceable = {c.stack_id: p for c in cells if (p := problem(c.device, c.tp, cell_threads(c, nodes), nodes))}
    if unplaceable:
        cid, why = next(iter(unplaceable.items()))
        more = f" (and {len(unplaceable) - 1} more cell(s))" if len(unplaceable) > 1 else ""
        raise UserError(
            f"cannot place {cid}: {why}{more}; nodes: "
            + ", ".join(f"{n.host or n.node_id[:8]} {_node_desc(n)}" for n in nodes)
        )
    for c in cells:
        w = where(c.device, c.tp, cell_threads(c, nodes), nodes)
        if w.waits_for_autoscaler:
            log(
                f"{c.stack_id}: no live node can host it yet; it waits for the autoscaler to start "
                + ", ".join(w.launchable)
            )


def _node_desc(n) -> str:
    dev = n.labels.get(LABEL) or n.labels.get(RAY_ACCEL) or "cpu"
    if n.node_type:
        dev = f"launchable, {dev}"
    return f"[{dev}, {int(n.resources.get('CPU', 0))} CPU, {int(n.resources.get('GPU', 0))} GPU]"
