"""The stacks of one centroid group against their centroid, and every pair of them, streamed.

Per (prompt, position) the centroid is made of the stacks that captured that row (finite):
    mean_prob:    log of the normalised mean of probabilities
    mean_logprob: normalised geometric mean (mean of log-probabilities, renormalised)
A prefix-only stack joins only where it has rows; a NaN/Inf row joins nothing (n_stacks says
how many did). Pairwise JS and top-1 agreement are sums and counts per pair, so a group is
read one chunk of positions at a time: memory is members x chunk x vocab.
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa

from analysis import metrics as M
from analysis.compare import BUDGET_BYTES, chunk_rows
from common.errors import UserError
from store import Warehouse
from store.stream import Rows, shard_index

CENTROID_COLS = (
    "cell_id",
    "prompt_id",
    "position",
    "n_stacks",
    "kld_centroid_stack",
    "kld_stack_centroid",
    "js_centroid",
    "nonfinite",
)


class Group:
    """Accumulates one group's centroid rows and pair sums, fed a chunk of rows at a time."""

    def __init__(self, ids: list[str], how: str, pairs: list[tuple[str, str]] | None = None):
        """pairs: the pairs to measure (default every pair; analyze leaves out those it keeps)."""
        self.ids, self.how = sorted(ids), how
        self.cols: dict[str, list] = {k: [] for k in CENTROID_COLS}
        todo = itertools.combinations(self.ids, 2) if pairs is None else sorted(tuple(p) for p in pairs)
        self.pairs = {p: [0.0, 0, 0] for p in todo}  # js sum, top1 sum, rows

    def add(self, keys: list[tuple[str, int]], rows: dict[str, tuple[dict, np.ndarray]]) -> None:
        """keys: the chunk's (prompt, position)s in order; rows[cell] = ({key: i}, (n, vocab) float32)."""
        finite = {c: np.isfinite(v).all(-1) for c, (_, v) in rows.items()}
        for key in keys:
            present = [c for c in self.ids if c in rows and key in rows[c][0]]
            fin = [c for c in present if finite[c][rows[c][0][key]]]
            for c in present:
                if c not in fin:  # a flagged row: recorded, measured against nothing
                    for k, v in zip(CENTROID_COLS, (c, key[0], key[1], len(fin), None, None, None, True)):
                        self.cols[k].append(v)
            if fin:
                self._centroid(key, fin, np.stack([rows[c][1][rows[c][0][key]] for c in fin]))  # (stacks, vocab)
        self._pairs(keys, rows, finite)

    def _centroid(self, key, fin: list[str], rows: np.ndarray) -> None:
        import torch  # here, not at the top: a process that only measures rows against a reference never loads it

        # (stacks, vocab); exact widening, faster than torch's .double() (docs/benchmark-notes.md)
        x = rows.astype(np.float64)
        lps = torch.log_softmax(torch.from_numpy(x), -1)  # (stacks, vocab)
        if self.how == "mean_logprob":
            lc = torch.log_softmax(lps.mean(0), -1)
        else:
            lc = torch.logsumexp(lps, 0) - np.log(len(fin))  # log of the mean probability
        # one kernel call per position: the centroid row repeated beside each member's row, no batch to copy
        m = M.row_metrics(np.broadcast_to(lc.numpy(), x.shape), x)
        exact = bool((rows == rows[:1]).all())  # the centroid is that stack
        for k, v in zip(CENTROID_COLS[:4], (fin, [key[0]] * len(fin), [key[1]] * len(fin), [len(fin)] * len(fin))):
            self.cols[k] += v
        for src, dst in (("kld", "kld_centroid_stack"), ("kld_reverse", "kld_stack_centroid"), ("js", "js_centroid")):
            self.cols[dst] += [0.0] * len(fin) if exact else m[src].tolist()
        self.cols["nonfinite"] += [False] * len(fin)

    @staticmethod
    def merge(parts: list["Group"]) -> "Group":
        """Pieces of one group (each over other prompts), in prompt order."""
        out = Group(parts[0].ids, parts[0].how, list(parts[0].pairs))
        for p in parts:
            for k in CENTROID_COLS:
                out.cols[k] += p.cols[k]
            for pair, acc in p.pairs.items():
                tot = out.pairs[pair]
                tot[0], tot[1], tot[2] = tot[0] + acc[0], tot[1] + acc[1], tot[2] + acc[2]
        return out

    def _pairs(self, keys, rows, finite) -> None:
        for (a, b), acc in self.pairs.items():
            if a not in rows or b not in rows:
                continue
            (ka, va), (kb, vb) = rows[a], rows[b]
            both = [k for k in keys if k in ka and k in kb and finite[a][ka[k]] and finite[b][kb[k]]]
            if both:
                m = M.row_metrics(va[[ka[k] for k in both]], vb[[kb[k] for k in both]])
                acc[0] += float(m["js"].sum())
                acc[1] += int(m["top1_match"].sum())
                acc[2] += len(both)

    def tables(self, ref_id: str, group: str | None) -> tuple[pa.Table, pa.Table]:
        n = len(self.cols["cell_id"])
        cent = pa.table(
            {
                **self.cols,
                "centroid": [self.how] * n,
                "is_reference": [c == ref_id for c in self.cols["cell_id"]],
                "centroid_group": [group] * n,
                "kernel_version": [M.KERNEL_VERSION] * n,
            }
        )
        items = sorted(self.pairs.items())
        pair = pa.table(
            {  # typed: a group whose every pair is kept computes none
                "cell_a": pa.array([a for (a, _), _ in items], pa.string()),
                "cell_b": pa.array([b for (_, b), _ in items], pa.string()),
                "rows": pa.array([acc[2] for _, acc in items], pa.int64()),
                "mean_js": pa.array([acc[0] / acc[2] if acc[2] else None for _, acc in items], pa.float64()),
                "top1_agreement": pa.array([acc[1] / acc[2] if acc[2] else None for _, acc in items], pa.float64()),
                "kernel_version": pa.array([M.KERNEL_VERSION] * len(items), pa.string()),
            }
        )
        return cent, pair


