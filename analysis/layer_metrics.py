"""Per-layer agreement of a stack with its reference, gated as in NVIDIA TensorRT-Edge-LLM's few-layer
numeric validation guide: cosine, norm ratio, relative L2 error, max |Δ| and an allclose flag per row,
summarised per layer, and the first layer that fails the cosine / norm-ratio gates.

Cosine is blind to a dropped or doubled scale factor; the norm ratio is exactly the freedom it
throws away, and it is tight because quantisation noise largely cancels in a ratio (that guide's
"Why two gates"). allclose is reported, never a gate: absolute error follows each tensor's range.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ATOL = RTOL = 2e-2  # the allclose defaults of TensorRT-Edge-LLM's few-layer validation (reported, not gating)


def row_metrics(ref: np.ndarray, got: np.ndarray, atol: float = ATOL, rtol: float = RTOL) -> dict[str, np.ndarray]:
    """ref, got: (rows, hidden) float -> per-row metrics, computed in float64."""
    a, b = ref.astype(np.float64), got.astype(np.float64)  # (rows, hidden)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)  # (rows,)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = (a * b).sum(-1) / (na * nb)
        ratio = nb / na
        rel = np.linalg.norm(b - a, axis=-1) / na
    return {
        "cosine": cos,
        "norm_ratio": ratio,
        "rel_l2": rel,
        "max_abs_diff": np.abs(b - a).max(-1),
        "allclose": np.isclose(b, a, atol=atol, rtol=rtol).all(-1),
    }


def depth(name: str) -> float:
    """Order of a state in the model: layer.N by N, the final norm after every layer."""
    return float("inf") if name == "final_norm" else float(name.split(".", 1)[1])


def summarize(per_layer: dict[str, dict[str, np.ndarray]], keys: list[Any]) -> list[dict[str, Any]]:
    """per_layer: {state name: row_metrics}; keys: what each row is (e.g. (prompt, position)).
    One row per layer, shallowest first, with the row where each gate is worst."""
    out = []
    for name in sorted(per_layer, key=depth):
        m = per_layer[name]
        dev = np.abs(m["norm_ratio"] - 1.0)
        ic, ir = int(np.nanargmin(m["cosine"])), int(np.nanargmax(dev))
        out.append(
            {
                "layer": name,
                "rows": len(keys),
                "cosine_min": float(m["cosine"][ic]),
                "cosine_worst_at": keys[ic],
                "cosine_mean": float(np.nanmean(m["cosine"])),
                "norm_ratio_dev_max": float(dev[ir]),
                "norm_ratio_worst_at": keys[ir],
                "norm_ratio_at_worst": float(m["norm_ratio"][ir]),
                "rel_l2_max": float(np.nanmax(m["rel_l2"])),
                "max_abs_diff": float(m["max_abs_diff"].max()),
                "allclose_share": float(m["allclose"].mean()),
            }
        )
    return out


def verdict(summary: list[dict[str, Any]], cosine_min: float, norm_ratio_tol: float) -> dict[str, Any]:
    """The first layer (shallowest) that fails a gate, and which gates; None where all pass."""
    for row in summary:
        failed = [
            g
            for g, bad in (
                ("cosine_min", not row["cosine_min"] >= cosine_min),
                ("norm_ratio_tol", not row["norm_ratio_dev_max"] <= norm_ratio_tol),
            )
            if bad
        ]
        if failed:
            return {"pass": False, "first_failing_layer": row["layer"], "failed": failed, "row": row}
    return {"pass": True, "first_failing_layer": None, "failed": [], "row": None}
