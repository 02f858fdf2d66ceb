"""Buffers kept from prompt to prompt by the one caller that owns them: a prompt's fresh memory
costs its page faults (at a 262,144 vocabulary, as much as the work done in it)."""

from __future__ import annotations

import numpy as np


def room(buf: np.ndarray | None, size: int, dtype=np.float32) -> np.ndarray:
    """buf when it holds size values of dtype, else a new (size,) array that does."""
    ok = buf is not None and buf.dtype == np.dtype(dtype) and buf.size >= size
    return buf if ok else np.empty(size, dtype)
