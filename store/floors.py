"""The KL a lossy storage format costs by itself: below that floor a measured divergence says nothing.

One home for it: the capture meters each row as it is written (Storage), the cells row keeps the
result as its `storage` JSON (StorageFloor.to_json), and analysis reads it back (StorageFloor.of_cell).

Captured cells are stored exactly (floor 0) unless the spec says `store: bf16`: then each row is
shifted by its max and rounded to bf16, and its KL(native || stored) is measured as it is written
(bf16_floor). A llama.cpp `--kl-divergence-base` file rounds each
log-prob to a uint16 step and clamps 16 nats below the top (store/llamacpp_kld.py).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from common import native as kernels
from common.buffers import room
from store.cell_rows import CellRow
from store.values import shift_by_max, to_bf16, widen

KERNEL = Path(__file__).with_name("floors_kernel.c")  # the fused pass below in C, where it builds
ROWS_PER_TASK = 16


def kld_base_floor(scale: np.ndarray, min_log_prob: np.ndarray, n_clamped: np.ndarray) -> np.ndarray:
    """Per row, a bound on the KL the encoding itself costs, from the file alone: uniform rounding
    of each log-prob within +-scale/2 (KL ~ scale^2/24), plus the probability mass the clamp
    dropped (at most e^min_log_prob per clamped token; dropping mass m costs KL ~ m)."""
    scale, mlp = scale.astype(np.float64), min_log_prob.astype(np.float64)  # (rows,)
    dropped = n_clamped * np.exp(mlp)
    return scale**2 / 24 + np.minimum(dropped, 1.0)


ROWS = 64  # rows per pass: (64, 262144) float32 temporaries stay ~64 MB


def bf16_floor(z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(rows, vocab) float32 logits shifted by their row max (z) and their bf16 rounding (s) ->
    (rows,) KL(P_z || P_s), fast: with d = s - z (exact in float32: s is within half a bf16 step
    of z), KL = log(sum p e^d) - sum p d = log1p(sum p expm1(d)) - sum p d. Elementwise float32,
    sums in float64: ~1e-5 relative, enough for a floor. NaN where a row is not finite."""
    out = np.empty(z.shape[0])
    for i in range(0, z.shape[0], ROWS):
        zz, ss = z[i : i + ROWS], s[i : i + ROWS]
        e = np.exp(zz)  # (rows, vocab); <= 1: z <= 0
        total = e.sum(-1, dtype=np.float64)
        d = ss - zz
        d[np.isinf(zz)] = 0.0  # a masked (-inf) token: weight 0, and inf - inf would be NaN
        a = np.einsum("ij,ij->i", e, np.expm1(d), dtype=np.float64) / total
        b = np.einsum("ij,ij->i", e, d, dtype=np.float64) / total
        kl = np.log1p(a) - b
        broken = np.isnan(zz).any(-1) | np.isposinf(zz).any(-1)
        out[i : i + ROWS] = np.where(np.isfinite(kl) & ~broken, np.maximum(kl, 0.0), np.nan)
    return out


CACHE_VALUES = 1 << 18  # values per fused pass: a block's five float32 buffers stay within L2 (~5 MB)


def _fused_keep(x: np.ndarray, m: np.ndarray, stored: np.ndarray, bufs: tuple) -> np.ndarray:
    """(block, vocab) float32 rows and their finite max m (block,) -> their bf16 floor (block,); stored
    gets the bf16 bits of (row - max). One cache-sized block through preallocated buffers: ~10
    in-place passes instead of ~30 with temporaries the size of main memory's reach. The floor is
    KL = log1p(b + c) - b with b = sum p d and c = sum p (e^d - 1 - d), d = stored - z (exact in
    float32), e^d - 1 - d = d^2 (1/2 + d/6 + d^2/24) (|d| <= 2^-9 |z|: the next term is below
    1e-5 relative where p is not negligible); NaN where a token is masked (-inf), for the caller."""
    z, u, e, d, c = (b[: x.shape[0]] for b in bufs)  # (block, vocab) each
    np.subtract(x, m[:, None], out=z)
    bits = z.view(np.uint32)
    np.right_shift(bits, 16, out=u)  # round to nearest even, as to_bf16
    np.bitwise_and(u, 1, out=u)
    u += 0x7FFF
    u += bits
    u >>= 16
    stored[...] = u
    u <<= 16  # the stored value as float32
    with np.errstate(invalid="ignore"):  # a masked token's -inf - -inf: its row goes the general way
        np.subtract(u.view(np.float32), z, out=d)
    np.exp(z, out=e)
    np.multiply(d, np.float32(1 / 24), out=c)
    c += np.float32(1 / 6)
    c *= d
    c += np.float32(0.5)
    c *= d
    c *= d
    kl = np.empty(x.shape[0])
    for j in range(x.shape[0]):  # (vocab,) dot products: BLAS, the block still in cache
        total = float(np.sum(e[j]))
        b, cc = float(np.dot(e[j], d[j])) / total, float(np.dot(e[j], c[j])) / total
        kl[j] = cc - ((b + cc) - np.log1p(b + cc))  # log1p(b + c) - b without its cancellation
    return kl


def _declare(lib: ctypes.CDLL) -> None:
    lib.keep_bf16.restype = None
    lib.keep_bf16.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3


