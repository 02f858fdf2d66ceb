"""The oracle: a `matrix analyze` that holds every shard whole in
memory. tests/test_analysis_stream.py checks the streaming analysis against it, column by column.

Reads the warehouse's logits shards directly (Parquet, not through SQL: the
rows are full-vocab arrays) and writes three tables, one file per cell or
group, each rewritten atomically on every run:

    metrics/<cell_id>.parquet                 every row of every repeat vs the reference's repeat 0
    centroid_metrics/<model>.<group>.parquet  repeat 0 of each stack vs the centroid of its group
    pairwise/<model>.<group>.parquet          mean JS and top-1 agreement of every pair of stacks
    metrics_ranges/ranges.parquet             the position buckets the summary views use

A row with NaN/Inf logits is flagged (metrics.nonfinite, centroid_metrics.nonfinite), its
metrics are null and it stays out of every centroid and mean; analyze says so per cell.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from analysis import metrics as M
from analysis.analyze import _write_ranges  # the ranges table is not what the oracle checks
from common.errors import UserError, first_line
from store import Warehouse
from store.verify import DamagedShard, check_rows
from store.warehouse import logits_matrix

SEE_VERIFY = "run `matrix verify`, or `matrix analyze --skip-damaged` to leave it out"

DEFAULT_RANGES = (0, 512, 2048, 8192)
CHUNK = 256  # rows per metrics call: (256, 151936) float32 is ~155 MB per side


@dataclass
class Shard:
    cell_id: str
    keys: dict[tuple[str, int], int]  # (prompt_id, position) -> row
    logits: np.ndarray  # (rows, vocab) float32
    next_ids: np.ndarray  # (rows,) int, -1 where there is no next token
    prompt_ids: list[str]
    positions: list[int]
    finite: np.ndarray | None = None  # (rows,) bool: no NaN/Inf in the row

    def __post_init__(self):
        if self.finite is None:
            self.finite = np.isfinite(self.logits).all(-1)


def read_shard(wh: Warehouse, cell_id: str, repeat: int) -> Shard:
    """One shard, refused (DamagedShard) when it does not parse or a row is not what its hash says."""
    path = wh.shard_path(cell_id, repeat)
    try:
        t = wh.read_shard(
            cell_id, repeat, ["prompt_id", "position", "next_token_id", "logits", "logits_dtype", "row_hash"]
        )
    except (OSError, pa.ArrowException) as e:
        raise DamagedShard(f"{path}: damaged ({first_line(str(e), type(e).__name__)}); {SEE_VERIFY}") from None
    try:
        logits = logits_matrix(t.column("logits"))  # (rows, vocab), decoded once: checked and used
    except ValueError as e:
        raise UserError(f"{path}: {e} in one shard") from None
    bad = check_rows(t, path, cell_id, repeat, logits)
    if bad:
        raise DamagedShard(
            f"{path}: {len(bad)} row(s) damaged, first prompt {bad[0].prompt_id} position "
            f"{bad[0].position}: {bad[0].what}; {SEE_VERIFY}"
        )
    prompts, positions = t.column("prompt_id").to_pylist(), t.column("position").to_pylist()
    nxt = np.array([-1 if v is None else v for v in t.column("next_token_id").to_pylist()], dtype=np.int64)
    keys = {(p, q): i for i, (p, q) in enumerate(zip(prompts, positions))}
    return Shard(cell_id, keys, logits, nxt, prompts, positions)


def _align(ref: Shard, stk: Shard) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the stack that the reference also has, as (reference rows, stack rows)."""
    si = np.array([i for i, k in enumerate(zip(stk.prompt_ids, stk.positions)) if k in ref.keys], dtype=np.int64)
    ri = np.array([ref.keys[(stk.prompt_ids[i], stk.positions[i])] for i in si], dtype=np.int64)
    return ri, si


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rows idx of a: a view when they are consecutive (the usual case), else a copy."""
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and (np.diff(idx) == 1).all():
        return a[idx[0] : idx[-1] + 1]
    return a[idx]


def compare(ref: Shard, stk: Shard) -> dict[str, np.ndarray]:
    """Metrics of every stack row that has a reference row at the same (prompt, position)."""
    if ref.logits.shape[1] != stk.logits.shape[1]:
        raise UserError(
            f"cell {stk.cell_id} has vocabulary {stk.logits.shape[1]}, reference {ref.cell_id} has "
            f"{ref.logits.shape[1]}: they cannot be compared row for row"
        )
    ri, si = _align(ref, stk)
    parts = [
        M.row_metrics(
            _take(ref.logits, ri[s : s + CHUNK]), _take(stk.logits, si[s : s + CHUNK]), ref.next_ids[ri[s : s + CHUNK]]
        )
        for s in range(0, len(si), CHUNK)
    ]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}
    out["_rows"] = si
    return out


def _nullable(v: np.ndarray, bad: np.ndarray) -> pa.Array:
    """NaN (a flagged row, a last position's delta_p, an undefined Spearman) -> SQL null."""
    if v.dtype == bool:
        return pa.array(v, mask=bad)
    return pa.array(v, mask=bad | np.isnan(v))


def _warn_nonfinite(log, cell_id: str, repeat: int, shard: Shard) -> None:
    bad = np.flatnonzero(~shard.finite)
    if len(bad):
        i = int(bad[0])
        log(
            f"WARNING cell {cell_id} repeat {repeat}: {len(bad)} row(s) with NaN/Inf logits, first at prompt "
            f"{shard.prompt_ids[i]} position {shard.positions[i]}: flagged (metrics.nonfinite), left out of every mean"
        )


def _floor(cell: dict) -> float:
    """KL between what the engine produced and what the warehouse holds: 0 for captured cells
    (stored exactly); an imported lossy file records its own estimate."""
    return float(json.loads(cell.get("settings") or "{}").get("storage_floor") or 0.0)


def analyze(
    warehouse: str,
    reference: str | None = None,
    ranges=DEFAULT_RANGES,
    centroid: str | None = None,
    log: Callable[[str], None] = print,
    skip_damaged: bool = False,
) -> dict:
    wh = Warehouse(warehouse).require()
    with wh.lock():  # one writer at a time: a run in progress would change the cells under us
        wh.migrate(log)
        return _analyze(wh, reference, ranges, centroid, log, skip_damaged)


def _read_or_skip(wh: Warehouse, cell_id: str, repeat: int, summary: dict, log: Callable[[str], None]) -> Shard | None:
    """The shard, or None when it is damaged and --skip-damaged says to leave it out."""
    try:
        return read_shard(wh, cell_id, repeat)
    except DamagedShard as e:
        if not summary["skip_damaged"]:
            raise
        summary["damaged"].append(str(e))
        log(f"SKIPPED (damaged) {str(e).split('; run')[0]}")
        return None


@dataclass
class Progress:
    """Rows compared so far, of how many, since when (for the per-cell progress line)."""

    total: int
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.t0, 1e-9)


