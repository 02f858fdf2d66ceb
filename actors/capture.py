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
                  layers_writer=None) -> dict[str, Any]:
    """Every prompt's rows into writer (a ShardWriter, or a RemoteShard on a node that cannot
    see the warehouse), committed at the end; returns a small manifest (no arrays).

    layers_writer: the same kind of writer for the layer_states table; each prompt's hidden states
    at the same positions (backend.stack.layers and the final norm) go there, from a prefill of
    their own. It commits first: a logits shard then never exists without its layer shard.

    max_tokens: keep only the sampled positions below it and feed just the prefix they
    need; logits at p depend on ids[0..p] only, so those rows mean what the full run's do.
    observe(prompt_id, positions, stored, shift): called with each prompt's rows as written."""
    t0 = time.perf_counter()
    forward_s = 0.0
    storage = Storage(store)
    layers = list(backend.stack.layers) if layers_writer is not None else []
    depth = backend.n_layers() if layers else 0
    sources = backend.state_sources(layers) if layers else {}
    layer_s = 0.0
    try:
        dtype = None
        for prompt_id, ids in prompts:
            fed, positions = fed_ids(ids, keep, max_tokens)
            if not positions:  # the window misses this prompt: no rows, no forward
                continue
            # Row p holds the prediction for ids[p + 1] of the whole prompt (a window or a prefix
            # feeds less); only the prompt's last row has no next token.
            next_ids = [ids[p + 1] if p + 1 < len(ids) else None for p in positions]
            ids = fed
            tf = time.perf_counter()
            native = backend.forward(ids, positions)  # (rows, vocab), native dtype
            forward_s += time.perf_counter() - tf
            dtype = str(native.dtype)
            stored, shift = storage.keep(native)
            writer.add(prompt_id, positions, next_ids, stored, shift)
            if observe is not None:
                observe(prompt_id, positions, stored, shift)
            if layers:
                tl = time.perf_counter()
                layers_writer.add_layers(prompt_id, positions, backend.layer_states(ids, positions, layers),
                                         depth, sources)
                layer_s += time.perf_counter() - tl
        if layers:
            layers_writer.commit()
        path = writer.commit()
    except BaseException:
        writer.abort()
        if layers:
            layers_writer.abort()
        raise
    out = {"path": str(path), "rows": writer.rows, "seconds": time.perf_counter() - t0,
           "forward_seconds": forward_s, "array_dtype": dtype, "storage": storage.summary()}
    if layers:
        out["layers"] = {"rows": layers_writer.rows, "seconds": layer_s, "depth": depth, "layers": layers,
                         "sources": sources}
    return out
