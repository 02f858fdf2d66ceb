"""`matrix analyze`: metrics of every stack against its reference and against the centroid of stacks.

Reads the warehouse's logits shards directly (Parquet, not through SQL: the
rows are full-vocab arrays) and writes three tables, one file per cell or
group, each rewritten atomically on every run:

    metrics/<cell_id>.parquet           every row of every repeat vs the reference's repeat 0
    centroid_metrics/<model>.parquet    repeat 0 of each stack vs the centroid of the group
    pairwise/<model>.parquet            mean JS and top-1 agreement of every pair of stacks
    metrics_ranges/ranges.parquet       the position buckets the summary views use
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import metrics as M
from matrix.errors import UserError
from store import Warehouse
from store.warehouse import logits_matrix

DEFAULT_RANGES = (0, 512, 2048, 8192)
CHUNK = 32  # rows per metric batch: (32, 151936) float64 is ~39 MB


@dataclass
class Shard:
    cell_id: str
    keys: dict[tuple[str, int], int]  # (prompt_id, position) -> row
    logits: np.ndarray  # (rows, vocab) float32
    next_ids: np.ndarray  # (rows,) int, -1 where there is no next token
    prompt_ids: list[str]
    positions: list[int]


def read_shard(wh: Warehouse, cell_id: str, repeat: int) -> Shard:
    path = wh.shard_path(cell_id, repeat)
    t = pq.read_table(path, columns=["prompt_id", "position", "next_token_id", "logits"])
    try:
        logits = logits_matrix(t.column("logits"))  # (rows, vocab)
    except ValueError as e:
        raise UserError(f"{path}: {e} in one shard") from None
    bad = ~np.isfinite(logits).all(-1)
    prompts, positions = t.column("prompt_id").to_pylist(), t.column("position").to_pylist()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UserError(f"{path}: {int(bad.sum())} row(s) with NaN/Inf logits, first at prompt "
                        f"{prompts[i]} position {positions[i]}; refusing to average them in")
    nxt = np.array([-1 if v is None else v for v in t.column("next_token_id").to_pylist()], dtype=np.int64)
    keys = {(p, q): i for i, (p, q) in enumerate(zip(prompts, positions))}
    return Shard(cell_id, keys, logits, nxt, prompts, positions)


def _align(ref: Shard, stk: Shard) -> tuple[np.ndarray, np.ndarray]:
    missing = [k for k in stk.keys if k not in ref.keys]
    if missing:
        raise UserError(f"cell {stk.cell_id}: {len(missing)} row(s) have no reference row at the same "
                        f"(prompt, position), first {missing[0]} (reference {ref.cell_id}); positions do not line up")
    si = np.arange(len(stk.positions))
    ri = np.array([ref.keys[(p, q)] for p, q in zip(stk.prompt_ids, stk.positions)], dtype=np.int64)
    return ri, si


def compare(ref: Shard, stk: Shard) -> dict[str, np.ndarray]:
    if ref.logits.shape[1] != stk.logits.shape[1]:
        raise UserError(f"cell {stk.cell_id} has vocabulary {stk.logits.shape[1]}, reference {ref.cell_id} has "
                        f"{ref.logits.shape[1]}: they cannot be compared row for row")
    ri, si = _align(ref, stk)
    parts = []
    for s in range(0, len(si), CHUNK):
        r, k = ri[s:s + CHUNK], si[s:s + CHUNK]
        parts.append(M.row_metrics(ref.logits[r], stk.logits[k], ref.next_ids[r]))
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}
    out["_rows"] = si
    return out


def analyze(warehouse: str, reference: str | None = None, ranges=DEFAULT_RANGES, centroid: str = "mean_prob",
            log: Callable[[str], None] = print) -> dict:
    wh = Warehouse(warehouse).require()
    with wh.lock():  # one writer at a time: a run in progress would change the cells under us
        wh.migrate(log)
        return _analyze(wh, reference, ranges, centroid, log)


def _analyze(wh: Warehouse, reference: str | None, ranges, centroid: str, log: Callable[[str], None]) -> dict:
    cells = pq.read_table(wh.table_files("cells")).to_pylist() if wh.table_files("cells") else []
    done = [c for c in cells if c["status"] == "done"]
    if not done:
        raise UserError(f"{wh.root}: no captured cells to analyze (the warehouse has no logits)")
    by_id = {c["cell_id"]: c for c in done}
    if reference is not None and reference not in by_id:
        raise UserError(f"--reference {reference}: no captured cell with that id in {wh.root}")
    t0, rows_done = time.perf_counter(), 0
    summary = {"cells": 0, "metric_rows": 0, "groups": 0}
    for model in sorted({c["model"] for c in done}):
        group = sorted((c for c in done if c["model"] == model), key=lambda c: c["cell_id"])
        ref_id = reference if reference and by_id[reference]["model"] == model else \
            next((c["reference_cell_id"] for c in group if c.get("reference_cell_id") in by_id), None)
        if ref_id is None:
            log(f"{model}: no reference cell captured; skipping the reference metrics")
            continue
        ref0 = read_shard(wh, ref_id, 0)
        shards0 = {ref_id: ref0}
        for i, c in enumerate(group, 1):
            tables = []
            for r in range(c["repeats"]):
                stk = ref0 if (c["cell_id"] == ref_id and r == 0) else read_shard(wh, c["cell_id"], r)
                if r == 0:
                    shards0[c["cell_id"]] = stk
                m = compare(ref0, stk)
                rows = m.pop("_rows")
                tables.append(pa.table({
                    "cell_id": [c["cell_id"]] * len(rows), "reference_cell_id": [ref_id] * len(rows),
                    "prompt_id": [stk.prompt_ids[j] for j in rows],
                    "position": pa.array([stk.positions[j] for j in rows], pa.int32()),
                    "repeat": pa.array([r] * len(rows), pa.int32()),
                    **{k: pa.array(v) for k, v in m.items()},
                    # the warehouse stores native values exactly (widened): nothing is lost
                    "storage_floor": pa.array(np.zeros(len(rows))),
                }))
                rows_done += len(rows)
            wh.write_table("metrics", c["cell_id"], pa.concat_tables(tables))
            rate = rows_done / max(time.perf_counter() - t0, 1e-9)
            log(f"[{model} {i}/{len(group)}] {c['cell_id']}: {sum(len(t) for t in tables)} rows "
                f"| {rows_done} rows | {rate:.0f} rows/s")
            summary["cells"] += 1
        cent, pair = centroid_tables(shards0, ref_id, centroid)
        wh.write_table("centroid_metrics", model, cent)
        wh.write_table("pairwise", model, pair)
        summary["groups"] += 1
    edges = list(ranges)
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    wh.write_table("metrics_ranges", "ranges", pa.table({
        "lo": pa.array(edges, pa.int32()), "hi": pa.array(edges[1:] + [2**31 - 1], pa.int32()), "range": labels}))
    summary["metric_rows"] = rows_done
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary


def centroid_tables(shards: dict[str, Shard], ref_id: str, how: str) -> tuple[pa.Table, pa.Table]:
    """Per (prompt, position): the centroid of the stacks that captured that row.

    mean_prob: normalised mean of probabilities; mean_logprob: normalised geometric mean.
    (A prefix-only stack joins the centroid only where it has rows; n_stacks says how many did.)"""
    ids = sorted(shards)
    keys = sorted(set().union(*(s.keys for s in shards.values())))
    cols = {k: [] for k in ("cell_id", "prompt_id", "position", "n_stacks", "kld_centroid_stack",
                            "kld_stack_centroid", "js_centroid")}
    for key in keys:
        present = [c for c in ids if key in shards[c].keys]
        rows = np.stack([shards[c].logits[shards[c].keys[key]] for c in present])  # (stacks, vocab)
        lps = M.log_softmax64(rows)
        if len(present) == 1:
            lc = lps[:1]  # the centroid of one stack is that stack, exactly
        elif how == "mean_logprob":
            lc = M.log_softmax64(lps.mean(0, keepdims=True))
        else:
            mp = np.exp(lps).mean(0, keepdims=True)
            lc = np.log(mp / mp.sum())
        lcs = np.repeat(lc, len(present), 0)  # (stacks, vocab)
        a, b, j = M.kl(lcs, lps), M.kl(lps, lcs), M.js(lcs, lps)
        same = (lps == lcs).all(-1)
        a[same] = b[same] = j[same] = 0.0
        cols["cell_id"] += present
        cols["prompt_id"] += [key[0]] * len(present)
        cols["position"] += [key[1]] * len(present)
        cols["n_stacks"] += [len(present)] * len(present)
        cols["kld_centroid_stack"] += a.tolist()
        cols["kld_stack_centroid"] += b.tolist()
        cols["js_centroid"] += j.tolist()
    cent = pa.table({**cols, "centroid": [how] * len(cols["cell_id"]),
                     "is_reference": [c == ref_id for c in cols["cell_id"]]})
    pairs = {k: [] for k in ("cell_a", "cell_b", "rows", "mean_js", "top1_agreement")}
    for a, b in itertools.combinations(ids, 2):
        both = sorted(set(shards[a].keys) & set(shards[b].keys))
        ra = shards[a].logits[[shards[a].keys[k] for k in both]]
        rb = shards[b].logits[[shards[b].keys[k] for k in both]]
        jsv = np.concatenate([M.js(M.log_softmax64(ra[s:s + CHUNK]), M.log_softmax64(rb[s:s + CHUNK]))
                              for s in range(0, len(both), CHUNK)]) if both else np.array([])
        jsv[(ra == rb).all(-1)] = 0.0
        pairs["cell_a"].append(a)
        pairs["cell_b"].append(b)
        pairs["rows"].append(len(both))
        pairs["mean_js"].append(float(jsv.mean()) if len(jsv) else None)
        pairs["top1_agreement"].append(float((ra.argmax(-1) == rb.argmax(-1)).mean()) if len(both) else None)
    return cent, pa.table(pairs)