def _repeat_table(
    ref0: Shard, stk: Shard, c: dict, r: int, ref_id: str, ref_floor: float, summary: dict, log: Callable[[str], None]
) -> pa.Table:
    """The metrics rows of one repeat of one cell against the reference's repeat 0."""
    _warn_nonfinite(log, c["cell_id"], r, stk)
    m = compare(ref0, stk)
    rows = m.pop("_rows")
    if len(rows) < len(stk.positions):
        k = next(k for k in zip(stk.prompt_ids, stk.positions) if k not in ref0.keys)
        summary["unaligned_rows"][c["cell_id"]] = len(stk.positions) - len(rows)
        log(
            f"{'NOTE' if len(rows) else 'WARNING'} cell {c['cell_id']} repeat {r}: "
            f"{len(stk.positions) - len(rows)} of {len(stk.positions)} row(s) have no row of reference "
            f"{ref_id} at the same (prompt, position), first {k}: left out"
            + ("" if len(rows) else "; nothing to compare")
        )
    nonfinite = m.pop("nonfinite")
    bad = np.array([v is not None for v in nonfinite], dtype=bool)
    summary["nonfinite_rows"] += int(bad.sum())
    return pa.table(
        {
            "cell_id": [c["cell_id"]] * len(rows),
            "reference_cell_id": [ref_id] * len(rows),
            "prompt_id": [stk.prompt_ids[j] for j in rows],
            "position": pa.array([stk.positions[j] for j in rows], pa.int32()),
            "repeat": pa.array([r] * len(rows), pa.int32()),
            **{k: _nullable(v, bad) for k, v in m.items()},
            # native values are stored exactly (0); an imported lossy format has its own floor
            "storage_floor": pa.array(np.full(len(rows), ref_floor + _floor(c))),
            "nonfinite": pa.array(list(nonfinite), pa.string()),
        }
    )


