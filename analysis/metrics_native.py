"""The metric kernel (analysis/metrics_kernel.c) through common/native.py: no torch and no JIT in
the process that measures.

    reduce(x, y, block) -> (out (rows, 12) float64, block maxima of x and of y (rows, vocab // block))
    reduce_bf16(x, y, block): the same for stored bf16 rows and their shifts (store/values.py Bf16Rows)
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from common import native
from store.values import Bf16Rows

SOURCE = Path(__file__).with_name("metrics_kernel.c")
ROWS_PER_TASK = 16  # rows one thread takes at a time: a prompt's rows spread over the threads


def _declare(lib: ctypes.CDLL) -> None:
    for name in ("reduce_f32", "reduce_f64"):
        getattr(lib, name).restype = ctypes.c_int64  # 0, or -1: out of memory for its exps buffer
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
    lib.reduce_bf16.restype = ctypes.c_int64
    lib.reduce_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
    lib.outputs.restype = ctypes.c_int64


def load() -> ctypes.CDLL | None:
    return native.load(SOURCE, _declare)


def failure() -> str | None:
    return native.failure(SOURCE)


def threads() -> int:
    return native.threads()


def reduce(x: np.ndarray, y: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y: (rows, vocab) float32 or float64 (the same), C-contiguous -> (rows, 12) float64 sums,
    (rows, vocab // block) block maxima of each in their dtype. load() must have succeeded."""
    lib = load()
    rows, vocab = x.shape
    fn = lib.reduce_f32 if x.dtype == np.float32 else lib.reduce_f64
    out = np.empty((rows, lib.outputs()))
    bx, by = (np.empty((rows, vocab // block), x.dtype) for _ in range(2))
    ins, outs = [a.ctypes.data for a in (x, y)], [a.ctypes.data for a in (out, bx, by)]
    native.spread(lambda first, last: _check(fn(*ins, first, last, vocab, block, *outs)), rows, ROWS_PER_TASK)
    return out, bx, by


def reduce_bf16(x: Bf16Rows, y: Bf16Rows, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """reduce() of the raw logits of two sets of stored bf16 rows, read as they are stored: the
    values of their widened float32 rows, summed in the vectoriser's order for uint16 loads."""
    lib = load()
    rows, vocab = x.shape
    out = np.empty((rows, lib.outputs()))
    bx, by = (np.empty((rows, vocab // block), np.float32) for _ in range(2))
    ins = [a.ctypes.data for a in (x.bits, x.shift, y.bits, y.shift)]
    outs = [a.ctypes.data for a in (out, bx, by)]
    native.spread(
        lambda first, last: _check(lib.reduce_bf16(*ins, first, last, vocab, block, *outs)), rows, ROWS_PER_TASK
    )
    return out, bx, by


def _check(code: int) -> None:
    if code != 0:
        raise MemoryError("the metric kernel could not allocate its per-thread buffer of exps")
