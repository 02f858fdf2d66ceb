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

Speed: the full-vocab work is one fused kernel (torch.compile -> C++ loops; ~3 passes
over the data instead of ~25 numpy passes); top-k uses block maxima so no full sort or
partition runs over the vocabulary. benchmarks/analysis_throughput.py prints the figures.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

# Bump when any metric's definition or arithmetic changes: `matrix analyze` recomputes every
# output written by another version (the metrics tables record it in kernel_version).
KERNEL_VERSION = "2"  # 2: nll_ref / nll_stack (perplexity) beside delta_p
NEG_TOLERANCE = -1e-12
ROWS = 64  # rows per kernel call: (32, 151936) float64 temporaries stay cache-sized
BLOCK = 64  # top-k candidates come from the K blocks of 64 logits with the highest maxima
K = 10


class MetricError(ValueError):
    pass


def _reduce(x: torch.Tensor, y: torch.Tensor):
    """x, y: (rows, vocab) logits of any float dtype -> per-row float64 reductions."""
    r, s = x.to(torch.float64), y.to(torch.float64)  # (rows, vocab)
    nb = x.shape[-1] // BLOCK
    bmax_r = x[:, :nb * BLOCK].reshape(x.shape[0], nb, BLOCK).amax(-1)  # (rows, blocks), for top-k
    bmax_s = y[:, :nb * BLOCK].reshape(y.shape[0], nb, BLOCK).amax(-1)
    mr, ms = bmax_r.amax(-1, keepdim=True), bmax_s.amax(-1, keepdim=True)  # row max from the block maxima
    if nb * BLOCK < x.shape[-1]:
        mr = torch.maximum(mr, x[:, nb * BLOCK:].amax(-1, keepdim=True))
        ms = torch.maximum(ms, y[:, nb * BLOCK:].amax(-1, keepdim=True))
    mr, ms = mr.to(torch.float64), ms.to(torch.float64)
    sr, ss = torch.exp(r - mr).sum(-1, keepdim=True), torch.exp(s - ms).sum(-1, keepdim=True)
    lser, lses = mr + torch.log(sr), ms + torch.log(ss)  # (rows, 1) logsumexp
    lp, lq = r - lser, s - lses
    p, q = torch.exp(lp), torch.exp(lq)  # recomputed, not stored: cheaper than a (rows, vocab) f64 buffer
    d = lq - lp
    kld = (q - p - p * d).sum(-1)
    kldr = (p - q + q * d).sum(-1)
    m = 0.5 * (p + q)
    mlm = torch.where(m > 0, m * torch.log(m), torch.zeros_like(m))  # 0 log 0 = 0
    js = (0.5 * (p * lp + q * lq) - mlm).sum(-1)
    h_ref, h_stk = -(p * lp).sum(-1), -(q * lq).sum(-1)
    diff = s - r
    rs, rr, sq = (r * s).sum(-1), (r * r).sum(-1), (s * s).sum(-1)
    dsq, mad = (diff * diff).sum(-1), diff.abs().amax(-1)
    return (kld, kldr, js, h_ref, h_stk, rs, rr, sq, dsq, mad,
            lser[:, 0], lses[:, 0], bmax_r, bmax_s)


_KERNEL = None
_CHECKED = False  # the compiled kernel has run once


def kernel_mode() -> str:
    """'compiled' (torch.compile / inductor) or 'eager'; LOGIT_MATRIX_COMPILE=0 forces eager."""
    return "eager" if _kernel() is _reduce else "compiled"


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _reduce if os.environ.get("LOGIT_MATRIX_COMPILE", "1") == "0" else \
            torch.compile(_reduce, dynamic=False)
    return _KERNEL


def _run_kernel(ref: torch.Tensor, stk: torch.Tensor):
    global _KERNEL, _CHECKED
    fn = _kernel()
    if fn is _reduce or _CHECKED:
        return fn(ref, stk)
    try:  # the first call compiles: a machine without a C++ toolchain fails here
        out = fn(ref, stk)
    except Exception as e:  # noqa: BLE001 - reported, then the same arithmetic runs eagerly
        print(f"logit-matrix: torch.compile failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
              "metrics run eagerly (same float64 arithmetic, ~10x slower)", file=sys.stderr)
        _KERNEL = _reduce
        return _reduce(ref, stk)
    _CHECKED = True
    return out


