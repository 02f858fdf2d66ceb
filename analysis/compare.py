"""One cell against its reference, streamed: prompt by prompt, a chunk of rows at a time.

Memory is two chunks of (rows, vocab) float32 (reference and stack) plus the metrics of the
cell's rows (a few dozen bytes each), whatever the prompts' length or the corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from analysis import metrics as M
from common.buffers import room
from common.errors import UserError
from store import Warehouse
from store.stream import Rows, Scratch, ShardIndex, shard_index
from store.verify import DamagedShard

MAX_CHUNK_ROWS = 256  # rows a chunk holds at most, however small the vocabulary
BUDGET_BYTES = 256 << 20  # float32 rows one unit holds at once (every side together)


def chunk_rows(sides: int, vocab: int, budget: int = BUDGET_BYTES) -> int:
    """Rows per chunk so `sides` shards' chunks (plus one read batch each) fit the budget."""
    return max(1, min(MAX_CHUNK_ROWS, budget // max(1, 2 * sides * vocab * 4)))


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
                out.append(
                    f"{'NOTE' if n else 'WARNING'} cell {cell_id} repeat {r}: {unaligned} of {rows} row(s) "
                    f"have no row of reference {ref_id} at the same (prompt, position), first {first}: "
                    "left out" + ("" if n else "; nothing to compare")
                )
            if nonfinite:
                out.append(
                    f"WARNING cell {cell_id} repeat {r}: {nonfinite} row(s) with NaN/Inf logits, first "
                    f"(prompt, position) {first_bad}: flagged (metrics.nonfinite), left out of every mean"
                )
        return out


def _nullable(v: np.ndarray, bad: np.ndarray) -> pa.Array:
    """NaN (a flagged row, a last position's delta_p, an undefined Spearman) -> SQL null."""
    if v.dtype == bool:
        return pa.array(v, mask=bad)
    return pa.array(v, mask=bad | np.isnan(v))


def _aligned(ref: ShardIndex, positions: np.ndarray, pid: str) -> tuple[np.ndarray, np.ndarray]:
    """(reference rows, stack rows) of prompt pid at the positions both have, in stack order
    (positions: the stack's positions of that prompt)."""
    rp = ref.prompts.get(pid)
    if rp is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    at = {int(q): i for i, q in enumerate(rp.positions)}
    si = np.array([i for i, q in enumerate(positions) if int(q) in at], np.int64)
    ri = np.array([at[int(positions[i])] for i in si], np.int64)
    return ri, si


class RepeatMetrics:
    """One stack repeat against the reference's repeat 0, fed one prompt at a time: from the
    stack's shard (`matrix analyze`), or from the rows just captured (in the capturing actor,
    `reference_metrics: in_actor`). Both feed the same rows (bf16 as stored, other dtypes widened),
    so the numbers are the same."""

    def __init__(
        self, wh: Warehouse, ref: ShardIndex, cell_id: str, repeat: int, vocab: int, budget: int = BUDGET_BYTES
    ):
        if vocab and ref.vocab and vocab != ref.vocab:
            raise UserError(
                f"cell {cell_id} has vocabulary {vocab}, reference {ref.cell_id} has "
                f"{ref.vocab}: they cannot be compared row for row"
            )
        self.wh, self.ref, self.cell_id, self.repeat = wh, ref, cell_id, repeat
        self.step = chunk_rows(2, vocab or 1, budget)
        self.cols: dict[str, list] = {k: [] for k in ("prompt_id", "position", "metrics")}
        self.unaligned, self.total, self.first = 0, 0, None
        self.scratch, self.out = Scratch(), None  # the reference's rows, read into the same memory prompt after prompt
        self.reader: tuple[str, Rows] | None = None  # the last prompt's reader: a streamed prompt comes in blocks

    def add(self, pid: str, positions: np.ndarray, take) -> None:
        """positions: (rows,) the stack's positions of prompt pid, in order; take(idx) -> those
        rows of the stack as (len(idx), vocab) float32 raw logits or stored bf16 rows (Bf16Rows),
        asked in ascending chunks."""
        self.total += len(positions)
        ri, si = _aligned(self.ref, positions, pid)
        if len(si) < len(positions):
            self.unaligned += len(positions) - len(si)
            if self.first is None:
                have = set(si.tolist())
                self.first = (pid, int(next(q for i, q in enumerate(positions) if i not in have)))
        if not len(si):
            return
        if self.reader is None or self.reader[0] != pid:  # a prompt's next block reads on from where the last ended
            self.reader = (pid, Rows(self.wh, self.ref, pid, self.step, self.scratch, stored=True))
        a, step = self.reader[1], self.step
        nxt = self.ref.prompts[pid].next_ids
        self.out = room(self.out, step * self.ref.vocab)
        for s in range(0, len(si), step):
            m = M.row_metrics(a.take(ri[s : s + step], self.out), take(si[s : s + step]), nxt[ri[s : s + step]])
            self.cols["metrics"].append(m)
            self.cols["prompt_id"] += [pid] * len(m["kld"])
            self.cols["position"] += np.asarray(positions)[si[s : s + step]].tolist()

    def result(self, floor: float) -> tuple[pa.Table, list]:
        """(metrics rows, counts as in CellResult)."""
        n, ms = len(self.cols["prompt_id"]), self.cols["metrics"]
        merged = {k: np.concatenate([m[k] for m in ms]) for k in ms[0]} if ms else {}
        nonfinite = merged.pop("nonfinite", np.array([], dtype=object))
        bad = np.array([v is not None for v in nonfinite], dtype=bool)
        table = pa.table(
            {
                "cell_id": [self.cell_id] * n,
                "reference_cell_id": [self.ref.cell_id] * n,
                "prompt_id": self.cols["prompt_id"],
                "position": pa.array(self.cols["position"], pa.int32()),
                "repeat": pa.array([self.repeat] * n, pa.int32()),
                **{k: _nullable(v, bad) for k, v in merged.items()},
                "storage_floor": pa.array(np.full(n, floor)),
                "nonfinite": pa.array(list(nonfinite), pa.string()),
                "kernel_version": [M.KERNEL_VERSION] * n,
            }
        )
        at = np.flatnonzero(bad)
        first_bad = f"{(self.cols['prompt_id'][at[0]], int(self.cols['position'][at[0]]))}" if len(at) else None
        return table, [
            self.unaligned,
            self.total,
            int(bad.sum()),
            None if self.first is None else f"{self.first}",
            first_bad,
        ]


def with_floor(table: pa.Table, floor: float) -> pa.Table:
    """The table with its storage_floor column set (an actor measures rows before the cell's
    floor, a mean over all its captures, is known)."""
    i = table.column_names.index("storage_floor")
    return table.set_column(i, "storage_floor", pa.array(np.full(table.num_rows, floor)))


def repeat_metrics(
    wh: Warehouse,
    ref: ShardIndex,
    stk: ShardIndex,
    floor: float,
    prompts: list[str] | None = None,
    budget: int = BUDGET_BYTES,
) -> tuple[pa.Table, list]:
    """Metrics of every row of one stack shard (of `prompts`, default all) that the reference's
    repeat 0 also has. Returns (rows, counts as in CellResult)."""
    acc = RepeatMetrics(wh, ref, stk.cell_id, stk.repeat, stk.vocab, budget)
    for pid, sp in stk.prompts.items():  # row-group order: the shard's own order
        if prompts is None or pid in prompts:
            acc.add(pid, sp.positions, Rows(wh, stk, pid, acc.step, stored=True).take)
    return acc.result(floor)


def cell_metrics(
    wh: Warehouse,
    cell_id: str,
    repeats: int,
    ref_id: str,
    floor: float,
    skip_damaged: bool,
    prompts: list[str] | None = None,
    budget: int = BUDGET_BYTES,
) -> CellResult:
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
