"""One cell against its reference, streamed: prompt by prompt, a chunk of rows at a time.

Memory is two chunks of (rows, vocab) float32 (reference and stack) plus the metrics of the
cell's rows (a few dozen bytes each), whatever the prompts' length or the corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from analysis import metrics as M
from common.errors import UserError
from store import Warehouse
from store.stream import Rows, ShardIndex, shard_index
from store.verify import DamagedShard

BUDGET_BYTES = 256 << 20  # float32 rows one unit holds at once (every side together)


def chunk_rows(sides: int, vocab: int, budget: int = BUDGET_BYTES) -> int:
    """Rows per chunk so `sides` shards' chunks (plus one read batch each) fit the budget."""
    return max(1, min(M.ROWS * 4, budget // max(1, 2 * sides * vocab * 4)))


@dataclass
class CellResult:
    """One cell's metrics over some of its prompts (a piece), or all of them once merged: small,
    whatever the corpus. Per repeat: its metrics table and [unaligned, rows, NaN/Inf rows, first
    unaligned, first NaN/Inf] (the firsts as (prompt, position) text)."""
    tables: dict[int, pa.Table] = field(default_factory=dict)
    counts: dict[int, list] = field(default_factory=dict)
    damaged: dict[int, str] = field(default_factory=dict)  # repeat -> why: that repeat is left out whole

    @staticmethod
    def merge(parts: list["CellResult"]) -> "CellResult":
        """The pieces of one cell, in prompt order; a repeat damaged in any piece goes from all."""
        out = CellResult()
        for p in parts:
            for r, why in p.damaged.items():
                out.damaged.setdefault(r, why)
        for p in parts:
            for r, t in p.tables.items():
                if r in out.damaged:
                    continue
                out.tables[r] = pa.concat_tables([out.tables[r], t]) if r in out.tables else t
                c, n = out.counts.setdefault(r, [0, 0, 0, None, None]), p.counts[r]
                c[0], c[1], c[2] = c[0] + n[0], c[1] + n[1], c[2] + n[2]
                c[3], c[4] = c[3] or n[3], c[4] or n[4]
        return out

    @property
    def table(self) -> pa.Table | None:
        ts = [self.tables[r] for r in sorted(self.tables) if len(self.tables[r])]
        return pa.concat_tables(ts) if ts else None

    @property
    def unaligned(self) -> int:
        return max((c[0] for c in self.counts.values()), default=0)

    @property
    def nonfinite_rows(self) -> int:
        return sum(c[2] for c in self.counts.values())

    def notes(self, cell_id: str, ref_id: str) -> list[str]:
        out = [f"SKIPPED (damaged) {why.split('; run')[0]}" for _, why in sorted(self.damaged.items())]
        for r, (unaligned, rows, nonfinite, first, first_bad) in sorted(self.counts.items()):
            n = len(self.tables[r])
            if unaligned:
                out.append(f"{'NOTE' if n else 'WARNING'} cell {cell_id} repeat {r}: {unaligned} of {rows} row(s) "
                           f"have no row of reference {ref_id} at the same (prompt, position), first {first}: "
                           "left out" + ("" if n else "; nothing to compare"))
            if nonfinite:
                out.append(f"WARNING cell {cell_id} repeat {r}: {nonfinite} row(s) with NaN/Inf logits, first "
                           f"(prompt, position) {first_bad}: flagged (metrics.nonfinite), left out of every mean")
        return out


def _nullable(v: np.ndarray, bad: np.ndarray) -> pa.Array:
    """NaN (a flagged row, a last position's delta_p, an undefined Spearman) -> SQL null."""
    if v.dtype == bool:
        return pa.array(v, mask=bad)
    return pa.array(v, mask=bad | np.isnan(v))


def _aligned(ref: ShardIndex, stk: ShardIndex, pid: str) -> tuple[np.ndarray, np.ndarray]:
    """(reference rows, stack rows) of prompt pid at the positions both have, in stack order."""
    rp = ref.prompts.get(pid)
    if rp is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    at = {int(q): i for i, q in enumerate(rp.positions)}
    si = np.array([i for i, q in enumerate(stk.prompts[pid].positions) if int(q) in at], np.int64)
    ri = np.array([at[int(stk.prompts[pid].positions[i])] for i in si], np.int64)
    return ri, si


def repeat_metrics(wh: Warehouse, ref: ShardIndex, stk: ShardIndex, floor: float, prompts: list[str] | None = None,
                   budget: int = BUDGET_BYTES) -> tuple[pa.Table, list]:
    """Metrics of every row of one stack shard (of `prompts`, default all) that the reference's
    repeat 0 also has. Returns (rows, counts as in CellResult)."""
    if stk.vocab and ref.vocab and stk.vocab != ref.vocab:
        raise UserError(f"cell {stk.cell_id} has vocabulary {stk.vocab}, reference {ref.cell_id} has "
                        f"{ref.vocab}: they cannot be compared row for row")
    step = chunk_rows(2, stk.vocab or 1, budget)
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "position", "metrics")}
    unaligned, total, first = 0, 0, None
    for pid, sp in stk.prompts.items():  # row-group order: the shard's own order
        if prompts is not None and pid not in prompts:
            continue
        total += len(sp.positions)
        ri, si = _aligned(ref, stk, pid)
        if len(si) < len(sp.positions):
            unaligned += len(sp.positions) - len(si)
            if first is None:
                have = set(si.tolist())
                first = (pid, int(next(q for i, q in enumerate(sp.positions) if i not in have)))
        if not len(si):
            continue
        a, b = Rows(wh, ref, pid, step), Rows(wh, stk, pid, step)
        for s in range(0, len(si), step):
            m = M.row_metrics(a.take(ri[s:s + step]), b.take(si[s:s + step]), ref.prompts[pid].next_ids[ri[s:s + step]])
            cols["metrics"].append(m)
            cols["prompt_id"] += [pid] * len(m["kld"])
            cols["position"] += sp.positions[si[s:s + step]].tolist()
    n = len(cols["prompt_id"])
    ms = cols["metrics"]
    merged = {k: np.concatenate([m[k] for m in ms]) for k in ms[0]} if ms else {}
    nonfinite = merged.pop("nonfinite", np.array([], dtype=object))
    bad = np.array([v is not None for v in nonfinite], dtype=bool)
    table = pa.table({
        "cell_id": [stk.cell_id] * n, "reference_cell_id": [ref.cell_id] * n, "prompt_id": cols["prompt_id"],
        "position": pa.array(cols["position"], pa.int32()), "repeat": pa.array([stk.repeat] * n, pa.int32()),
        **{k: _nullable(v, bad) for k, v in merged.items()},
        "storage_floor": pa.array(np.full(n, floor)),
        "nonfinite": pa.array(list(nonfinite), pa.string()),
        "kernel_version": [M.KERNEL_VERSION] * n,
    })
    at = np.flatnonzero(bad)
    first_bad = f"{(cols['prompt_id'][at[0]], int(cols['position'][at[0]]))}" if len(at) else None
    return table, [unaligned, total, int(bad.sum()), None if first is None else f"{first}", first_bad]


def cell_metrics(wh: Warehouse, cell_id: str, repeats: int, ref_id: str, floor: float, skip_damaged: bool,
                 prompts: list[str] | None = None, budget: int = BUDGET_BYTES) -> CellResult:
    """metrics rows of every repeat of one cell (of `prompts`, default all) against the reference's repeat 0
    (the reference's own repeats 1.. give its repeat-to-repeat noise; its repeat 0 is the yardstick itself)."""
    out = CellResult()
    ref = shard_index(wh, ref_id, 0)
    only = None if prompts is None else set(prompts)
    for r in range(repeats):
        if cell_id == ref_id and r == 0:  # the reference against itself: zeros by definition, not measured
            continue
        try:
            stk = shard_index(wh, cell_id, r)
            out.tables[r], out.counts[r] = repeat_metrics(wh, ref, stk, floor, only, budget)
        except DamagedShard as e:
            if not skip_damaged:
                raise
            out.damaged[r] = str(e)
    return out
