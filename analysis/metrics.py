"""Per-row comparison metrics between two stacks' logits at the same (prompt, position).

Every input is (rows, vocab) raw logits; every output is (rows,). All arithmetic is
float64 (inputs are widened inside the kernel), so the numbers match an
independent float64 implementation (scipy) to ~1e-15, not merely to 1e-9.

    ref  (rows, vocab) --log_softmax--> lp, p      P_ref
    stk  (rows, vocab) --log_softmax--> lq, q      P_stack        d = lq - lp
    kld         = KL(P_ref || P_stack) = sum(q - p - p*d)     (llama.cpp's direction)
    kld_reverse = KL(P_stack || P_ref) = sum(p - q + q*d)
    js          = sum(p*lp + q*lq - 2*m*log m) / 2,  m = (p + q) / 2,  natural log (<= ln 2)

Each KL term q - p - p*d = p*(e^d - 1 - d) is >= 0 mathematically and needs no
transcendental beyond the two exps of the softmax; its rounding error is ~1e-16 * p,
so a row's KL is exact to ~1e-15. A sum below zero by more than that is a bug and
raises (never clamped); within it, it is reported as 0. Identical rows give exact zeros.

Speed: the full-vocab sums are one C kernel (analysis/metrics_kernel.c, built for the machine
on first use: three vectorised passes over a row pair instead of ~25 numpy passes, rows spread
over the CPUs), with _reduce_numpy, the same arithmetic, where no compiler is. Top-k uses
block maxima so no full sort or partition runs over the vocabulary. No torch: a process that
measures pays no torch import and no JIT. benchmarks/analysis_throughput.py prints the figures.
"""

from __future__ import annotations

import numpy as np

from analysis import metrics_native
from store.values import Bf16Rows

# Bump when any metric's definition or arithmetic changes: `matrix analyze` recomputes every
# output written by another version (the metrics tables record it in kernel_version).
# 2: nll_ref / nll_stack (perplexity) beside delta_p; 3: the C kernel's exp, log and sums;
# 4: p and q from the denominators' exps (e^(x - max) / sum), not a second exp of x - logsumexp;
# 5: p_top1_ref, the reference's top-1 probability
KERNEL_VERSION = "5"
NEG_TOLERANCE = -1e-12
ROWS = 16  # rows per numpy pass: (16, 262144) float64 temporaries stay ~34 MB
BLOCK = 64  # top-k candidates come from the K blocks of 64 logits with the highest maxima
K = 10
# the kernel's per-row sums, in metrics_kernel.c's order
OUTS = ("kld", "kld_reverse", "js", "h_ref", "h_stk", "rs", "rr", "sq", "dsq", "mad", "lse_ref", "lse_stk")


class MetricError(ValueError):
    pass


