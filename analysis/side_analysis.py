"""`matrix analyze`'s part for rows off the plain prefill path: every row of a cell's side file
whose path is not 'prefill' (each per-cell extra that writes there names its paths and a PathRule:
fed one token at a time from the KV cache, recomputed with a warm cache, ...) against the same
position's prefill row of the same cell, and against the reference's prefill row there, into
`decode_metrics/<cell_id>.parquet`.

A side file is small (starts x steps x prompts rows, or a few rows per prompt), so it is read whole;
the reference's rows come from its own side file where it has one, else from its capture's shard
(a prefix-cached row sits at a sampled position). The output is rewritten only when its inputs changed
(content key in its metadata, as the other analysis outputs)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from analysis import metrics as M
from store import Warehouse
from store.cell_rows import CellRow
from store.stream import Rows, shard_index
from store.warehouse import logits_matrix

DECODE_KERNEL = f"decode-2+metrics-{M.KERNEL_VERSION}"


@dataclass(frozen=True)
class PathRule:
    """How one path of the side file is compared (declared by the extra that writes it)."""

    active: Callable[[dict], bool]  # whether a cells row recorded rows on this path
    # the reference's own side file holds its prefill rows at this path's positions (else: its shard)
    reference_file: bool = False
    hits: Callable[[dict], dict] | None = None  # prompt -> leading tokens a cache served (cached_tokens)
    reference_shard: bool = False  # its rows sit at sampled positions: the reference's shard is an input
    # the step of the prefill row each row pairs with: None, its own step; a number, that step (one
    # prefill row serving rows of several steps, as several chunk sizes at one position)
    prefill_step: int | None = None


def _digest(wh: Warehouse, cell_id: str, repeat: int) -> str:
    """A side file's content key part, from its row hashes alone (no logits read)."""
    hashes = wh.read_shard(cell_id, repeat, ["row_hash"], "side").column("row_hash").to_pylist()
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


def _read(wh: Warehouse, cell_id: str, repeat: int, paths: tuple[str, ...]) -> dict[str, Any]:
    """{path: {(prompt, position, step): row index}, "values": (rows, vocab) float32, "hash"}."""
    t = wh.read_shard(cell_id, repeat, ["prompt_id", "position", "step", "path", "row_hash", "logits"], "side")
    d = t.select(["prompt_id", "position", "step", "path", "row_hash"]).to_pydict()
    out: dict[str, Any] = {
        "prefill": {},
        **{p: {} for p in paths},
        "hash": d["row_hash"],
        "values": logits_matrix(t.column("logits")),
    }  # (rows, vocab) float32, exact
    for i, (p, q, s, path) in enumerate(zip(d["prompt_id"], d["position"], d["step"], d["path"])):
        if path in out:  # a path of an extra not registered here is left out, not an error
            out[path][(p, q, s)] = i
    return out


class Reference:
    """The reference's prefill row at (prompt, position): from its side file, else its capture's shard.
    One per reference, shared by its cells; each part is read the first time it is needed."""

    def __init__(self, wh: Warehouse, ref_id: str, has_file: bool, paths: tuple[str, ...]):
        self.wh, self.ref_id, self.has_file, self.paths = wh, ref_id, has_file, paths

    @functools.cached_property
    def digest(self) -> str | None:  # of its side file (row hashes only)
        return _digest(self.wh, self.ref_id, 0) if self.has_file else None

    @functools.cached_property
    def index(self):  # its capture shard's small columns
        return shard_index(self.wh, self.ref_id, 0)

    @functools.cached_property
    def file(self) -> dict | None:  # its side file, logits included
        return _read(self.wh, self.ref_id, 0, self.paths) if self.has_file else None

    @functools.cached_property
    def at(self) -> dict[tuple[str, int], int]:
        return {(p, q): i for (p, q, _), i in self.file["prefill"].items()} if self.file else {}

    def rows(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray]:
        out = {k: self.file["values"][self.at[k]] for k in keys if k in self.at}
        rest = sorted({k for k in keys if k not in out and k[0] in self.index.prompts})
        for prompt in sorted({p for p, _ in rest}):
            pr = self.index.prompts[prompt]
            where = {int(q): i for i, q in enumerate(pr.positions)}
            want = [(q, where[q]) for p, q in rest if p == prompt and q in where]
            if want:
                got = Rows(self.wh, self.index, prompt, len(want)).take(np.array([i for _, i in want]))  # (n, vocab)
                out.update({(prompt, q): got[j] for j, (q, _) in enumerate(want)})
        return out


