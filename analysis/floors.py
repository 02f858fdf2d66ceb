"""The KL a lossy storage format costs by itself: below that floor a measured divergence says nothing.

Captured cells are stored exactly (floor 0). A llama.cpp `--kl-divergence-base` file rounds each
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