def _reference_metrics(
    wh: Warehouse,
    model: str,
    group: list[dict],
    ref_id: str,
    by_id: dict,
    summary: dict,
    progress: Progress,
    log: Callable[[str], None],
) -> dict[str, Shard]:
    """metrics/<cell>.parquet for every cell of a model; returns each cell's repeat-0 shard."""
    ref0 = _read_or_skip(wh, ref_id, 0, summary, log)
    if ref0 is None:
        log(f"{model}: its reference {ref_id} is damaged; no metrics for this model")
        return {}
    shards0 = {ref_id: ref0}
    for i, c in enumerate(group, 1):
        tables = []
        for r in range(c["repeats"]):
            stk = ref0 if (c["cell_id"] == ref_id and r == 0) else _read_or_skip(wh, c["cell_id"], r, summary, log)
            if stk is None:
                continue
            if r == 0:
                shards0[c["cell_id"]] = stk
            tables.append(_repeat_table(ref0, stk, c, r, ref_id, _floor(by_id[ref_id]), summary, log))
            progress.done += len(tables[-1])
        if not any(len(t) for t in tables):
            wh.remove_table("metrics", c["cell_id"])  # not a stale result from an earlier analysis
            continue
        wh.write_table("metrics", c["cell_id"], pa.concat_tables(tables))
        log(
            f"[{model} {i}/{len(group)}] {c['cell_id']}: {sum(len(t) for t in tables)} rows "
            f"| {progress.done}/{progress.total} rows | {progress.rate():.0f} rows/s"
        )
        summary["cells"] += 1
    return shards0


def _centroids(
    wh: Warehouse,
    model: str,
    group: list[dict],
    shards0: dict[str, Shard],
    ref_id: str,
    centroid: str,
    summary: dict,
    log: Callable[[str], None],
) -> None:
    groups: dict[str, list[str]] = {}
    for c in group:
        if c.get("replica"):  # another host's copy of a stack: it would weigh that stack twice
            continue
        groups.setdefault(c.get("centroid_group") or model, []).append(c["cell_id"])
    for gname, ids in sorted(groups.items()):
        ids = [cid for cid in ids if cid in shards0]  # a damaged repeat 0 left out (--skip-damaged)
        if not ids:
            continue
        cent, pair = centroid_tables({cid: shards0[cid] for cid in ids}, ref_id, centroid, gname)
        name = model if gname == model else f"{model}.{gname}"
        wh.write_table("centroid_metrics", name, cent)
        wh.write_table("pairwise", name, pair)
        log(f"[{model}] centroid group {gname}: {len(ids)} stack(s), {cent.num_rows} rows, {pair.num_rows} pair(s)")
        summary["groups"] += 1


def _analyze(
    wh: Warehouse,
    reference: str | None,
    ranges,
    centroid: str | None,
    log: Callable[[str], None],
    skip_damaged: bool = False,
) -> dict:
    done = [c for c in wh.read_all("cells") if c["status"] == "done"]
    if not done:
        raise UserError(f"{wh.where}: no captured cells to analyze (the warehouse has no logits)")
    by_id = {c["cell_id"]: c for c in done}
    if reference is not None and reference not in by_id:
        raise UserError(f"--reference {reference}: no captured cell with that id in {wh.where}")
    if centroid is None:
        asked = {c.get("centroid") for c in done} - {None}
        centroid = asked.pop() if len(asked) == 1 else "mean_prob"
    log(f"metrics kernel: {M.kernel_mode()} (float64)")
    progress = Progress(sum(c["repeats"] * (c["rows_per_repeat"] or 0) for c in done))
    summary = {
        "cells": 0,
        "metric_rows": 0,
        "groups": 0,
        "nonfinite_rows": 0,
        "centroid": centroid,
        "unaligned_rows": {},
        "skip_damaged": skip_damaged,
        "damaged": [],
    }
    for model in sorted({c["model"] for c in done}):
        group = sorted((c for c in done if c["model"] == model), key=lambda c: c["cell_id"])
        # several engine builds of the reference stack: the newest capture is the model's reference
        refs = {c["reference_cell_id"] for c in group if c.get("reference_cell_id") in by_id}
        ref_id = (
            reference
            if reference and by_id[reference]["model"] == model
            else max(refs, key=lambda r: (by_id[r]["finished_at"], r))
            if refs
            else None
        )
        if ref_id is None:
            log(f"{model}: no reference cell captured; skipping the reference metrics")
            continue
        shards0 = _reference_metrics(wh, model, group, ref_id, by_id, summary, progress, log)
        _centroids(wh, model, group, shards0, ref_id, centroid, summary, log)
    _write_ranges(wh, ranges)
    summary["metric_rows"] = progress.done
    summary["seconds"] = round(time.perf_counter() - progress.t0, 2)
    return summary


