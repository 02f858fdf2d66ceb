"""`matrix analyze`'s decode part (issue 17 item 3; seed 000's KV-cache batch mismatch): each decode
row of a `decode:` cell against the same position's prefill row of the same cell (prefill/decode
consistency) and against the reference's prefill row there, into `decode_metrics/<cell_id>.parquet`.

A decode file is small (starts x steps x prompts rows), so it is read whole; the file is rewritten
only when its inputs changed (content key in its metadata, as the other analysis outputs)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from analysis import metrics as M
from store import Warehouse
from store.warehouse import logits_matrix

DECODE_KERNEL = f"decode-1+metrics-{M.KERNEL_VERSION}"


def _digest(wh: Warehouse, cell_id: str, repeat: int) -> str:
    """A decode file's content key part, from its row hashes alone (no logits read)."""
    hashes = wh.read_shard(cell_id, repeat, ["row_hash"], "decode").column("row_hash").to_pylist()
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


def _read(wh: Warehouse, cell_id: str, repeat: int) -> dict[str, Any]:
    """{"prefill" | "decode": {(prompt, position, step): row index}, "values": (rows, vocab) float32, "hash"}."""
    t = wh.read_shard(cell_id, repeat, ["prompt_id", "position", "step", "path", "row_hash", "logits"], "decode")
    d = t.select(["prompt_id", "position", "step", "path", "row_hash"]).to_pydict()
    out: dict[str, Any] = {"prefill": {}, "decode": {}, "hash": d["row_hash"],
                           "values": logits_matrix(t.column("logits"))}  # (rows, vocab) float32, exact
    for i, (p, q, s, path) in enumerate(zip(d["prompt_id"], d["position"], d["step"], d["path"])):
        out[path][(p, q, s)] = i
    return out


def _kl(ref: np.ndarray, stk: np.ndarray) -> dict[str, np.ndarray]:
    return M.row_metrics(ref, stk)


def compare(cell_id: str, ref_id: str | None, repeat: int, mine: dict, ref: dict | None) -> pa.Table:
    keys = sorted(mine["decode"])
    dec = np.array([mine["decode"][k] for k in keys], np.int64)
    pre = np.array([mine["prefill"][k] for k in keys], np.int64)
    v = mine["values"]
    own = _kl(v[pre], v[dec])  # KL(P_prefill || P_decode), same cell
    n = len(keys)
    kld, kld_pre, top1 = [None] * n, [None] * n, [None] * n  # null where the reference has no row
    if ref is not None:
        # the reference's prefill row at the same (prompt, position), whatever its decode steps were
        at = {(p, q): i for (p, q, _), i in ref["prefill"].items()}
        hit = [(j, at[(k[0], k[1])]) for j, k in enumerate(keys) if (k[0], k[1]) in at]
        if hit:
            j, r = np.array([h[0] for h in hit]), np.array([h[1] for h in hit])
            vs_dec, vs_pre = _kl(ref["values"][r], v[dec[j]]), _kl(ref["values"][r], v[pre[j]])
            for x, jj in enumerate(j):
                kld[jj], kld_pre[jj], top1[jj] = (float(vs_dec["kld"][x]), float(vs_pre["kld"][x]),
                                                  bool(vs_dec["top1_match"][x]))
    same = [mine["hash"][a] == mine["hash"][b] for a, b in zip(dec, pre)]
    return pa.table({
        "cell_id": [cell_id] * n, "reference_cell_id": [ref_id] * n, "prompt_id": [k[0] for k in keys],
        "position": pa.array([k[1] for k in keys], pa.int32()), "step": pa.array([k[2] for k in keys], pa.int32()),
        "repeat": pa.array([repeat] * n, pa.int32()),
        "kld_vs_prefill": pa.array(own["kld"], pa.float64()), "max_abs_diff_vs_prefill": pa.array(own["max_abs_diff"], pa.float64()),
        "top1_match_prefill": pa.array(own["top1_match"], pa.bool_()), "identical_to_prefill": pa.array(same, pa.bool_()),
        "kld": pa.array(kld, pa.float64()), "top1_match": pa.array(top1, pa.bool_()),
        "kld_prefill": pa.array(kld_pre, pa.float64()), "kernel_version": [DECODE_KERNEL] * n})


def analyze_decode(wh: Warehouse, done: list[dict], force: bool, log: Callable[[str], None]) -> dict[str, Any]:
    by_id = {c["cell_id"]: c for c in done}
    out = {"cells": 0, "reused": 0, "rows": 0, "no_reference_rows": []}
    for cell in done:
        if not cell.get("decode"):
            continue
        ref_id = cell.get("reference_cell_id")
        has_ref = bool(ref_id and (by_id.get(ref_id) or {}).get("decode"))
        if not has_ref:
            out["no_reference_rows"].append(cell["cell_id"])
            log(f"decode: {cell['cell_id']}: its reference {ref_id} recorded no decode file; "
                "decode rows are compared with this cell's own prefill only")
        repeats = sorted(wh.completed_repeats(cell["cell_id"], "decode"))
        key = hashlib.sha256(json.dumps({"kernel": DECODE_KERNEL, "ref": ref_id if has_ref else None,
                                         "ref_digest": _digest(wh, ref_id, 0) if has_ref else None,
                                         "shards": {r: _digest(wh, cell["cell_id"], r) for r in repeats}},
                                        sort_keys=True).encode()).hexdigest()
        meta = wh.table_meta("decode_metrics", cell["cell_id"]) or {}
        out["cells"] += 1
        if not force and meta.get("key") == key:
            out["reused"] += 1
            out["rows"] += meta.get("rows", 0)
            continue
        ref = _read(wh, ref_id, 0) if has_ref else None  # the logits only where something is computed
        table = pa.concat_tables([compare(cell["cell_id"], ref_id if has_ref else None, r, _read(wh, cell["cell_id"], r),
                                          ref) for r in repeats])
        wh.write_table("decode_metrics", cell["cell_id"], table,
                       {"key": key, "kernel_version": DECODE_KERNEL, "rows": table.num_rows})
        out["rows"] += table.num_rows
    return out