def _native_keep(x: np.ndarray, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(shift, floor) of every row, stored filled, by the C kernel over the CPUs (rows it cannot
    do come back with floor NaN); None where the kernel is not built."""
    lib = kernels.load(KERNEL, _declare)
    if lib is None:
        return None
    x = np.ascontiguousarray(x, np.float32)
    shift, kl = np.empty(x.shape[0], np.float32), np.empty(x.shape[0])
    args = x.ctypes.data, stored.ctypes.data, shift.ctypes.data, kl.ctypes.data
    kernels.spread(lambda a, b: lib.keep_bf16(args[0], a, b, x.shape[1], *args[1:]), x.shape[0], ROWS_PER_TASK)
    return shift, kl


class Storage:
    """What a shard keeps of each row: the native values (lossless), or bf16 of the row shifted
    by its max, with each row's KL(native || stored) measured here, where the native row still is."""

    def __init__(self, store: str, reuse: bool = False):
        """reuse: keep() returns its rows in one buffer it keeps, for a caller done with each
        prompt's stored rows before it asks for the next (a capture's row work)."""
        self.store, self.rows, self.floor_sum, self.floor_max, self.nonfinite = store, 0, 0.0, 0.0, 0
        self.bufs = None
        self.out = np.empty(0, np.uint16) if reuse else None  # (rows * vocab,) bf16 bits, grown as needed

    def _block(self, x: np.ndarray, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One block's (shift, floor), stored filled: the fused pass, or where a row is not
        finite (a NaN, an infinite max, a masked token) the general one for the whole block."""
        x = x.astype(np.float32, copy=False)
        if self.bufs is None or self.bufs[0].shape[1] != x.shape[1]:
            rows = max(1, CACHE_VALUES // x.shape[1])
            self.bufs = tuple(
                np.empty((rows, x.shape[1]), t) for t in (np.float32, np.uint32, np.float32, np.float32, np.float32)
            )
        out = []
        for i in range(0, x.shape[0], self.bufs[0].shape[0]):
            xx, ss = x[i : i + self.bufs[0].shape[0]], stored[i : i + self.bufs[0].shape[0]]
            m = xx.max(-1)  # (block,)
            fused = bool(np.isfinite(m).all())
            kl = _fused_keep(xx, m, ss, self.bufs) if fused else None
            if not fused or not np.isfinite(kl).all():
                z, m = shift_by_max(xx)  # (block, vocab), (block,)
                ss[...] = to_bf16(z)
                kl = bf16_floor(z, widen(ss))
            out.append((m, kl))
        return np.concatenate([m for m, _ in out]), np.concatenate([k for _, k in out])

    def keep(self, native: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (the rows to store, what was subtracted from each, or None)."""
        if self.store == "native" or native.dtype == np.uint16:  # bf16 already: nothing to round
            return native, None
        stored = self._out(native.shape)  # (rows, vocab) bf16 bits
        fast = _native_keep(native, stored) if native.size else None
        if fast is None:
            shift, kl = self._block(native, stored)  # (rows,) each
        else:
            shift, kl = fast
            redo = np.flatnonzero(~np.isfinite(kl))  # rows that are not finite: the general way
            if len(redo):
                shift[redo], kl[redo] = self._block(
                    native[redo], part := np.empty((len(redo), native.shape[1]), np.uint16)
                )
                stored[redo] = part
        shift = shift.astype(np.float32)
        ok = np.isfinite(kl)
        self.rows += int(ok.sum())
        self.nonfinite += int((~ok).sum())
        self.floor_sum += float(kl[ok].sum())
        self.floor_max = max(self.floor_max, float(kl[ok].max(initial=0.0)))
        return stored, shift

    def _out(self, shape: tuple[int, int]) -> np.ndarray:
        if self.out is None:
            return np.empty(shape, np.uint16)
        self.out = room(self.out, shape[0] * shape[1], np.uint16)
        return self.out[: shape[0] * shape[1]].reshape(shape)

    def summary(self) -> dict[str, Any]:
        """One capture's part of its cell's StorageFloor (plain values: it travels back from an actor)."""
        return {
            "store": self.store,
            "rows_rounded": self.rows,
            "floor_sum": self.floor_sum,
            "floor_max": self.floor_max,
            "nonfinite_rows": self.nonfinite,
        }


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
        return cls(
            store, rows, sum(p["floor_sum"] for p in parts) / rows if rows else 0.0, max(p["floor_max"] for p in parts)
        )

    def to_dict(self) -> dict[str, Any]:
        """The cells row's `storage` (its JSON)."""
        if self.store == "native":
            return {"store": "native", "lossless": True}
        return {
            "store": self.store,
            "lossless": self.rows == 0,
            "rounding": "bf16 round-to-nearest-even of (logit - row max)",
            "storage_floor": self.mean,
            "storage_floor_max": self.max,
            "rows_measured": self.rows,
            "floor_definition": "per row KL(P_native || P_stored), float64, natural log",
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def of_cell(cell: Mapping | CellRow) -> float:
        """The mean floor of a cells row: its `storage` (a `store: bf16` capture), or, for a file
        imported in a lossy format, the floor its import estimated (`settings`); 0 when exact."""
        stored = json.loads(cell.get("storage") or "{}").get("storage_floor")
        return float(stored or json.loads(cell.get("settings") or "{}").get("storage_floor") or 0.0)
