"""The KL a lossy storage format costs by itself: below that floor a measured divergence says nothing.

Captured cells are stored exactly (floor 0) unless the spec says `store: bf16`: then each row is
shifted by its max and rounded to bf16, and its KL(native || stored) is measured as it is written
(bf16_floor). A llama.cpp `--kl-divergence-base` file rounds each
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

