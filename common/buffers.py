"""Buffers kept from prompt to prompt by the one caller that owns them: a prompt's fresh memory
costs its page faults (at a 262,144 vocabulary, as much as the work done in it)."""

from __future__ import annotations

import numpy as np


def room(buf: np.ndarray | None, size: int, dtype=np.float32, empty=np.empty) -> np.ndarray:
    """buf when it holds size values of dtype, else a new (size,) array that does, from
    empty(size, dtype) (np.empty, or an allocator of other host memory, e.g. page-locked)."""
    ok = buf is not None and buf.dtype == np.dtype(dtype) and buf.size >= size
    return buf if ok else empty(size, dtype)
