"""Binding each cell to the engine build of the node(s) it will run on, before anything starts.

A spec names a stack; which llama.cpp / torch / vLLM build runs it is a fact of the node. The
run asks every live node that can host a cell (a metadata-only task, actors/probe.py, in the
cell's own runtime_env), then:

- all those nodes have one build: the cell is `stack@build`, pinned to them;
- they differ: it runs on the build that already captured it, else on the build most of them
  have, pinned to those nodes (the others are named in the log);
- `replicas: N`: replica i runs on the i-th of those nodes by (host, node id), each with its
  own node's build, so the same stack on two hosts is two cells and byte identity a query;
- no live node, only node types the autoscaler can start: the probe asks for what the cell
  asks for, and the cell is pinned where the probe ran.

A cell that cannot be bound (a probe failed, fewer nodes than replicas) is left out of this run
with the reason; it is not recorded, so the next run tries again.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from backends import backend_class
from common import ids
from common.builds import describe, engine_build
from common.stack import Cell
from matrix.run import placement
from matrix.run.sweep import HEARTBEAT_S
from matrix.spec.cells import stack_desc


def _probe_keys(cell: Cell, model, nodes: list) -> tuple[list[tuple], dict, dict | None]:
    """The (where, env, libraries) probes this cell needs, the Ray options of each, its runtime_env."""
    cls = backend_class(cell.engine)
    threads = placement.cell_threads(cell, nodes)
    env = cls.runtime_env(stack_desc(cell, model), threads)
    env_key = json.dumps(env, sort_keys=True, default=str)
    live = sorted({n.node_id for n, _ in placement.hosts(cell.device, cell.tp, threads, nodes) if n.node_type is None})
    if live:
        return (
            [(n, env_key, cls.libraries) for n in live],
            {n: {"label_selector": placement.pinned([n])} for n in live},
            env,
        )
    # Only node types the autoscaler can start: ask for what the cell asks for, so one is started.
    where = "autoscaler:" + cell.stack_id
    opts = placement.actor_options(cell.device, 1, threads, nodes)
    return [(where, env_key, cls.libraries)], {where: opts}, env


def probe(
    cells: list[Cell], models: dict, nodes: list, log: Callable[[str], None], ex, own_cluster: bool = False
) -> dict[str, list]:
    """stack id -> [probe result or the exception it raised, one per node that can host it].
    ex: the executor (matrix/run/launch.py Executor) whose nodes will run the cells.

    own_cluster: the run started its cluster itself (or runs locally), so the driver's node runs
    hosts in the driver's own interpreter and environment; its build is read here, without a task."""
    import socket

    here = ex.here() if own_cluster else None
    futures, results, wants = {}, {}, {}
    for cell in cells:
        keys, opts, env = _probe_keys(cell, models[cell.model], nodes)
        for key in keys:
            if key in futures or key in results:
                continue
            if key[0] == here and not env:
                results[key] = {"node_id": here, "host": socket.gethostname(), **engine_build(key[2])}
            else:
                futures[key] = ex.node_build(opts[key[0]], env, key[2])
        wants[cell.stack_id] = keys
    results.update(_gather(ex, futures, log))
    return {sid: [results[k] for k in keys] for sid, keys in wants.items()}


def _gather(ex, futures: dict, log: Callable[[str], None]) -> dict:
    out, pending = {}, {ref: key for key, ref in futures.items()}
    t0 = time.perf_counter()
    while pending:
        ready = ex.wait(list(pending), HEARTBEAT_S)
        for ref in ready:
            key = pending.pop(ref)
            try:
                out[key] = ex.get(ref)
            except Exception as e:  # kept as this node's answer: the cells that needed it are left out
                out[key] = e
        if pending and not ready:
            waiting = sorted(
                {
                    f"{k[0][11:]} (for the autoscaler to start a node)"
                    if k[0].startswith("autoscaler:")
                    else f"node {k[0][:12]}"
                    for k in pending.values()
                }
            )
            log(
                f"waiting {time.perf_counter() - t0:.0f}s for engine builds: {len(futures) - len(pending)}/"
                f"{len(futures)} answered; not yet: {', '.join(waiting[:3])}"
                + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else "")
            )
    return out


