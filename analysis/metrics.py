"""Per-row comparison metrics between two stacks' logits at the same (prompt, position).

All distribution metrics use log-softmax in float64. Shapes: every input is
(rows, vocab); every output is (rows,).

    ref  (rows, vocab) --log_softmax--> lp, p = exp(lp)      P_ref
    stk  (rows, vocab) --log_softmax--> lq, q = exp(lq)      P_stack
    kld         = KL(P_ref || P_stack)   (llama.cpp's direction)
    kld_reverse = KL(P_stack || P_ref)
    js          = (KL(P||M) + KL(Q||M)) / 2, M = (P + Q) / 2, natural log (<= ln 2)

KL is summed as p * (expm1(d) - d) with d = lq - lp: every term is >= 0, so the
sum cannot go negative by cancellation, and equals KL because sum(p) = sum(q) = 1.
Identical rows short-circuit to exact zeros.
"""

from __future__ import annotations

import numpy as np

NEG_TOLERANCE = -1e-12
LN2 = float(np.log(2.0))


class MetricError(ValueError):
    pass


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)  # (rows, vocab)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _kl_terms(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row from log-probs, as a sum of non-negative terms."""
    d = lq - lp  # (rows, vocab)
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.exp(lp) * (np.expm1(d) - d)
    # p = 0 where q > 0 gives 0 * inf: that token contributes q - p = q (the generalised form's limit)
    bad = ~np.isfinite(t)
    if bad.any():
        t[bad] = np.exp(lq[bad]) - np.exp(lp[bad])
    return t.sum(axis=-1)


def kl(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    for name, x in (("P", lp), ("Q", lq)):
        mass = np.exp(x).sum(-1)
        if (np.abs(mass - 1.0) > 1e-9).any():
            raise MetricError(f"{name} is not a distribution (total probability {mass.max():.6g}); "
                              "a KL from it would be meaningless")
    out = _kl_terms(lp, lq)
    if (out < NEG_TOLERANCE).any():  # cannot happen with non-negative terms; never clamped
        raise MetricError(f"negative KL {out.min():.3e}")
    return out


def js(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    lm = np.logaddexp(lp, lq) - LN2
    return 0.5 * (kl(lp, lm) + kl(lq, lm))


def entropy(lp: np.ndarray) -> np.ndarray:
    return -(np.exp(lp) * lp).sum(axis=-1)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank), like scipy.stats.rankdata."""
    order = np.argsort(x, axis=-1, kind="stable")
    sx = np.take_along_axis(x, order, -1)
    n = x.shape[-1]
    ranks = np.empty_like(x, dtype=np.float64)
    for i in range(x.shape[0]):  # k is small (<= 10): a loop over rows with vector work inside
        v = sx[i]
        new = np.r_[True, v[1:] != v[:-1]]
        grp = np.cumsum(new) - 1
        starts = np.flatnonzero(new)
        ends = np.r_[starts[1:], n]
        avg = (starts + ends - 1) / 2.0 + 1
        ranks[i, order[i]] = avg[grp]
    return ranks


def spearman_topk(ref: np.ndarray, stk: np.ndarray, k: int) -> np.ndarray:
    """Spearman correlation of the reference's top-k tokens' logits in ref vs in stack."""
    idx = np.argpartition(-ref, k - 1, axis=-1)[:, :k]  # (rows, k)
    a = _ranks(np.take_along_axis(ref, idx, -1).astype(np.float64))
    b = _ranks(np.take_along_axis(stk, idx, -1).astype(np.float64))
    a -= a.mean(-1, keepdims=True)
    b -= b.mean(-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(-1) / np.where(den > 0, den, 1), np.nan)


def topk_overlap(ref: np.ndarray, stk: np.ndarray, k: int) -> np.ndarray:
    a = np.argpartition(-ref, k - 1, axis=-1)[:, :k]
    b = np.argpartition(-stk, k - 1, axis=-1)[:, :k]
    return np.array([len(np.intersect1d(x, y)) / k for x, y in zip(a, b)])


def row_metrics(ref: np.ndarray, stk: np.ndarray, next_ids: np.ndarray) -> dict[str, np.ndarray]:
    """ref, stk: (rows, vocab) raw logits (float32 widened from the native type);
    next_ids: (rows,) the token that follows each position, -1 at the last position."""
    if ref.shape != stk.shape:
        raise MetricError(f"shape mismatch {ref.shape} vs {stk.shape}")
    finite = np.isfinite(ref).all(-1) & np.isfinite(stk).all(-1)
    if not finite.all():
        raise MetricError(f"non-finite logits in rows {np.flatnonzero(~finite)[:5].tolist()}")
    same = (ref == stk).all(-1)  # (rows,)
    lp, lq = log_softmax64(ref), log_softmax64(stk)
    r64, s64 = ref.astype(np.float64), stk.astype(np.float64)
    diff = s64 - r64
    rn, sn = np.linalg.norm(r64, axis=-1), np.linalg.norm(s64, axis=-1)
    has_next = next_ids >= 0
    nid = np.where(has_next, next_ids, 0)[:, None]
    p_next = np.exp(np.take_along_axis(lp, nid, -1)[:, 0])
    q_next = np.exp(np.take_along_axis(lq, nid, -1)[:, 0])
    out = {
        "kld": kl(lp, lq), "kld_reverse": kl(lq, lp), "js": js(lp, lq),
        "top1_match": ref.argmax(-1) == stk.argmax(-1),
        "top5_overlap": topk_overlap(ref, stk, 5), "top10_overlap": topk_overlap(ref, stk, 10),
        "spearman_top10": spearman_topk(ref, stk, 10),
        "cosine": (r64 * s64).sum(-1) / (rn * sn), "norm_ratio": sn / rn,
        "nmse": (diff * diff).sum(-1) / (r64 * r64).sum(-1), "max_abs_diff": np.abs(diff).max(-1),
        "delta_p": np.where(has_next, q_next - p_next, np.nan),
        "entropy_ref": entropy(lp), "entropy_stack": entropy(lq),
    }
    for k in ("kld", "kld_reverse", "js", "nmse", "max_abs_diff"):
        out[k][same] = 0.0
    out["delta_p"][same & has_next] = 0.0
    out["cosine"][same] = 1.0
    out["norm_ratio"][same] = 1.0
    out["spearman_top10"][same] = 1.0
    return out