def centroid_tables(
    shards: dict[str, Shard], ref_id: str, how: str, group: str | None = None
) -> tuple[pa.Table, pa.Table]:
    """Per (prompt, position): the centroid of the stacks that captured that row.

    mean_prob: normalised mean of probabilities; mean_logprob: normalised geometric mean.
    (A prefix-only stack joins the centroid only where it has rows, a NaN/Inf row not at all;
    n_stacks says how many did.)"""
    ids = sorted(shards)
    keys = sorted(set().union(*(s.keys for s in shards.values())))
    cols = {
        k: []
        for k in (
            "cell_id",
            "prompt_id",
            "position",
            "n_stacks",
            "kld_centroid_stack",
            "kld_stack_centroid",
            "js_centroid",
            "nonfinite",
        )
    }
    pend_c, pend_s, pend_exact = [], [], []

    def flush():
        if not pend_c:
            return
        m = M.row_metrics(np.concatenate(pend_c), np.concatenate(pend_s))
        exact = np.concatenate(pend_exact)
        for src, dst in (("kld", "kld_centroid_stack"), ("kld_reverse", "kld_stack_centroid"), ("js", "js_centroid")):
            v = m[src]
            v[exact] = 0.0
            cols[dst] += v.tolist()
        pend_c.clear(), pend_s.clear(), pend_exact.clear()

    for key in keys:
        present = [c for c in ids if key in shards[c].keys]
        fin = [c for c in present if shards[c].finite[shards[c].keys[key]]]
        for c in present:
            if c not in fin:  # a flagged row: recorded, measured against nothing
                flush()
                cols["cell_id"].append(c), cols["prompt_id"].append(key[0]), cols["position"].append(key[1])
                cols["n_stacks"].append(len(fin)), cols["nonfinite"].append(True)
                for k in ("kld_centroid_stack", "kld_stack_centroid", "js_centroid"):
                    cols[k].append(None)
        if not fin:
            continue
        rows = np.stack([shards[c].logits[shards[c].keys[key]] for c in fin])  # (stacks, vocab)
        lps = torch.log_softmax(torch.from_numpy(rows).double(), -1)  # (stacks, vocab)
        if how == "mean_logprob":
            lc = torch.log_softmax(lps.mean(0), -1)
        else:
            lc = torch.logsumexp(lps, 0) - np.log(len(fin))  # log of the mean probability
        same = bool((rows == rows[:1]).all())  # one stack, or all identical: the centroid is that stack
        pend_c.append(np.repeat(lc.numpy()[None], len(fin), 0))
        pend_s.append(rows.astype(np.float64))
        pend_exact.append(np.full(len(fin), same))
        cols["cell_id"] += fin
        cols["prompt_id"] += [key[0]] * len(fin)
        cols["position"] += [key[1]] * len(fin)
        cols["n_stacks"] += [len(fin)] * len(fin)
        cols["nonfinite"] += [False] * len(fin)
        if sum(len(x) for x in pend_c) >= 64:
            flush()
    flush()
    n = len(cols["cell_id"])
    cent = pa.table(
        {
            **cols,
            "centroid": [how] * n,
            "is_reference": [c == ref_id for c in cols["cell_id"]],
            "centroid_group": [group] * n,
        }
    )
    return cent, pairwise_table(shards)


def pairwise_table(shards: dict[str, Shard]) -> pa.Table:
    """Mean JS and top-1 agreement of every pair of stacks, over the rows both have (finite)."""
    ids = sorted(shards)
    pairs = {k: [] for k in ("cell_a", "cell_b", "rows", "mean_js", "top1_agreement")}
    for a, b in itertools.combinations(ids, 2):
        sa, sb = shards[a], shards[b]
        both = sorted(k for k in set(sa.keys) & set(sb.keys) if sa.finite[sa.keys[k]] and sb.finite[sb.keys[k]])
        ia = np.array([sa.keys[k] for k in both], dtype=np.int64)
        ib = np.array([sb.keys[k] for k in both], dtype=np.int64)
        jsv, top1 = [], []
        for s in range(0, len(both), CHUNK):
            m = M.row_metrics(sa.logits[ia[s : s + CHUNK]], sb.logits[ib[s : s + CHUNK]])
            jsv.append(m["js"]), top1.append(m["top1_match"])
        pairs["cell_a"].append(a)
        pairs["cell_b"].append(b)
        pairs["rows"].append(len(both))
        pairs["mean_js"].append(float(np.concatenate(jsv).mean()) if both else None)
        pairs["top1_agreement"].append(float(np.concatenate(top1).mean()) if both else None)
    return pa.table(pairs)