def captured_builds(rows: list[dict]) -> dict[str, set[str]]:
    """Spec id (stack and replica) -> the builds that captured it, from the cells table's rows."""
    out: dict[str, set[str]] = {}
    for r in rows:
        if r["status"] == "done" and r.get("build"):
            out.setdefault(r["cell_id"].partition("@")[0], set()).add(r["build"])
    return out


def _replica_group(cell: Cell) -> str:
    return cell.stack_id.rsplit(".r", 1)[0] if cell.replica else cell.stack_id


def _choose(cell: Cell, answers: list[dict], captured: set[str], log: Callable[[str], None]) -> str:
    """The build a single-replica cell runs on, when its nodes disagree."""
    by_build: dict[str, list[dict]] = {}
    for a in answers:
        by_build.setdefault(a["build"], []).append(a)
    if len(by_build) == 1:
        return answers[0]["build"]
    have = sorted(captured & set(by_build))
    pick = have[0] if have else sorted(by_build, key=lambda b: (-len(by_build[b]), b))[0]
    log(
        f"{cell.stack_id}: the nodes that can host it differ in {cell.engine} build ("
        + "; ".join(
            f"{b}: {describe(v[0]['libraries'])} on {', '.join(sorted({a['host'] for a in v}))}"
            for b, v in sorted(by_build.items())
        )
        + f"); it runs on build {pick}"
        + (" (already captured)" if have else " (most nodes)")
    )
    return pick


def _able(cell: Cell, answers: list[dict]) -> tuple[list[dict], str | None]:
    """The nodes (probe answers) that can run what the cell's plug-ins ask of them (Extra.node_refusal:
    a CPU code path's instructions), and the first refusal in words where any node was refused."""
    import extras

    asked = extras.of(cell)
    refusals = [(a, [f"{x.key} {v}: {why}" for x, v in asked if (why := x.node_refusal(v, a))]) for a in answers]
    first = next((why[0] for _, why in refusals if why), None)
    return [a for a, why in refusals if not why], first


def bind(
    cells: list[Cell], answers: dict[str, list], captured: dict[str, set[str]], log: Callable[[str], None]
) -> tuple[list[Cell], dict[str, dict], dict[str, str]]:
    """(bound cells, cell id -> its build's libraries, stack id -> why it is left out)."""
    bound, libs, left_out = [], {}, {}
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(_replica_group(c), []).append(c)
    for group in groups.values():
        got = answers[group[0].stack_id]
        bad = [a for a in got if isinstance(a, Exception)]
        ok = [a for a in got if not isinstance(a, Exception)]
        if not ok:
            why = f"could not ask a node for its {group[0].engine} build: {str(bad[0]).strip().splitlines()[-1][:300]}"
            left_out.update({c.stack_id: why for c in group})
            continue
        ok, refused = _able(group[0], ok)
        if not ok:
            left_out.update({c.stack_id: f"no node that can host it runs it: {refused}" for c in group})
            continue
        if len(group) == 1:
            build = _choose(group[0], ok, captured.get(group[0].stack_id, set()), log)
            places = [[a for a in ok if a["build"] == build]]
        else:  # replica i on the i-th node by (host, node id), each with its own node's build
            nodes = sorted({a["node_id"]: a for a in ok}.values(), key=lambda a: (a["host"], a["node_id"]))
            places = [[a] for a in nodes]
        for c in group:
            i = 0 if len(group) == 1 else c.replica
            if i >= len(places):
                left_out[c.stack_id] = (
                    f"replicas: {len(group)} needs {len(group)} nodes that can host it; {len(places)} can"
                )
                continue
            at = places[i]
            cid = ids.cell_id(c.stack_id, at[0]["build"])
            bound.append(c.bound(at[0]["build"], pin=tuple(sorted(a["node_id"] for a in at))))
            libs[cid] = at[0]["libraries"]
    return bound, libs, left_out