def compare(
    cell_id: str, repeat: int, mine: dict, ref: Reference | None, hits: dict[str, int], rules: dict[str, PathRule]
) -> pa.Table:
    keys = [(path, k) for path in rules for k in sorted(mine[path])]
    other = np.array([mine[path][k] for path, k in keys], np.int64)
    step = {path: r.prefill_step for path, r in rules.items()}
    pre = np.array([mine["prefill"][k if step[p] is None else (*k[:2], step[p])] for p, k in keys], np.int64)
    v = mine["values"]
    own = M.row_metrics(v[pre], v[other])  # KL(P_prefill || P_other), same cell
    n = len(keys)
    kld, kld_pre, top1 = [None] * n, [None] * n, [None] * n  # null where the reference has no row
    got = ref.rows([(k[0], k[1]) for _, k in keys]) if ref is not None else {}
    hit = [j for j, (_, k) in enumerate(keys) if (k[0], k[1]) in got]
    if hit:
        r = np.stack([got[(keys[j][1][0], keys[j][1][1])] for j in hit])  # (hits, vocab)
        j = np.array(hit)
        vs_other, vs_pre = M.row_metrics(r, v[other[j]]), M.row_metrics(r, v[pre[j]])
        for x, jj in enumerate(hit):
            kld[jj], kld_pre[jj], top1[jj] = (
                float(vs_other["kld"][x]),
                float(vs_pre["kld"][x]),
                bool(vs_other["top1_match"][x]),
            )
    same = [mine["hash"][a] == mine["hash"][b] for a, b in zip(other, pre)]
    return pa.table(
        {
            "cell_id": [cell_id] * n,
            "reference_cell_id": [ref.ref_id if ref else None] * n,
            "prompt_id": [k[0] for _, k in keys],
            "position": pa.array([k[1] for _, k in keys], pa.int32()),
            "step": pa.array([k[2] for _, k in keys], pa.int32()),
            "repeat": pa.array([repeat] * n, pa.int32()),
            "path": [p for p, _ in keys],
            "cached_tokens": pa.array([hits.get(k[0]) if rules[p].hits else None for p, k in keys], pa.int32()),
            "kld_vs_prefill": pa.array(own["kld"], pa.float64()),
            "max_abs_diff_vs_prefill": pa.array(own["max_abs_diff"], pa.float64()),
            "top1_match_prefill": pa.array(own["top1_match"], pa.bool_()),
            "identical_to_prefill": pa.array(same, pa.bool_()),
            "kld": pa.array(kld, pa.float64()),
            "top1_match": pa.array(top1, pa.bool_()),
            "kld_prefill": pa.array(kld_pre, pa.float64()),
            "kernel_version": [DECODE_KERNEL] * n,
        }
    )


def _key(wh: Warehouse, cell: CellRow, ref: Reference | None, repeats: list[int], rules: dict[str, PathRule]) -> str:
    """Content key: this cell's side files, the reference's side file and capture shard."""
    shard = any(r.reference_shard and r.active(cell) for r in rules.values())
    parts = {
        "kernel": DECODE_KERNEL,
        "ref": ref and ref.ref_id,
        "ref_digest": ref and ref.digest,
        "ref_shard": ref.index.digest if ref and shard else None,
        "shards": {r: _digest(wh, cell.cell_id, r) for r in repeats},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def analyze_side(
    wh: Warehouse, done: list[CellRow], force: bool, log: Callable[[str], None], rules: dict[str, PathRule]
) -> dict[str, Any]:
    """rules: path -> PathRule, for every path a per-cell extra writes (in the order compared)."""
    by_id = {c.cell_id: c for c in done}
    out = {"cells": 0, "reused": 0, "rows": 0, "no_reference_rows": []}
    refs: dict[str, Reference] = {}
    paths = tuple(rules)
    for cell in done:
        active = [r for r in rules.values() if r.active(cell)]
        if not active:
            continue
        ref_id = cell.reference_cell_id if cell.reference_cell_id in by_id else None
        ref_file = bool(ref_id and any(r.reference_file and r.active(by_id[ref_id]) for r in rules.values()))
        if any(r.reference_file for r in active) and not ref_file:
            out["no_reference_rows"].append(cell.cell_id)
            log(
                f"{cell.cell_id}: its reference {ref_id} recorded no side file; "
                "its rows off the prefill are compared with this cell's own prefill only"
            )
        repeats = sorted(wh.completed_repeats(cell.cell_id, "side"))
        ref = refs.setdefault(ref_id, Reference(wh, ref_id, ref_file, paths)) if ref_id else None
        key = _key(wh, cell, ref, repeats, rules)
        meta = wh.table_meta("decode_metrics", cell.cell_id) or {}
        out["cells"] += 1
        if not force and meta.get("key") == key:
            out["reused"] += 1
            out["rows"] += meta.get("rows", 0)
            continue
        hits = {k: v for r in active if r.hits for k, v in r.hits(cell).items()}
        table = pa.concat_tables(
            [compare(cell.cell_id, r, _read(wh, cell.cell_id, r, paths), ref, hits, rules) for r in repeats]
        )
        wh.write_table(
            "decode_metrics",
            cell.cell_id,
            table,
            {"key": key, "kernel_version": DECODE_KERNEL, "rows": table.num_rows},
        )
        out["rows"] += table.num_rows
    return out
