"""The units of `matrix analyze` (analysis/analyze.py) and how they are planned.

A unit is one output file set, written whole: a cell's metrics against its model's reference,
or a centroid group's centroid metrics and pairwise table. Each carries the content key of its
inputs (analysis/unit_keys.py) and is cut by prompt into pieces of comparable work, the tasks a
caller may spread over Ray.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from analysis.unit_keys import cell_key
from analysis.unit_keys import unit_key as _key
from store import Warehouse
from store.cell_rows import CellRow
from store.floors import StorageFloor
from store.stream import shard_index
from store.verify import DamagedShard

# Rows (summed over a group's members) per piece of a unit: pieces are what Ray tasks run, so a
# unit of many prompts spreads over the cores; one prompt is never cut.
PIECE_ROWS = 512
# what a group's row costs, in rows of a cell's reference metrics (reads included): pieces are cut
# and Ray-scheduled by this estimate of their work (docs/benchmark-notes.md)
CENTROID_ROW_COST, PAIR_ROW_COST = 1.5, 0.35


@dataclass
class Unit:
    kind: str  # "cell" | "group"
    name: str  # the output file's name: a cell id, or <model>[.<group>]
    key: str  # content key of the inputs (see module doc)
    rows: int  # rows it compares, for progress
    args: dict = field(default_factory=dict)  # what run_task needs; plain data (it travels to Ray tasks)
    pieces: list = field(default_factory=lambda: [None])  # prompt-id lists, computed apart; None: all
    counts: dict = field(default_factory=dict)  # rows per prompt, what pieces are cut from
    weight: float = 1.0  # work per row, in reference-metric rows (a group's pairs make its rows heavier)

    def tasks(self) -> list["Task"]:
        n = len(self.pieces)
        rows = [self.rows // n + (i < self.rows % n) for i in range(n)]
        return [
            Task(self.kind, self.name, self.args, p, rows[i], i, rows[i] * self.weight)
            for i, p in enumerate(self.pieces)
        ]


@dataclass
class Task:
    """One piece of a unit: its prompts only. What travels to a Ray task and back is small."""

    kind: str
    name: str
    args: dict
    prompts: list[str] | None
    rows: int
    piece: int
    work: float = 0.0  # estimated cost: Ray runs the largest first, so no big piece is left for last


def _pieces(counts: dict[str, int], weight: float = 1.0) -> list[list[str] | None]:
    """Consecutive prompts cut into pieces of at least PIECE_ROWS rows' work (rows x weight;
    one piece: [None], all)."""
    out, cur, n, target = [], [], 0, PIECE_ROWS
    for pid, rows in counts.items():
        cur.append(pid)
        n += rows * weight
        if n >= target:
            out, cur, n = out + [cur], [], 0
    if cur:
        out.append(cur)
    return out if len(out) > 1 else [None]


def _reference(group: list[CellRow], by_id: dict, reference: str | None, model: str) -> str | None:
    """The model's reference cell: --reference, else the newest capture of the reference stack."""
    if reference and by_id[reference].model == model:
        return reference
    refs = {c.reference_cell_id for c in group if c.reference_cell_id in by_id}
    return max(refs, key=lambda r: (by_id[r].get("finished_at"), r)) if refs else None


def _digests(wh: Warehouse, cell: CellRow, summary: dict, log) -> dict[int, tuple[str, dict[str, int]]]:
    """repeat -> (content digest, rows per prompt in shard order) of each readable shard of a
    cell (small columns only)."""
    out = {}
    for r in range(cell.repeats):
        try:
            i = shard_index(wh, cell.cell_id, r)
            out[r] = (i.digest, {p: len(v.positions) for p, v in i.prompts.items()})
        except DamagedShard as e:
            if not summary["skip_damaged"]:
                raise
            summary["damaged"].append(str(e))
            log(f"SKIPPED (damaged) {str(e).split('; run')[0]}")
    return out


