"""`matrix analyze`'s per-layer part: each `layers:` cell's hidden states against its
reference's same (prompt, position, layer), written to `layer_metrics/<cell_id>.parquet`, and the
per-layer table `matrix layers` prints with its verdict.

Read a prompt at a time (a shard's row groups), so memory follows one prompt's layer rows, never
the corpus. A file is recomputed only when its inputs changed (content key in its metadata)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analysis import layer_metrics as LM
from common.errors import UserError
from store import Warehouse
from store.cell_rows import CellRow
from store.layer_states import states_by_layer

LAYER_KERNEL = "layers-1"  # bump when row_metrics' arithmetic changes: every file is recomputed


def _open(wh: Warehouse, cell_id: str, repeat: int) -> pq.ParquetFile:
    return pq.ParquetFile(
        wh.shard_path(cell_id, repeat, "layer_states"), filesystem=wh.loc.fs, page_checksum_verification=True
    )


def _groups(pf: pq.ParquetFile) -> tuple[dict[str, list[int]], str]:
    """prompt -> its row groups, and a digest of every row's (prompt, position, layer, hash)."""
    out: dict[str, list[int]] = {}
    h = hashlib.sha256()
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["prompt_id", "position", "layer", "row_hash"]).to_pydict()
        for p in dict.fromkeys(t["prompt_id"]):
            out.setdefault(p, []).append(g)
        for row in zip(t["prompt_id"], t["position"], t["layer"], t["row_hash"]):
            h.update(("\0".join(map(str, row)) + "\n").encode())
    return out, h.hexdigest()


def _prompt_rows(pf: pq.ParquetFile, groups: list[int], prompt: str) -> pa.Table:
    t = pf.read_row_groups(groups)
    return (
        t.filter(pc.equal(t.column("prompt_id"), prompt))
        if len(groups) > 1 or set(t.column("prompt_id").to_pylist()) != {prompt}
        else t
    )


def compare(cell: CellRow, ref_id: str, repeat: int, mine: tuple, ref: tuple) -> tuple[pa.Table, int]:
    """One repeat of a cell against the reference's repeat 0 (mine, ref: (ParquetFile, groups)).
    Returns (LAYER_METRICS rows, rows the reference has no row for)."""
    pf, groups = mine
    ref_pf, ref_groups = ref
    parts, unaligned = [], 0
    for prompt, gs in groups.items():
        mine = states_by_layer(_prompt_rows(pf, gs, prompt))
        if prompt not in ref_groups:
            unaligned += sum(len(v[0]) for v in mine.values())
            continue
        theirs = states_by_layer(_prompt_rows(ref_pf, ref_groups[prompt], prompt))
        for layer, (keys, got, index) in mine.items():  # got: (rows, hidden)
            rkeys, rvals, _ = theirs.get(layer, ([], None, 0))
            at = {k: i for i, k in enumerate(rkeys)}
            pick = [(i, at[k]) for i, k in enumerate(keys) if k in at]
            unaligned += len(keys) - len(pick)
            if not pick:
                continue
            a, b = np.array([p[0] for p in pick]), np.array([p[1] for p in pick])
            m = LM.row_metrics(rvals[b], got[a])
            parts.append(_rows(cell.cell_id, ref_id, repeat, layer, index, [keys[i] for i in a], m))
    return (pa.concat_tables(parts) if parts else _rows(cell.cell_id, ref_id, repeat, "", 0, [], None)), unaligned


def _rows(cell_id: str, ref_id: str, repeat: int, layer: str, index: int, keys: list, m: dict | None) -> pa.Table:
    n = len(keys)
    m = m or {k: np.zeros(0) for k in ("cosine", "norm_ratio", "rel_l2", "max_abs_diff", "allclose")}
    return pa.table(
        {
            "cell_id": [cell_id] * n,
            "reference_cell_id": [ref_id] * n,
            "prompt_id": [k[0] for k in keys],
            "position": pa.array([k[1] for k in keys], pa.int32()),
            "repeat": pa.array([repeat] * n, pa.int32()),
            "layer": [layer] * n,
            "layer_index": pa.array([index] * n, pa.int32()),
            **{k: pa.array(m[k], pa.float64()) for k in ("cosine", "norm_ratio", "rel_l2", "max_abs_diff")},
            "allclose": pa.array(m["allclose"], pa.bool_()),
            "kernel_version": [LAYER_KERNEL] * n,
        }
    )