def warm(vocab: int) -> None:
    """Compile (or load from inductor's cache) the kernel for this vocabulary before the rows
    come: the first call costs ~6 s on 2 cores (dynamo, the graph, the .so), the rows after it ~0.2 ms."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, vocab), dtype=np.float32)  # (2, vocab): float32, as the rows come
    row_metrics(a, a + np.float32(1e-3) * rng.standard_normal((2, vocab), dtype=np.float32))


def _topk(x: torch.Tensor, bmax: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) logits, (rows, blocks) block maxima -> (rows, K) ids of the K largest, descending;
    ties go to the lower id (as numpy's argmax). The K largest lie in the K blocks with the largest
    maxima (any block holding one of them has a maximum >= the K-th largest), plus the tail."""
    rows, vocab = x.shape
    nb = bmax.shape[1]
    kb = min(K, nb)
    blocks = torch.sort(torch.topk(bmax, kb, -1).indices, -1).values  # (rows, kb) ascending
    cand = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(rows, -1)  # (rows, kb*BLOCK) ascending
    tail = torch.arange(nb * BLOCK, vocab).expand(rows, -1)
    cand = torch.cat([cand, tail], 1)  # ascending ids, so the stable sort below keeps low ids first
    vals = torch.gather(x, 1, cand)
    k = min(K, cand.shape[1])
    if vals.dtype == torch.float32:
        # one int64 key per candidate: the float's bits made order-preserving, then the id inverted,
        # so topk's largest key is the largest value and, among equal values, the lowest id
        bits = vals.view(torch.int32).long()
        key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = (key << 32) | (0xFFFFFFFF - cand)
        return torch.gather(cand, 1, torch.topk(key, k, -1).indices)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.gather(cand, 1, order)


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based, ties share their mean rank) along the last axis of a (rows, k) tensor."""
    less = (v[:, None, :] < v[:, :, None]).sum(-1)
    eq = (v[:, None, :] == v[:, :, None]).sum(-1)
    return less.double() + (eq.double() + 1) / 2.0


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(rows, k) float64 values of the same k ids on two sides -> (rows,) Spearman rank correlation
    (NaN where one side's k values are all equal)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = ((ra * ra).sum(-1) * (rb * rb).sum(-1)).sqrt()
    return torch.where(den > 0, (ra * rb).sum(-1) / den.clamp_min(1e-300), torch.full_like(den, float("nan")))


def _overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    return (a[:, :k, None] == b[:, None, :k]).any(-1).sum(-1).double() / k


def _chunk(ref: torch.Tensor, stk: torch.Tensor, nxt: torch.Tensor) -> dict[str, torch.Tensor]:
    n = ref.shape[0]
    if n < 2:  # the compiled kernel takes any row count >= 2 (0 and 1 would be specialised)
        ref, stk = ref.expand(2, -1), stk.expand(2, -1)
    torch._dynamo.mark_dynamic(ref, 0)  # one compiled kernel per vocabulary, any row count
    torch._dynamo.mark_dynamic(stk, 0)
    (kld, kldr, js, h_ref, h_stk, rs, rr, sq, dsq, mad, lser, lses, bmax_r, bmax_s) = \
        (t[:n] for t in _run_kernel(ref, stk))
    ref, stk = ref[:n], stk[:n]
    tr, ts = _topk(ref, bmax_r), _topk(stk, bmax_s)  # (rows, K) ids, descending
    spear = spearman(torch.gather(ref, 1, tr).double(), torch.gather(stk, 1, tr).double())
    has = nxt >= 0
    nid = torch.where(has, nxt, 0)[:, None]
    p_next = torch.exp(torch.gather(ref, 1, nid)[:, 0].double() - lser)
    q_next = torch.exp(torch.gather(stk, 1, nid)[:, 0].double() - lses)
    rn, sn = rr.sqrt(), sq.sqrt()
    return {
        "kld": kld, "kld_reverse": kldr, "js": js,
        "top1_match": tr[:, 0] == ts[:, 0],
        "top5_overlap": _overlap(tr, ts, 5), "top10_overlap": _overlap(tr, ts, 10),
        "spearman_top10": spear,
        "cosine": rs / (rn * sn), "norm_ratio": sn / rn, "nmse": dsq / rr, "max_abs_diff": mad,
        "delta_p": torch.where(has, q_next - p_next, torch.full_like(p_next, float("nan"))),
        # -log p(next token) of each side, from the same log-sum-exp: a prompt's perplexity is
        # exp(mean nll) over its rows (llama-perplexity's PPL of its scored half)
        "nll_ref": torch.where(has, lser - torch.gather(ref, 1, nid)[:, 0].double(), torch.full_like(p_next, float("nan"))),
        "nll_stack": torch.where(has, lses - torch.gather(stk, 1, nid)[:, 0].double(), torch.full_like(p_next, float("nan"))),
        "entropy_ref": h_ref, "entropy_stack": h_stk,
        "_finite_ref": torch.isfinite(rr), "_finite_stk": torch.isfinite(sq),  # a NaN/Inf poisons the sums
    }


def row_metrics(ref: np.ndarray, stk: np.ndarray, next_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ref, stk: (rows, vocab) raw logits (float32 widened from the native type, or float64);
    next_ids: (rows,) the token that follows each position, -1 at the last position.

    Rows with NaN/Inf on either side come back with NaN metrics and a `nonfinite` entry
    ('reference' | 'stack' | 'both'; None for a clean row) so callers flag them, never average them."""
    if ref.shape != stk.shape or ref.ndim != 2:
        raise MetricError(f"shape mismatch {ref.shape} vs {stk.shape}")
    n = ref.shape[0]
    with warnings.catch_warnings():  # Arrow-backed arrays are read-only; nothing here writes to them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        rt, st = (torch.from_numpy(np.ascontiguousarray(x)) for x in (ref, stk))
    if rt.dtype != st.dtype:
        rt, st = rt.double(), st.double()
    nt = torch.from_numpy(np.asarray(next_ids if next_ids is not None else np.full(n, -1), dtype=np.int64))
    parts = [_chunk(rt[i:i + ROWS], st[i:i + ROWS], nt[i:i + ROWS]) for i in range(0, n, ROWS)]
    out = {k: torch.cat([p[k] for p in parts]).numpy() if parts else np.array([]) for k in
           (parts[0] if parts else {"kld": None})}
    if not parts:
        return out
    fr, fs = out.pop("_finite_ref"), out.pop("_finite_stk")
    same = out["max_abs_diff"] == 0.0  # identical rows (a NaN anywhere makes this False)
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
    nonfinite = np.array([None if a and b else "stack" if a else "reference" if b else "both"
                          for a, b in zip(fr, fs)], dtype=object)
    if not (fr & fs).all():
        for k, v in out.items():
            if v.dtype.kind == "f":
                v[~(fr & fs)] = np.nan
        out["top1_match"][~(fr & fs)] = False
    out["nonfinite"] = nonfinite
    return out
