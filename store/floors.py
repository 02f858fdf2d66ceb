"""The KL a lossy storage format costs by itself: below that floor a measured divergence says nothing.

One home for it: the capture meters each row as it is written (Storage), the cells row keeps the
result as its `storage` JSON (StorageFloor.to_json), and analysis reads it back (StorageFloor.of_cell).

Captured cells are stored exactly (floor 0) unless the spec says `store: bf16`: then each row is
shifted by its max and rounded to bf16, and its KL(native || stored) is measured as it is written
(bf16_floor). A llama.cpp `--kl-divergence-base` file rounds each
log-prob to a uint16 step and clamps 16 nats below the top (store/llamacpp_kld.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.values import shift_by_max, to_bf16, widen


def kld_base_floor(scale: np.ndarray, min_log_prob: np.ndarray, n_clamped: np.ndarray) -> np.ndarray:
    """Per row, a bound on the KL the encoding itself costs, from the file alone: uniform rounding
    of each log-prob within +-scale/2 (KL ~ scale^2/24), plus the probability mass the clamp
    dropped (at most e^min_log_prob per clamped token; dropping mass m costs KL ~ m)."""
    scale, mlp = scale.astype(np.float64), min_log_prob.astype(np.float64)  # (rows,)
    dropped = n_clamped * np.exp(mlp)
    return scale ** 2 / 24 + np.minimum(dropped, 1.0)


ROWS = 64  # rows per pass: (64, 262144) float32 temporaries stay ~64 MB


def bf16_floor(z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(rows, vocab) float32 logits shifted by their row max (z) and their bf16 rounding (s) ->
    (rows,) KL(P_z || P_s), fast: with d = s - z (exact in float32: s is within half a bf16 step
    of z), KL = log(sum p e^d) - sum p d = log1p(sum p expm1(d)) - sum p d. Elementwise float32,
    sums in float64: ~1e-5 relative, enough for a floor. NaN where a row is not finite."""
    out = np.empty(z.shape[0])
    for i in range(0, z.shape[0], ROWS):
        zz, ss = z[i:i + ROWS], s[i:i + ROWS]
        e = np.exp(zz)  # (rows, vocab); <= 1: z <= 0
        total = e.sum(-1, dtype=np.float64)
        d = ss - zz
        d[np.isinf(zz)] = 0.0  # a masked (-inf) token: weight 0, and inf - inf would be NaN
        a = np.einsum("ij,ij->i", e, np.expm1(d), dtype=np.float64) / total
        b = np.einsum("ij,ij->i", e, d, dtype=np.float64) / total
        kl = np.log1p(a) - b
        broken = np.isnan(zz).any(-1) | np.isposinf(zz).any(-1)
        out[i:i + ROWS] = np.where(np.isfinite(kl) & ~broken, np.maximum(kl, 0.0), np.nan)
    return out



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
        """One capture's part of its cell's StorageFloor (plain values: it travels back from an actor)."""
        return {"store": self.store, "rows_rounded": self.rows, "floor_sum": self.floor_sum,
                "floor_max": self.floor_max, "nonfinite_rows": self.nonfinite}


@dataclass(frozen=True)
class StorageFloor:
    """A cell's storage floor: the mean and max per-row KL(native || stored) over its captures."""

    store: str = "native"
    rows: int = 0  # rows measured (a lossless cell: 0)
    mean: float = 0.0
    max: float = 0.0

    @classmethod
    def of_captures(cls, parts: list[dict]) -> "StorageFloor":
        """From each capture's Storage.summary()."""
        store = parts[0]["store"] if parts else "native"
        if store == "native":
            return cls()
        rows = sum(p["rows_rounded"] for p in parts)
        return cls(store, rows, sum(p["floor_sum"] for p in parts) / rows if rows else 0.0,
                   max(p["floor_max"] for p in parts))

    def to_dict(self) -> dict[str, Any]:
        """The cells row's `storage` (its JSON)."""
        if self.store == "native":
            return {"store": "native", "lossless": True}
        return {"store": self.store, "lossless": self.rows == 0,
                "rounding": "bf16 round-to-nearest-even of (logit - row max)", "storage_floor": self.mean,
                "storage_floor_max": self.max, "rows_measured": self.rows,
                "floor_definition": "per row KL(P_native || P_stored), float64, natural log"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def of_cell(cell: dict) -> float:
        """The mean floor of a cells row: its `storage` (a `store: bf16` capture), or, for a file
        imported in a lossy format, the floor its import estimated (`settings`); 0 when exact."""
        stored = json.loads(cell.get("storage") or "{}").get("storage_floor")
        return float(stored or json.loads(cell.get("settings") or "{}").get("storage_floor") or 0.0)