def analyze_layers(
    wh: Warehouse, done: list[CellRow], reference: str | None, force: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every cell with layer states vs its reference's (or --reference's, same model)."""
    by_id = {c.cell_id: c for c in done}
    out = {"cells": 0, "reused": 0, "rows": 0, "unaligned_rows": {}, "missing_reference": []}
    for cell in done:
        if not cell.get("layers"):
            continue
        ref_id = (
            reference
            if reference and reference in by_id and by_id[reference].model == cell.model
            else cell.reference_cell_id
        )
        if ref_id == cell.cell_id or ref_id is None:
            continue
        ref_row = by_id.get(ref_id)
        if ref_row is None or not ref_row.get("layers"):
            out["missing_reference"].append(cell.cell_id)
            log(f"layers: {cell.cell_id}: its reference {ref_id} recorded no layer states; no layer metrics")
            continue
        _one(wh, cell, ref_id, force, out, log)
    return out


def _one(wh: Warehouse, cell: CellRow, ref_id: str, force: bool, out: dict, log) -> None:
    ref_pf = _open(wh, ref_id, 0)
    ref_groups, ref_digest = _groups(ref_pf)
    shards = {r: _open(wh, cell.cell_id, r) for r in sorted(wh.completed_repeats(cell.cell_id, "layer_states"))}
    indexed = {r: (pf, *_groups(pf)) for r, pf in shards.items()}  # repeat -> (file, groups, digest)
    key = hashlib.sha256(
        json.dumps(
            {
                "kernel": LAYER_KERNEL,
                "ref": ref_id,
                "ref_digest": ref_digest,
                "shards": {r: x[2] for r, x in indexed.items()},
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    meta = wh.table_meta("layer_metrics", cell.cell_id) or {}
    if not force and meta.get("key") == key:
        out["reused"] += 1
        out["cells"] += 1
        out["rows"] += meta.get("rows", 0)
        return
    tables, unaligned = [], 0
    for r, (pf, groups, _) in indexed.items():
        t, u = compare(cell, ref_id, r, (pf, groups), (ref_pf, ref_groups))
        tables.append(t)
        unaligned += u
    table = pa.concat_tables(tables)
    wh.write_table(
        "layer_metrics", cell.cell_id, table, {"key": key, "kernel_version": LAYER_KERNEL, "rows": table.num_rows}
    )
    out["cells"] += 1
    out["rows"] += table.num_rows
    if unaligned:
        out["unaligned_rows"][cell.cell_id] = unaligned
        log(f"layers: {cell.cell_id}: {unaligned} layer row(s) have no reference row (other layers or positions)")


def layer_table(wh: Warehouse, cell_id: str) -> tuple[list[dict[str, Any]], str]:
    """(per-layer summary of repeat 0, shallowest first, with the worst row of each gate; reference id)."""
    if not wh.has_rows("layer_metrics", cell_id):
        raise UserError(
            f"layers: no layer metrics for {cell_id} in {wh.where} (a cell with `layers:`, after `matrix analyze`)"
        )
    t = pq.read_table(
        wh.loc.path(f"layer_metrics/{cell_id}.parquet"), filesystem=wh.loc.fs, filters=[("repeat", "=", 0)]
    )
    d = t.to_pydict()
    per: dict[str, dict[str, list]] = {}
    keys: dict[str, list] = {}
    for i, layer in enumerate(d["layer"]):
        m = per.setdefault(layer, {k: [] for k in ("cosine", "norm_ratio", "rel_l2", "max_abs_diff", "allclose")})
        for k in m:
            m[k].append(d[k][i])
        keys.setdefault(layer, []).append((d["prompt_id"][i], d["position"][i]))
    arrays = {
        layer: {k: np.array(v, np.float64 if k != "allclose" else bool) for k, v in m.items()}
        for layer, m in per.items()
    }
    summary = [dict(row, layer_index=_index(row["layer"], d)) for row in _summaries(arrays, keys)]
    return summary, (d["reference_cell_id"][0] if d["cell_id"] else "")


def _summaries(arrays: dict, keys: dict) -> list[dict]:
    rows = []
    for layer in sorted(arrays, key=LM.depth):
        rows += LM.summarize({layer: arrays[layer]}, keys[layer])
    return rows


def _index(layer: str, d: dict) -> int:
    return next(d["layer_index"][i] for i, name in enumerate(d["layer"]) if name == layer)
