"""One capture: teacher-forced prefill of every prompt, rows at the sampled positions, one shard.

Kept free of Ray so the actor, the tests and the benchmarks run the same code.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from analysis.floors import bf16_floor
from backends.base import Backend
from common.positions import Positions
from store.warehouse import shift_by_max, to_bf16, widen


def fed_ids(ids: list[int], keep: Positions | int, max_tokens: int | None) -> tuple[list[int], list[int]]:
    """The ids a stack is fed and the positions kept (keep: the spec's positions, or a plain
    stride); only the prefix the last kept position needs is fed. ([], []) when none is kept."""
    keep = Positions.every(keep) if isinstance(keep, int) else keep
    positions = keep.of(len(ids))
    if max_tokens is not None:
        positions = [p for p in positions if p < max_tokens]
    return (ids[:positions[-1] + 1], positions) if positions else ([], [])


BLOCK = 32  # rows per rounding pass: (32, 262144) float32 temporaries are 32 MB


class Storage:
    """What a shard keeps of each row: the native values (lossless), or bf16 of the row shifted
    by its max, with each row's KL(native || stored) measured here, where the native row still is."""

    def __init__(self, store: str):
        self.store, self.rows, self.floor_sum, self.floor_max, self.nonfinite = store, 0, 0.0, 0.0, 0

    def keep(self, native: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (the rows to store, what was subtracted from each, or None)."""
        if self.store == "native" or native.dtype == np.uint16:  # bf16 already: nothing to round
            return native, None
        stored = np.empty(native.shape, np.uint16)  # (rows, vocab) bf16 bits
        kl, shift = np.empty(native.shape[0]), np.empty(native.shape[0], np.float32)  # (rows,)
        for i in range(0, native.shape[0], BLOCK):  # blocks: temporaries below malloc's mmap threshold
            z, shift[i:i + BLOCK] = shift_by_max(native[i:i + BLOCK])  # (block, vocab) float32, (block,)
            stored[i:i + BLOCK] = to_bf16(z)
            kl[i:i + BLOCK] = bf16_floor(z, widen(stored[i:i + BLOCK]))
        ok = np.isfinite(kl)
        self.rows += int(ok.sum())
        self.nonfinite += int((~ok).sum())
        self.floor_sum += float(kl[ok].sum())
        self.floor_max = max(self.floor_max, float(kl[ok].max(initial=0.0)))
        return stored, shift

    def summary(self) -> dict[str, Any]:
        return {"store": self.store, "rows_rounded": self.rows, "floor_sum": self.floor_sum,
                "floor_max": self.floor_max, "nonfinite_rows": self.nonfinite}


def storage_summary(parts: list[dict]) -> dict[str, Any]:
    """The cells row's `storage` from each capture's Storage.summary(): the mean and max floor."""
    store = parts[0]["store"] if parts else "native"
    if store == "native":
        return {"store": "native", "lossless": True}
    rows = sum(p["rows_rounded"] for p in parts)
    return {"store": store, "lossless": rows == 0, "rounding": "bf16 round-to-nearest-even of (logit - row max)",
            "storage_floor": sum(p["floor_sum"] for p in parts) / rows if rows else 0.0,
            "storage_floor_max": max(p["floor_max"] for p in parts), "rows_measured": rows,
            "floor_definition": "per row KL(P_native || P_stored), float64, natural log"}


def capture_shard(backend: Backend, writer, prompts: list[tuple[str, list[int]]], keep: Positions | int,
                  max_tokens: int | None = None, store: str = "native", observe=None,
                  layers_writer=None, decode_writer=None) -> dict[str, Any]:
    """Every prompt's rows into writer (a ShardWriter, or a RemoteShard on a node that cannot
    see the warehouse), committed at the end; returns a small manifest (no arrays).

    layers_writer: the same kind of writer for the layer_states table; each prompt's hidden states
    at the same positions (backend.stack.layers and the final norm) go there, from the same
    forward (Extras). It commits first: a logits shard then never exists without its layer shard.
    decode_writer: a `decode:` or `prefix_cache:` cell's d<repeat> file (rows written as they are,
    lossless): at each position the cell decodes, the decode row and the prefill row there; at each
    position a warm prefix cache recomputed, that row and the capture's own (Extras).

    max_tokens: keep only the sampled positions below it and feed just the prefix they
    need; logits at p depend on ids[0..p] only, so those rows mean what the full run's do.
    observe(prompt_id, positions, stored, shift): called with each prompt's rows as written."""
    t0 = time.perf_counter()
    forward_s = 0.0
    storage = Storage(store)
    extras = Extras(backend, layers_writer, decode_writer)
    try:
        dtype = None
        for prompt_id, ids in prompts:
            fed, positions = fed_ids(ids, keep, max_tokens)
            if not positions:  # the window misses this prompt: no rows, no forward
                continue
            # Row p holds the prediction for ids[p + 1] of the whole prompt (a window or a prefix
            # feeds less); only the prompt's last row has no next token.
            next_ids = [ids[p + 1] if p + 1 < len(ids) else None for p in positions]
            tf = time.perf_counter()
            native = extras.forward(prompt_id, ids, fed, positions)  # (rows, vocab), native dtype
            forward_s += time.perf_counter() - tf
            dtype = str(native.dtype)
            stored, shift = storage.keep(native)
            writer.add(prompt_id, positions, next_ids, stored, shift)
            if observe is not None:
                observe(prompt_id, positions, stored, shift)
        extras.commit()
        path = writer.commit()
    except BaseException:
        writer.abort()
        extras.abort()
        raise
    return {"path": str(path), "rows": writer.rows, "seconds": time.perf_counter() - t0,
            "forward_seconds": forward_s, "array_dtype": dtype, "storage": storage.summary(), **extras.summary()}


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """Two (rows, vocab) arrays of the same native dtype: (rows byte-identical, max |a - b|)."""
    n = len(a)
    same = (a.view(np.uint8).reshape(n, -1) == b.view(np.uint8).reshape(n, -1)).all(-1)
    return int(same.sum()), float(np.abs(widen(a) - widen(b)).max(initial=0.0))


