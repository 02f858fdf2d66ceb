"""What a spec expands to before anything runs: its cells, the combinations it skips, and, given a
cluster or a warehouse, where each cell would run and which engine build would capture it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import extras
from common.output import log as stderr_log


@dataclass(frozen=True)
class CellsResult:
    """cells: one entry per stack (its axes, options, partners, extras, role); placements: stack id ->
    matrix.run.placement's answer where a cluster was named; unplaceable: the one line `run` would
    refuse the spec with (the verb prints the cells, then exits 2 on it)."""

    spec: str
    cells: tuple[dict, ...]
    skipped: tuple[dict, ...]
    stride: int
    positions: dict
    repeats: int
    corpus: str
    positions_text: str  # the positions kept, in words
    layer_states: dict = field(default_factory=dict)  # stack id -> bytes its layer states will take
    placements: dict = field(default_factory=dict)
    builds: bool = False  # whether each cell says which builds captured it and what a run would do
    unplaceable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "cells": list(self.cells),
            "skipped": list(self.skipped),
            "stride": self.stride,
            "positions": self.positions,
            "repeats": self.repeats,
            "corpus": self.corpus,
        }


def cells(
    spec: str,
    address: str | None = None,
    cluster_config: str | None = None,
    warehouse: str | None = None,
    log: Callable[[str], None] | None = None,
) -> CellsResult:
    """address / cluster_config: also where each cell would run on that cluster or those node types;
    warehouse: also which engine builds captured each stack there, and whether a run would again."""
    from common.errors import UserError
    from matrix.run import placement
    from matrix.spec.cells import load_spec

    matrix = load_spec(spec)
    sizes = layer_sizes(matrix)
    entries = [_entry(c, matrix, sizes) for c in matrix.cells]
    nodes, answers = _known_nodes(address, cluster_config, matrix if warehouse else None, log or stderr_log)
    placed, unplaceable = {}, None
    if nodes is not None:
        placed = {
            c.stack_id: placement.where(c.device, c.tp, placement.cell_threads(c, nodes), nodes) for c in matrix.cells
        }
        for e in entries:
            e["placement"] = str(placed[e["stack_id"]])
        try:
            placement.check_placement(matrix.cells, nodes, lambda msg: None)  # the same refusal as `run`
        except UserError as e:
            unplaceable = str(e)
    if warehouse:
        from matrix.api.builds import build_columns

        builds = build_columns(matrix, warehouse, answers)
        for e in entries:
            e.update(builds[e["stack_id"]])
    s = matrix.spec
    return CellsResult(
        spec=str(s.path),
        cells=tuple(entries),
        skipped=tuple(matrix.skipped),
        stride=s.stride,
        positions=s.positions.to_dict(),
        repeats=s.repeats,
        corpus=s.corpus,
        positions_text=s.positions.describe(),
        layer_states=sizes,
        placements=placed,
        builds=bool(warehouse),
        unplaceable=unplaceable,
    )


def _entry(c, matrix, sizes: dict) -> dict:
    """One stack of the spec as `matrix cells --json` lists it."""
    return {
        **c.axes(),
        "threads": c.threads,
        "options": c.opts,
        "max_tokens": c.max_tokens,
        "partners": dict(c.partners),  # {plug-in: the stack id it grades this cell against}
        "stack_id": c.stack_id,
        "layer_states": sizes.get(c.stack_id),
        **{x.key: None if c.extra(x.key) is None else x.describe(c.extra(x.key)) for x in extras.cell_extras()},
        "replica": c.replica,
        "reference": c.stack_id in matrix.reference_stacks.values(),
        "candidate": None
        if c.artifact is None
        else {"file": c.artifact, "sha256": c.artifact_sha256, "label": c.label},
    }


def layer_sizes(matrix) -> dict[str, dict]:
    """stack id -> the bytes its layer states will take; resolving the models and tokenising the
    corpus only when a cell asks for layers (a bad index: exit 2 here too)."""
    if not any(c.extra("layers") for c in matrix.cells):
        return {}
    from backends import backend_class
    from matrix.run.runner import expected_rows, prepare

    plan = prepare(matrix, None, lambda m: None)
    layers = extras.get("layers")
    out = {}
    for c in plan.matrix.cells:
        if c.extra("layers"):
            wide = backend_class(c.engine).state_bytes(c) == 4
            out[c.stack_id] = layers.bytes_estimate(
                c.extra("layers"), expected_rows(plan, c) * plan.spec.repeats, plan.models[c.model].hidden, wide
            )
    return out


def _known_nodes(address, cluster_config, probe_matrix, log) -> tuple[list | None, dict | None]:
    """Live nodes of address plus the node types of the launcher config (None: neither given), and
    with probe_matrix, the engine build of each node its cells can use (matrix/run/builds.py)."""
    from matrix.run import cluster, placement

    if not address and not cluster_config:
        return None, None
    config = cluster_config or placement.default_cluster_config(address)
    if not address:
        return placement.known_nodes([], config), None
    answers = None
    owned = not cluster.connected()
    cluster.init_ray(address)
    try:
        known = placement.known_nodes(placement.cluster_nodes(), config)
        if probe_matrix is not None:
            from matrix.run import builds
            from matrix.run.ray_executor import RayExecutor
            from matrix.spec.models import fetch

            placement.check_placement(probe_matrix.cells, known, lambda msg: None)
            models = {n: fetch(ref, log=log) for n, ref in probe_matrix.spec.models.items()}
            answers = builds.probe(probe_matrix.cells, models, known, log, RayExecutor(config))
    finally:
        cluster.release(owned)
    return known, answers
