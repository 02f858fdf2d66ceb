"""Divergence from a top-k fixture: bounded KL when only the
reference's top-k logits and the logsumexp of its full row are kept.

The logsumexp makes the reference's tail mass T = 1 - sum(top-k probabilities) exact, so

    KL_coarse = sum_topk p log(p/q) + T log(T / Q_tail)         (top-k + one "rest" bucket)
    KL_coarse <= KL(P || Q) <= KL_coarse + T * log( (p_k / T) * (Q_tail / q_min_tail) )

The lower end is KL between the coarse-grained distributions (data processing inequality);
the upper end holds because every tail p_j <= p_k, the smallest top-k probability. Gates
apply to the lower end (a stack failing it certainly fails); the upper end is printed beside.
"""

from __future__ import annotations

import numpy as np

from analysis import aggregates as A
from analysis import metrics as M
from common import metric_defs as D

NOTE = (
    "KL over the top-k plus one tail bucket: a lower bound of the full KL; upper_bound adds the "
    "largest the tail can contribute (every tail p <= the k-th probability). cosine, norm ratio, max |diff| "
    "and NMSE are over the top-k logits only; Spearman over the reference's top-10."
)


# a metric's per-row values where truncated_metrics has them under another name
TOPK_COLUMNS = {
    "cosine": "cosine_topk",
    "norm_ratio": "norm_ratio_topk",
    "max_abs_diff": "max_abs_diff_topk",
    "nmse": "nmse_topk",
}


def topk_rows(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, vocab) float32 -> top-k ids (rows, k) descending (ties: lower id), their logits,
    and the float64 logsumexp of each full row (rows,)."""
    x = logits.astype(np.float64)
    mx = x.max(-1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(x - mx).sum(-1))  # (rows,)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # (rows, k)
    return top, np.take_along_axis(logits, top, -1), lse


def truncated_metrics(
    topk_ids: np.ndarray, topk_logits: np.ndarray, lse: np.ndarray, stack: np.ndarray
) -> dict[str, np.ndarray]:
    """Fixture rows (top-k ids (rows, k), their logits, full-row logsumexp) vs a stack's full logits
    (rows, vocab). Returns per-row coarse KL (a lower bound), its upper bound, JS of the coarse
    distributions, top-1 match, cosine / norm ratio / max |diff| / NMSE over the top-k logits, and
    Spearman over the reference's top-10 (as the full-row kernel)."""
    s = stack.astype(np.float64)  # (rows, vocab)
    m = s.max(-1, keepdims=True)
    lq = s - (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))  # (rows, vocab) stack log-probs
    lp_k = topk_logits.astype(np.float64) - lse[:, None]  # (rows, k) reference log-probs, exact
    p_k, lq_k = np.exp(lp_k), np.take_along_axis(lq, topk_ids, -1)
    q_k = np.exp(lq_k)
    tail_p = np.clip(1.0 - p_k.sum(-1), 0.0, 1.0)  # (rows,)
    tail_q = np.clip(1.0 - q_k.sum(-1), 1e-300, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(tail_p > 0, tail_p * np.log(tail_p / tail_q), 0.0)
        kl = (p_k * (lp_k - lq_k)).sum(-1) + rest
        mask = np.ones_like(lq, dtype=bool)
        np.put_along_axis(mask, topk_ids, False, -1)
        q_min_tail = np.where(mask, np.exp(lq), np.inf).min(-1)
        gap = np.where(
            tail_p > 0, tail_p * np.maximum(0.0, np.log(p_k.min(-1) / tail_p) + np.log(tail_q / q_min_tail)), 0.0
        )
        pm = np.concatenate([p_k, tail_p[:, None]], 1)
        qm = np.concatenate([q_k, tail_q[:, None]], 1)
        mm = 0.5 * (pm + qm)
        js = 0.5 * (np.where(pm > 0, pm * np.log(pm / mm), 0) + np.where(qm > 0, qm * np.log(qm / mm), 0)).sum(-1)
    sv = np.take_along_axis(s, topk_ids, -1)
    rv = topk_logits.astype(np.float64)
    return {
        "kld": np.maximum(kl, 0.0),
        "kld_upper": np.maximum(kl, 0.0) + gap,
        "tail_mass": tail_p,
        "js": js,
        "top1_match": topk_ids[:, 0] == stack.argmax(-1),
        "cosine_topk": (rv * sv).sum(-1) / np.linalg.norm(rv, axis=-1) / np.linalg.norm(sv, axis=-1),
        "norm_ratio_topk": np.linalg.norm(sv, axis=-1) / np.linalg.norm(rv, axis=-1),
        "max_abs_diff_topk": np.abs(sv - rv).max(-1),
        "nmse_topk": ((sv - rv) ** 2).sum(-1) / (rv**2).sum(-1),
        # the kernel's own Spearman, over the reference's top-10
        "spearman_top10": M.spearman(rv[:, :10], sv[:, :10]),
    }


def gate_values(m: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per-row metrics -> (values the gates read, from the lower bound; the upper bounds of the KL
    gates; the reference's tail mass)."""
    # the gates' aggregates (common/metric_defs.py), over the top-k logits where the fixture holds no more
    measured = A.numpy_values(D.GATES, m, TOPK_COLUMNS)
    upper = {
        gate: A.numpy_value(agg.kind, m["kld_upper"])
        for gate, (metric, agg) in D.gates().items()
        if metric.column == "kld"
    }
    tail = {"tail_mass_mean": float(m["tail_mass"].mean()), "tail_mass_max": float(m["tail_mass"].max())}
    return measured, upper, tail
