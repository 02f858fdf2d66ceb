"""The KL a lossy storage format costs by itself: below that floor a measured divergence says nothing.

Captured cells are stored exactly (floor 0) unless the spec says `store: bf16`: then each row is
shifted by its max and rounded to bf16, and its KL(native || stored) is measured as it is written
(storage_kl). A llama.cpp `--kl-divergence-base` file rounds each
log-prob to a uint16 step and clamps 16 nats below the top (store/llamacpp_kld.py).
"""

from __future__ import annotations

import numpy as np


def kld_base_floor(scale: np.ndarray, min_log_prob: np.ndarray, n_clamped: np.ndarray) -> np.ndarray:
    """Per row, a bound on the KL the encoding itself costs, from the file alone: uniform rounding
    of each log-prob within +-scale/2 (KL ~ scale^2/24), plus the probability mass the clamp
    dropped (at most e^min_log_prob per clamped token; dropping mass m costs KL ~ m)."""
    scale, mlp = scale.astype(np.float64), min_log_prob.astype(np.float64)  # (rows,)
    dropped = n_clamped * np.exp(mlp)
    return scale ** 2 / 24 + np.minimum(dropped, 1.0)


ROWS = 64  # rows per float64 pass: (64, 262144) float64 temporaries stay ~130 MB


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    z = x - m
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def storage_kl(native: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """(rows, vocab) engine logits and what the warehouse keeps of them -> (rows,) KL(P_native ||
    P_stored) in float64, the floor that storing costs each row (NaN where a row is not finite)."""
    out = np.empty(native.shape[0])
    for i in range(0, native.shape[0], ROWS):
        a = _log_softmax(native[i:i + ROWS].astype(np.float64))  # (rows, vocab)
        b = _log_softmax(stored[i:i + ROWS].astype(np.float64))
        p = np.exp(a)
        with np.errstate(invalid="ignore"):
            kl = np.where(p > 0, p * (a - b), 0.0).sum(-1)  # a masked (-inf) token weighs nothing
        x = native[i:i + ROWS]
        broken = np.isnan(x).any(-1) | np.isposinf(x).any(-1)  # a NaN/+Inf row has no distribution
        out[i:i + ROWS] = np.where(np.isfinite(kl) & ~broken, np.maximum(kl, 0.0), np.nan)
    return out
