"""Native logit and hidden-state arrays and their stored form: dtypes, exact widening, bf16
rounding, the row hash. Below every shard format (store/warehouse.py, store/layer_states.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

ZSTD_LEVEL = 3  # every shard's zstd level


def native_dtype_of(arr: np.ndarray) -> str:
    """Backends return bf16 as raw uint16 bits, f16 as float16, fp32 as float32."""
    kinds = {np.dtype(np.uint16): "bf16", np.dtype(np.float16): "f16", np.dtype(np.float32): "fp32"}
    if arr.dtype not in kinds:
        raise TypeError(f"unsupported native logits dtype {arr.dtype}")
    return kinds[arr.dtype]


def widen(arr: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Native logits -> float32, exactly (bf16 bits go into the high half); into out's first
    arr.size values when given (float32, any shape), else a new array; float32 is arr itself."""
    if arr.dtype == np.float32:
        return arr
    if out is not None:
        wide = out.reshape(-1)[: arr.size].reshape(arr.shape)
        if arr.dtype == np.uint16:
            np.copyto(wide.view(np.uint32), arr)
            wide.view(np.uint32)[...] <<= 16
        else:
            np.copyto(wide, arr)
        return wide
    if arr.dtype == np.uint16:
        wide = arr.astype(np.uint32)
        wide <<= 16  # in place: one buffer, not two
        return wide.view(np.float32)
    return arr.astype(np.float32, copy=False)


def shift_by_max(native: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, vocab) logits -> (float32 logits minus their row max, the (rows,) max subtracted).
    Softmax does not see the shift; a row whose max is not finite is left as it is (shift 0)."""
    x = native.astype(np.float32)  # (rows, vocab), a copy: shifted in place below
    m = np.max(x, -1)
    m = np.where(np.isfinite(m), m, np.float32(0)).astype(np.float32)
    x -= m[:, None]
    return x, m


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (as torch's .to(bfloat16))."""
    bits = x.view(np.uint32)
    r = np.right_shift(bits, 16)  # in place from here: faster than the expression form (docs/benchmark-notes.md)
    np.bitwise_and(r, 1, out=r)
    r += 0x7FFF
    r += bits  # wraps only for NaN payloads, fixed below
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0  # a NaN stays a (quiet) NaN
    return out


def round_bf16(native: np.ndarray) -> np.ndarray:
    """(rows, vocab) fp32/f16 logits -> bf16 bits of (row - row max). Shifting first keeps the
    large logits' exponent small: rounding unshifted rows costs a KL floor of ~4e-4 on SmolLM2,
    shifted ~1e-5."""
    return to_bf16(shift_by_max(native)[0])