class Extras:
    """What a cell records beside its rows (issue 17): `layers:` hidden states and `decode:` rows.

    The hidden states come out of the prompt's own forward through the engine's taps
    (forward_and_layers: the same arithmetic as the rows). For decode, a prefill up to the last
    decoded position gives the prefill rows there; then, from each start, the engine decodes one
    teacher-forced token at a time from its KV cache; both rows of each position go to the d file."""

    def __init__(self, backend: Backend, layers_writer, decode_writer):
        self.backend, self.lw, self.dw = backend, layers_writer, decode_writer
        self.layers = list(backend.stack.layers) if layers_writer is not None else []
        self.depth = backend.n_layers() if self.layers else 0
        self.sources = backend.state_sources(self.layers) if self.layers else {}
        self.decode = backend.stack.decode if decode_writer is not None else None
        self.prefix = bool(backend.stack.prefix_cache) and decode_writer is not None
        self.rows, self.seconds, self.identical, self.max_abs = 0, 0.0, 0, 0.0
        self.cached = {"rows": 0, "hits": {}, "identical_rows": 0, "max_abs_diff_vs_prefill": 0.0, "seconds": 0.0}

    def forward(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int]) -> np.ndarray:
        if self.layers:  # (rows, vocab), {state: (rows, hidden)}: one forward, the taps only copy
            rows, states = self.backend.forward_and_layers(fed, positions, self.layers)
            self.lw.add_layers(prompt_id, positions, states, self.depth, self.sources)
        else:
            rows = self.backend.forward(fed, positions)
        if self.prefix:
            self._prefix_cached(prompt_id, whole, fed, positions, rows)
        starts = [a for a in self.decode[1] if a + self.decode[0] < len(whole)] if self.decode else []
        if starts:  # the starts this prompt holds (matrix/runner.check_decode: every start fits some prompt)
            points = [(a, s) for a in starts for s in range(1, self.decode[0] + 1)]  # start-major
            want = sorted({a + s for a, s in points})
            # A prefill of its own up to the last decoded position: which rows a forward keeps changes
            # the LM head's matmul shape, and so its rounding (HF fp32 measured), so the capture's
            # rows stay exactly those of the same stack without decode.
            pre = self.backend.forward(whole[:want[-1] + 1], want)  # (len(want), vocab)
            at = {p: i for i, p in enumerate(want)}
            self._decode(prompt_id, whole, starts, points, pre[[at[a + s] for a, s in points]])
        return rows

    def _prefix_cached(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int],
                       fresh: np.ndarray) -> None:
        """The same fed ids again with the engine's prefix cache warm; each recomputed row beside the
        capture's fresh row at its position (path 'prefix_cached' / 'prefill', step 0)."""
        t0 = time.perf_counter()
        hit, cached = self.backend.prefix_cached(fed, positions)  # (rows >= hit, vocab)
        self.cached["seconds"] += time.perf_counter() - t0
        idx = [i for i, p in enumerate(positions) if p >= hit]
        q = [positions[i] for i in idx]
        nxt = [whole[p + 1] if p + 1 < len(whole) else None for p in q]
        pre = fresh[idx]  # (rows, vocab)
        self.dw.add(prompt_id, q + q, nxt + nxt, np.concatenate([pre, cached.astype(pre.dtype)]), None,
                    ["prefill"] * len(q) + ["prefix_cached"] * len(q), [0] * (2 * len(q)))
        c = self.cached
        same, diff = agreement(pre, cached)
        c["rows"] += 2 * len(q)
        c["hits"][prompt_id] = int(hit)
        c["identical_rows"] += same
        c["max_abs_diff_vs_prefill"] = max(c["max_abs_diff_vs_prefill"], diff)

    def _decode(self, prompt_id: str, whole: list[int], starts: list[int], points: list, prefill: np.ndarray) -> None:
        steps = self.decode[0]
        t0 = time.perf_counter()
        decoded = np.concatenate([self.backend.decode(whole, a, steps) for a in starts])  # (points, vocab)
        self.seconds += time.perf_counter() - t0
        q = [a + s for a, s in points]
        nxt = [whole[p + 1] if p + 1 < len(whole) else None for p in q]
        self.dw.add(prompt_id, q + q, nxt + nxt, np.concatenate([prefill, decoded.astype(prefill.dtype)]),
                    None, ["prefill"] * len(q) + ["decode"] * len(q), [s for _, s in points] * 2)
        self.rows += 2 * len(q)
        same, diff = agreement(prefill, decoded)
        self.identical += same
        self.max_abs = max(self.max_abs, diff)

    def commit(self) -> None:  # before the logits shard: a logits shard never exists without these
        for w in (self.lw if self.layers else None, self.dw if self.decode or self.prefix else None):
            if w is not None:
                w.commit()

    def abort(self) -> None:
        for w in (self.lw if self.layers else None, self.dw if self.decode or self.prefix else None):
            if w is not None:
                w.abort()

    def summary(self) -> dict[str, Any]:
        out = {}
        if self.layers:
            out["layers"] = {"rows": self.lw.rows, "depth": self.depth, "layers": self.layers, "sources": self.sources}
        if self.decode:
            out["decode"] = {"steps": self.decode[0], "at": list(self.decode[1]), "rows": self.rows,
                             "seconds": self.seconds, "identical_rows": self.identical,
                             "max_abs_diff_vs_prefill": self.max_abs}
        if self.prefix:
            out["prefix_cache"] = dict(self.cached)
        return out