def plan(wh: Warehouse, done: list[CellRow], reference: str | None, centroid: str, summary: dict, log) -> list[Unit]:
    """Every unit of the warehouse, with its content key."""
    by_id = {c.cell_id: c for c in done}
    units = []
    for model in sorted({c.model for c in done}):
        group = sorted((c for c in done if c.model == model), key=lambda c: c.cell_id)
        ref_id = _reference(group, by_id, reference, model)
        if ref_id is None:
            log(f"{model}: no reference cell captured; skipping the reference metrics")
            continue
        digests = {c.cell_id: _digests(wh, c, summary, log) for c in group}
        if 0 not in digests[ref_id]:
            log(f"{model}: its reference {ref_id} is damaged; no metrics for this model")
            continue
        units += _cell_units(group, by_id[ref_id], digests)
        units += _group_units(model, group, ref_id, centroid, digests)
    return units


def _cell_units(group: list[CellRow], ref: CellRow, digests: dict) -> list[Unit]:
    """A unit per cell of a model: its readable repeats against the reference's repeat 0."""
    ref_id = ref.cell_id
    ref_digest, ref_floor = digests[ref_id][0][0], StorageFloor.of_cell(ref)
    units = []
    for c in group:
        cid, floor, d = c.cell_id, ref_floor + StorageFloor.of_cell(c), digests[c.cell_id]
        counts: dict[str, int] = {}  # rows per prompt, of every repeat: one may lack a prompt's rows another has
        for _, per in d.values():
            for p, n in per.items():
                counts[p] = max(counts.get(p, 0), n)
        parts = (ref_id, ref_digest, floor, {r: v[0] for r, v in d.items()})
        units.append(
            Unit(
                "cell",
                cid,
                cell_key(*parts),
                sum(sum(v[1].values()) for v in d.values()),
                {"cell_id": cid, "repeats": c.repeats, "ref_id": ref_id, "floor": floor, "key_parts": parts},
                _pieces({p: n * len(d) for p, n in counts.items()}),
            )
        )
    return units


def _centroid_groups(model: str, group: list[CellRow], centroid: str, digests: dict) -> dict[str, list[str]]:
    """Centroid group name -> its members' cell ids (none when only the reference metrics were asked for)."""
    groups: dict[str, list[str]] = {}
    for c in group if centroid != "none" else ():
        if not c.replica and 0 in digests[c.cell_id]:  # another host's copy would weigh a stack twice
            groups.setdefault(c.centroid_group or model, []).append(c.cell_id)
    return groups


def _group_units(model: str, group: list[CellRow], ref_id: str, centroid: str, digests: dict) -> list[Unit]:
    """A unit per centroid group of a model: its members' repeat 0 against their centroid, and every pair."""
    units = []
    for gname, ids in sorted(_centroid_groups(model, group, centroid, digests).items()):
        name = model if gname == model else f"{model}.{gname}"
        counts: dict[str, int] = {}
        for i in ids:
            for p, n in digests[i][0][1].items():
                counts[p] = counts.get(p, 0) + n
        pair_keys = {
            f"{a}|{b}": _key(pair=[a, b], digests=[digests[a][0][0], digests[b][0][0]])
            for a, b in itertools.combinations(sorted(ids), 2)
        }
        args = {"ids": ids, "ref_id": ref_id, "centroid": centroid, "group": gname, "model": model}
        units.append(
            Unit(
                "group",
                name,
                _key(ref=ref_id, centroid=centroid, group=gname, members={i: digests[i][0][0] for i in ids}),
                sum(counts.values()),
                {**args, "pair_keys": pair_keys},
                counts=dict(sorted(counts.items())),
            )
        )
    return units


def keep_pairs(wh: Warehouse, u: Unit, force: bool) -> None:
    """A group whose members changed still has pairs whose two shards did not: their pairwise
    rows are kept (args["kept"]) and only the others measured (args["pairs"]). Pairwise work
    grows as members squared, so one new stack costs its own pairs, not all of them."""
    old = {} if force else (wh.table_meta("pairwise", u.name) or {}).get("pairs", {})
    keys = u.args["pair_keys"]
    u.args["kept"] = sorted(p for p, k in keys.items() if old.get(p) == k)
    u.args["pairs"] = [p.split("|") for p in sorted(keys) if old.get(p) != keys[p]]
    # a member-row costs its share of the centroid (eager float64) and its share of the pairs
    u.weight = CENTROID_ROW_COST + PAIR_ROW_COST * len(u.args["pairs"]) / max(1, len(u.args["ids"]))
    u.pieces = _pieces(u.counts, u.weight)