def _reduce_numpy(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y: (rows, vocab) logits of one float dtype -> ((rows, 12) float64 sums in OUTS order,
    (rows, blocks) block maxima of each). The reference arithmetic the C kernel follows."""
    out, bmaxes = [], []
    for i in range(0, x.shape[0], ROWS):
        o, bx, by = _reduce_block(x[i : i + ROWS], y[i : i + ROWS])
        out.append(o)
        bmaxes.append((bx, by))
    return (
        np.concatenate(out) if out else np.empty((0, len(OUTS))),
        *(
            np.concatenate([b[j] for b in bmaxes]) if bmaxes else np.empty((0, x.shape[1] // BLOCK), x.dtype)
            for j in (0, 1)
        ),
    )


def _reduce_block(x: np.ndarray, y: np.ndarray):
    n, vocab = x.shape
    r, s = x.astype(np.float64), y.astype(np.float64)  # (rows, vocab)
    nb = vocab // BLOCK
    bmax_r = x[:, : nb * BLOCK].reshape(n, nb, BLOCK).max(-1)  # (rows, blocks), for top-k
    bmax_s = y[:, : nb * BLOCK].reshape(n, nb, BLOCK).max(-1)
    mr, ms = x.max(-1, keepdims=True).astype(np.float64), y.max(-1, keepdims=True).astype(np.float64)  # (rows, 1)
    with np.errstate(all="ignore"):  # a masked (-inf) or broken row: its sums say so (finite flags)
        er, es = np.exp(r - mr), np.exp(s - ms)  # (rows, vocab)
        sr, ss = er.sum(-1, keepdims=True), es.sum(-1, keepdims=True)
        lser, lses = mr + np.log(sr), ms + np.log(ss)  # (rows, 1) logsumexp
        lp, lq = r - lser, s - lses
        p, q = er * (1.0 / sr), es * (1.0 / ss)  # the softmax from the same exps: no second exp
        d = lq - lp
        m = 0.5 * (p + q)
        mlm = np.where(m > 0, m * np.log(m), 0.0)  # 0 log 0 = 0
        diff = s - r
        cols = [
            (q - p - p * d).sum(-1),
            (p - q + q * d).sum(-1),
            (0.5 * (p * lp + q * lq) - mlm).sum(-1),
            -(p * lp).sum(-1),
            -(q * lq).sum(-1),
            (r * s).sum(-1),
            (r * r).sum(-1),
            (s * s).sum(-1),
            (diff * diff).sum(-1),
            np.abs(diff).max(-1),
            lser[:, 0],
            lses[:, 0],
        ]
    return np.stack(cols, -1), bmax_r, bmax_s


def _reduce_native(x: np.ndarray, y: np.ndarray):
    return metrics_native.reduce(x, y, BLOCK)


def _gather(x: np.ndarray | Bf16Rows, idx: np.ndarray) -> np.ndarray:
    """(rows, k) ids -> the logits of x at them, (rows, k) in x's float dtype."""
    return x.gather(idx) if isinstance(x, Bf16Rows) else np.take_along_axis(x, idx, 1)


_KERNEL = None  # chosen on first use


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _reduce_native if metrics_native.load() is not None else _reduce_numpy
    return _KERNEL


def kernel_mode() -> str:
    """'native' (the C kernel, analysis/metrics_kernel.c) or 'numpy'; LOGIT_MATRIX_COMPILE=0 forces numpy."""
    return "native" if _kernel() is _reduce_native else "numpy"


def warm(vocab: int) -> None:
    """Build (or load from the cache) the kernel before the rows come."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, vocab), dtype=np.float32)  # (2, vocab): float32, as the rows come
    row_metrics(a, a + np.float32(1e-3) * rng.standard_normal((2, vocab), dtype=np.float32))


def _topk(x: np.ndarray | Bf16Rows, bmax: np.ndarray) -> np.ndarray:
    """(rows, vocab) logits, (rows, blocks) block maxima -> (rows, K) ids of the K largest, descending;
    ties go to the lower id (as numpy's argmax). The K largest lie in the K blocks with the largest
    maxima (any block holding one of them has a maximum >= the K-th largest), plus the tail."""
    rows, vocab = x.shape
    nb = bmax.shape[1]
    blocks = _largest(bmax, min(K, nb))  # (rows, kb) ascending; the lower block first on ties
    cand = (blocks[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(rows, -1)  # (rows, kb*BLOCK)
    tail = np.broadcast_to(np.arange(nb * BLOCK, vocab), (rows, vocab - nb * BLOCK))
    cand = np.concatenate([cand, tail], 1)  # ascending ids
    vals = _gather(x, cand)
    k = min(K, cand.shape[1])
    pick = _largest(vals, k)  # positions in cand of the k largest, ascending
    cand, vals = np.take_along_axis(cand, pick, 1), np.take_along_axis(vals, pick, 1)
    order = np.lexsort((cand, -vals), axis=-1)  # value descending, then lower id
    return np.take_along_axis(cand, order, 1)


def _largest(v: np.ndarray, k: int) -> np.ndarray:
    """(rows, n) values, 1 <= k -> (rows, min(k, n)) column indices, ascending, of the k largest values
    of each row, the lower index first among equal values: the first k of a stable descending sort,
    found by a partition, which costs a fraction of sorting each row's n values."""
    rows, n = v.shape
    if k >= n:
        return np.broadcast_to(np.arange(n), (rows, n))
    nan = np.isnan(v).any(-1)
    if nan.any():  # a stable descending sort puts NaN after every number; a partition cannot: those rows sort
        out = np.empty((rows, k), np.intp)
        out[nan] = np.sort(np.argsort(-v[nan], axis=-1, kind="stable")[:, :k], -1)
        out[~nan] = _largest(v[~nan], k)
        return out
    kth = np.partition(v, n - k, axis=-1)[:, n - k : n - k + 1]  # (rows, 1): the k-th largest
    above = v > kth
    tied = v == kth
    take = above | tied
    # where more values equal the k-th largest than the larger leave room for, the lowest indices
    fill = k - above.sum(-1)
    over = np.flatnonzero(tied.sum(-1) > fill)
    if len(over):
        take[over] = above[over] | (tied[over] & (np.cumsum(tied[over], -1) <= fill[over, None]))
    return np.nonzero(take)[1].reshape(rows, k)


def _ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks (1-based, ties share their mean rank) along the last axis of a (rows, k) array."""
    less = (v[:, None, :] < v[:, :, None]).sum(-1)
    eq = (v[:, None, :] == v[:, :, None]).sum(-1)
    return less + (eq + 1) / 2.0


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(rows, k) float64 values of the same k ids on two sides -> (rows,) Spearman rank correlation
    (NaN where one side's k values are all equal)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.maximum(den, 1e-300), np.nan)


def _overlap(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    return (a[:, :k, None] == b[:, None, :k]).any(-1).sum(-1) / k


def _sums(ref: np.ndarray | Bf16Rows, stk: np.ndarray | Bf16Rows):
    """The kernel's (rows, 12) sums and (rows, blocks) block maxima of each side. Stored bf16 rows
    go to the kernel as they are where it is built; the numpy twin takes them widened."""
    if isinstance(ref, Bf16Rows) and isinstance(stk, Bf16Rows) and _kernel() is _reduce_native:
        return metrics_native.reduce_bf16(ref, stk, BLOCK)
    return _kernel()(*(a.widened() if isinstance(a, Bf16Rows) else a for a in (ref, stk)))


def _metrics(ref: np.ndarray | Bf16Rows, stk: np.ndarray | Bf16Rows, nxt: np.ndarray) -> dict[str, np.ndarray]:
    sums, bmax_r, bmax_s = _sums(ref, stk)  # (rows, 12), (rows, blocks) x2
    kld, kldr, js, h_ref, h_stk, rs, rr, sq, dsq, mad, lser, lses = sums.T
    tr, ts = _topk(ref, bmax_r), _topk(stk, bmax_s)  # (rows, K) ids, descending
    spear = spearman(_gather(ref, tr).astype(np.float64), _gather(stk, tr).astype(np.float64))
    has = nxt >= 0
    nid = np.where(has, nxt, 0)[:, None]
    ref_next = _gather(ref, nid)[:, 0].astype(np.float64)
    ref_top = _gather(ref, tr[:, :1])[:, 0].astype(np.float64)
    stk_next = _gather(stk, nid)[:, 0].astype(np.float64)
    with np.errstate(all="ignore"):  # zero norms and broken rows: flagged below, as IEEE gives them
        p_next, q_next = np.exp(ref_next - lser), np.exp(stk_next - lses)
        rn, sn = np.sqrt(rr), np.sqrt(sq)
        return {
            "kld": kld.copy(),
            "kld_reverse": kldr.copy(),
            "js": js.copy(),
            "top1_match": tr[:, 0] == ts[:, 0],
            "top5_overlap": _overlap(tr, ts, 5),
            "top10_overlap": _overlap(tr, ts, 10),
            "spearman_top10": spear,
            "cosine": rs / (rn * sn),
            "norm_ratio": sn / rn,
            "nmse": dsq / rr,
            "max_abs_diff": mad.copy(),
            "delta_p": np.where(has, q_next - p_next, np.nan),
            # -log p(next token) of each side, from the same log-sum-exp: a prompt's perplexity is
            # exp(mean nll) over its rows (llama-perplexity's PPL of its scored half)
            "nll_ref": np.where(has, lser - ref_next, np.nan),
            "nll_stack": np.where(has, lses - stk_next, np.nan),
            "entropy_ref": h_ref.copy(),
            "entropy_stack": h_stk.copy(),
            # how sure the reference is: exp(its top-1 logit - its logsumexp), <= 1 (kld_by_confidence)
            "p_top1_ref": np.exp(ref_top - lser),
            "_finite_ref": np.isfinite(rr),
            "_finite_stk": np.isfinite(sq),  # a NaN/Inf poisons the sums
        }


def _floats(ref: np.ndarray, stk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides in one float dtype, C-contiguous."""
    if ref.dtype != stk.dtype or ref.dtype not in (np.float32, np.float64):
        kind = np.float64 if np.float64 in (ref.dtype, stk.dtype) or ref.dtype != stk.dtype else np.float32
        ref, stk = ref.astype(kind), stk.astype(kind)  # exact: f16 and bf16 widen to either
    return np.ascontiguousarray(ref), np.ascontiguousarray(stk)


def row_metrics(
    ref: np.ndarray | Bf16Rows, stk: np.ndarray | Bf16Rows, next_ids: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """ref, stk: (rows, vocab) raw logits (float32 widened from the native type, or float64), or
    stored bf16 rows with their shift (Bf16Rows: the same values, without a widened copy);
    next_ids: (rows,) the token that follows each position, -1 at the last position.

    Rows with NaN/Inf on either side come back with NaN metrics and a `nonfinite` entry
    ('reference' | 'stack' | 'both'; None for a clean row) so callers flag them, never average them."""
    if ref.shape != stk.shape or len(ref.shape) != 2:
        raise MetricError(f"shape mismatch {ref.shape} vs {stk.shape}")
    if isinstance(ref, Bf16Rows) != isinstance(stk, Bf16Rows):  # one side stored, the other not
        ref, stk = (a.widened() if isinstance(a, Bf16Rows) else a for a in (ref, stk))
    if not isinstance(ref, Bf16Rows):
        ref, stk = _floats(ref, stk)
    n = ref.shape[0]
    nxt = np.asarray(next_ids if next_ids is not None else np.full(n, -1), dtype=np.int64)
    if n == 0:
        return {"kld": np.array([])}
    out = _metrics(ref, stk, nxt)
    fr, fs = out.pop("_finite_ref"), out.pop("_finite_stk")
    same = out["max_abs_diff"] == 0.0  # identical rows (a row with a NaN is flagged below whatever this says)
    for k in ("kld", "kld_reverse", "js", "nmse"):
        out[k][same] = 0.0
    out["delta_p"][same & (out["delta_p"] == out["delta_p"])] = 0.0
    out["cosine"][same] = 1.0
    out["norm_ratio"][same] = 1.0
    out["spearman_top10"][same] = 1.0
    for k in ("kld", "kld_reverse", "js"):
        v = out[k]
        bad = (v < NEG_TOLERANCE) & fr & fs
        if bad.any():  # cannot happen: the terms are >= 0 up to ~1e-16 * p each
            raise MetricError(f"{k} {v[bad].min():.3e} < 0 in rows {np.flatnonzero(bad)[:5].tolist()}")
        v[v < 0] = 0.0  # rounding only (> -1e-12, vs a ~1e-15 error bound)
    nonfinite = np.array(
        [None if a and b else "stack" if a else "reference" if b else "both" for a, b in zip(fr, fs)], dtype=object
    )
    if not (fr & fs).all():
        for v in out.values():
            if v.dtype.kind == "f":
                v[~(fr & fs)] = np.nan
        out["top1_match"][~(fr & fs)] = False
    out["nonfinite"] = nonfinite
    return out