def group_rows(
    wh: Warehouse,
    ids: list[str],
    how: str,
    group: str | None,
    prompts: list[str] | None = None,
    pairs: list[tuple[str, str]] | None = None,
    budget: int = BUDGET_BYTES,
) -> Group:
    """One group's centroid rows and pair sums over `prompts` (default all), from the members'
    repeat-0 shards; Group.merge joins pieces and .tables() makes the files."""
    idx = {c: shard_index(wh, c, 0) for c in ids}
    vocabs = {i.vocab for i in idx.values() if i.vocab}
    if len(vocabs) > 1:
        raise UserError(
            f"centroid group {group}: its stacks have vocabularies {sorted(vocabs)}; "
            f"a centroid needs one (put the stacks in different centroid groups)"
        )
    step = chunk_rows(len(ids), vocabs.pop() if vocabs else 1, budget)
    acc, only = Group(ids, how, pairs), None if prompts is None else set(prompts)
    for pid in sorted(set().union(*(i.prompts for i in idx.values()))):
        if only is not None and pid not in only:
            continue
        have = {c: i.prompts[pid] for c, i in idx.items() if pid in i.prompts}
        at = {c: {int(q): j for j, q in enumerate(p.positions)} for c, p in have.items()}
        readers = {c: Rows(wh, idx[c], pid, step) for c in have}
        positions = sorted(set().union(*(a.keys() for a in at.values())))
        for s in range(0, len(positions), step):
            qs = positions[s : s + step]
            rows = {}
            for c in have:
                hit = [q for q in qs if q in at[c]]
                if hit:
                    rows[c] = (
                        {(pid, q): j for j, q in enumerate(hit)},
                        readers[c].take(np.array([at[c][q] for q in hit], np.int64)),
                    )
            acc.add([(pid, q) for q in qs], rows)
    return acc


def centroid_tables(
    shards: dict[str, tuple[list[tuple[str, int]], np.ndarray]], ref_id: str, how: str, group: str | None = None
) -> tuple[pa.Table, pa.Table]:
    """The same tables from rows already in memory: shards[cell] = (keys, (rows, vocab) logits)."""
    acc = Group(list(shards), how)
    keys = sorted(set().union(*(set(k) for k, _ in shards.values())))
    acc.add(keys, {c: ({k: i for i, k in enumerate(ks)}, v) for c, (ks, v) in shards.items()})
    return acc.tables(ref_id, group)