def narrow_bf16(values: np.ndarray) -> np.ndarray:
    """float32 that came from bf16 -> the original uint16 bits; refuses lossy input."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise ValueError("values are not bf16: low mantissa bits are set")
    return (bits >> 16).astype(np.uint16)


def rows_at(rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """rows[idx]; a run of consecutive indices (every row of a prompt, the usual case) as a view, not a copy."""
    if len(idx) and (np.diff(idx) == 1).all():
        return rows[int(idx[0]) : int(idx[-1]) + 1]
    return rows[idx]


def unshift(values: np.ndarray, shift, inplace: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """(rows, vocab) stored values + each row's shift (an Arrow column or an array; null or None:
    0) -> the raw logits, for what is not shift-invariant (cosine, norms, max |Δ|, logit values).
    inplace: values is the caller's own copy, shifted where it is (a full-vocab pass and buffer fewer);
    out: a float32 buffer the result goes into (its first values), in one pass."""
    if out is not None:
        out = out.reshape(-1)[: values.size].reshape(values.shape)
    if isinstance(shift, (pa.Array, pa.ChunkedArray)):
        shift = shift.fill_null(0).to_numpy(zero_copy_only=False)
    s = None if shift is None else np.asarray(shift, np.float32)  # (rows,)
    if s is None or not s.any():
        if out is not None:
            np.copyto(out, values)
            return out
        return values
    if out is not None:
        return np.add(values, s[:, None], out=out)
    if inplace:
        values += s[:, None]
        return values
    return values + s[:, None]


@dataclass(frozen=True)
class Bf16Rows:
    """(rows, vocab) rows as `store: bf16` keeps them: bf16 bits, and each row's shift (its raw
    logits are the bits widened plus the shift, as unshift gives them). The metric kernel reads
    them as they are (analysis/metrics_kernel.c reduce_bf16): no float32 copy of either side."""

    bits: np.ndarray  # (rows, vocab) uint16, C-contiguous
    shift: np.ndarray  # (rows,) float32

    def __post_init__(self):  # the metric kernel takes their pointers: its own checks are these
        b, s = self.bits, self.shift
        if b.dtype != np.uint16 or b.ndim != 2 or not b.flags.c_contiguous:
            raise ValueError(f"Bf16Rows: bits must be C-contiguous (rows, vocab) uint16, not {b.dtype} {b.shape}")
        if s.dtype != np.float32 or s.shape != (len(b),) or not s.flags.c_contiguous:
            raise ValueError(f"Bf16Rows: shift must be ({len(b)},) float32, not {s.dtype} {s.shape}")

    @staticmethod
    def of(bits: np.ndarray, shift) -> "Bf16Rows":
        """shift: an array, an Arrow column, or None (0: rows stored without one)."""
        if isinstance(shift, (pa.Array, pa.ChunkedArray)):
            shift = shift.fill_null(0).to_numpy(zero_copy_only=False)
        s = np.zeros(len(bits), np.float32) if shift is None else np.asarray(shift, np.float32)
        return Bf16Rows(np.ascontiguousarray(bits), np.ascontiguousarray(s))

    @property
    def shape(self) -> tuple[int, int]:
        return self.bits.shape

    def at(self, idx: np.ndarray) -> "Bf16Rows":
        """Rows idx (a run of consecutive rows as a view)."""
        return Bf16Rows.of(rows_at(self.bits, idx), self.shift[idx])

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """(rows, k) ids -> (rows, k) float32 raw logits at them, as widening the whole rows gives them."""
        return unshift(widen(np.take_along_axis(self.bits, idx, 1)), self.shift, inplace=True)

    def widened(self) -> np.ndarray:
        """(rows, vocab) float32 raw logits (a new array)."""
        return unshift(widen(self.bits), self.shift, inplace=True)


def logits_matrix(col) -> np.ndarray:
    """A logits list<float32> column (array or chunked) -> (rows, vocab) float32; rows must share a length."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if arr.null_count:
        raise ValueError("rows whose values were not kept (keep_rows: references)")
    lengths = np.diff(arr.offsets.to_numpy())
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError("rows of different vocabulary sizes")
    vocab = int(lengths[0]) if len(lengths) else 0
    start = arr.offsets[0].as_py() if len(arr) else 0
    vals = arr.values.to_numpy(zero_copy_only=False)[start : start + vocab * len(arr)]
    return vals.astype(np.float32, copy=False).reshape(len(arr), vocab)


def row_hash(row: np.ndarray) -> str:
    """sha256 of a row's native bytes (hashed in place: a copy would cost as much as the hash)."""
    return hashlib.sha256(np.ascontiguousarray(row).data).hexdigest()


def native_values(rows: pa.Table, values: str, dtype: str) -> np.ndarray:
    """A table's list<float32> column back in the native dtype its dtype column names, exactly:
    (rows, width). Every row must share one native dtype."""
    kinds = set(rows.column(dtype).to_pylist())
    if len(kinds) > 1:
        raise ValueError(f"rows of several native dtypes: {sorted(kinds)}")
    wide = logits_matrix(rows.column(values))  # (rows, width) float32
    kind = kinds.pop() if kinds else "fp32"
    return narrow_bf16(wide) if kind == "bf16" else wide.astype(np.float16) if kind == "f16" else wide
