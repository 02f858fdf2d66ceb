"""What llama-perplexity prints for --kl-divergence, from a cell's metrics rows.

The formulas are tools/perplexity/perplexity.cpp's (llama.cpp): the mean ± its standard error
sqrt((E[x^2] - E[x]^2) / (n - 1)); PPL = exp(mean NLL) with the error carried through exp; the
covariance of the two NLLs for the ratio's error; percentiles by linear interpolation between the
sorted values; Δp = p_candidate(next token) - p_reference(next token); RMS Δp with its error
0.5 / RMS * s.e.(Δp²); same top p as a binomial share. Each row's inputs (KL, Δp, the two NLLs,
top-1 agreement) are the metrics `matrix analyze` or the capturing process wrote, in float64.
"""

from __future__ import annotations

import math

import numpy as np

KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DP_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


def mean_se(x: np.ndarray) -> tuple[float, float]:
    """perplexity.cpp mean_and_uncertainty: no error below 11 values."""
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    f = float(x.mean())
    var = float((x * x).mean()) - f * f
    return f, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """perplexity.cpp covariance: the covariance of the two means (0 below 10 values)."""
    n = len(a)
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def percentile(sorted_x: np.ndarray, fraction: float) -> float:
    return float(np.quantile(sorted_x, fraction, method="linear"))


def stats(kld: np.ndarray, delta_p: np.ndarray, nll: np.ndarray, nll_ref: np.ndarray, same_top: np.ndarray) -> dict:
    """Every figure of llama-perplexity's closing statistics; arrays are (rows,) float64 / bool.
    No rows (every row non-finite): {"rows": 0} alone."""
    n = len(kld)
    if n == 0:
        return {"rows": 0}
    lp, lp_se = mean_se(nll)
    lb, lb_se = mean_se(nll_ref)
    cov = covariance(nll, nll_ref)
    ratio_se = math.sqrt(max(lp_se**2 + lb_se**2 - 2 * cov, 0.0))
    ppl, ppl_ref = math.exp(lp), math.exp(lb)
    ppl_se, ppl_ref_se = ppl * lp_se, ppl_ref * lb_se
    ks, ds = np.sort(kld), np.sort(delta_p)
    mse, mse_se = mean_se(delta_p**2)
    rms = math.sqrt(mse)
    top = float(same_top.mean()) if n else 0.0
    return {
        "rows": n,
        "ppl": [ppl, ppl_se],
        "ppl_ref": [ppl_ref, ppl_ref_se],
        "ln_ppl_correlation": cov / (lp_se * lb_se) if lp_se and lb_se else None,
        "ln_ppl_ratio": [lp - lb, ratio_se],
        "ppl_ratio": [math.exp(lp - lb), math.exp(lp - lb) * ratio_se],
        "ppl_diff": [ppl - ppl_ref, math.sqrt(max(ppl_se**2 + ppl_ref_se**2 - 2 * ppl * ppl_ref * cov, 0.0))],
        "kld": list(mean_se(kld)),
        "kld_max": float(ks[-1]),
        "kld_median": percentile(ks, 0.5),
        "kld_min": float(ks[0]),
        "kld_percentiles": {f"{q:.1%}": percentile(ks, q) for q in KLD_PERCENTILES},
        "delta_p": list(mean_se(delta_p)),
        "delta_p_max": float(ds[-1]),
        "delta_p_median": percentile(ds, 0.5),
        "delta_p_min": float(ds[0]),
        "delta_p_percentiles": {f"{q:.1%}": percentile(ds, q) for q in DP_PERCENTILES},
        "rms_delta_p": [rms, 0.5 / rms * mse_se if rms else 0.0],
        "same_top_p": [top, math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0],
    }


def cell_stats(con, cell_id: str) -> dict:
    """stats() over a cell's scored rows (repeat 0, both sides finite, a next token to score), with
    the count of rows left out for non-finite logits."""
    t = con.execute(
        """SELECT kld, delta_p, nll_stack, nll_ref, top1_match FROM metrics
                       WHERE cell_id = ? AND repeat = 0 AND nonfinite IS NULL AND nll_stack IS NOT NULL
                       ORDER BY prompt_id, position""",
        [cell_id],
    ).fetchnumpy()
    left_out = con.execute(
        "SELECT count(*) FROM metrics WHERE cell_id = ? AND repeat = 0 AND nonfinite IS NOT NULL", [cell_id]
    ).fetchone()[0]
    out = stats(
        *(np.asarray(t[k], dtype=np.float64) for k in ("kld", "delta_p", "nll_stack", "nll_ref")),
        np.asarray(t["top1_match"], dtype=bool),
    )
    return {**out, "nonfinite_rows": int(left_out)}


def _pm(v: list, pct: bool = False) -> str:
    """value ± error as perplexity.cpp prints it (%10.6lf ± %10.6lf; percentages %6.3lf ± %5.3lf %%)."""
    if pct:
        return f"{100 * v[0]:6.3f} ± {100 * v[1]:5.3f} %"
    return f"{v[0]:10.6f} ± {v[1]:10.6f}"


def text(s: dict) -> list[str]:
    """The statistics as llama-perplexity lays them out (it prints none below 100 rows; these
    say how few there are)."""
    head = [f"{s['nonfinite_rows']} row(s) left out: non-finite logits"] if s.get("nonfinite_rows") else []
    if s["rows"] == 0:
        return head + ["no scored rows to measure"]
    if s["rows"] < 100:
        head.append(f"only {s['rows']} scored rows: llama-perplexity prints no statistics below 100")
    cor = s["ln_ppl_correlation"]
    out = head + [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {_pm(s['ppl'])}",
        f"Mean PPL(base)                : {_pm(s['ppl_ref'])}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {'n/a' if cor is None else f'{100 * cor:6.2f}%'}",
        f"Mean ln(PPL(Q)/PPL(base))     : {_pm(s['ln_ppl_ratio'])}",
        f"Mean PPL(Q)/PPL(base)         : {_pm(s['ppl_ratio'])}",
        f"Mean PPL(Q)-PPL(base)         : {_pm(s['ppl_diff'])}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {_pm(s['kld'])}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
    ]
    p = s["kld_percentiles"]
    out += [f"{q:>5}   KLD: {p[q]:10.6f}" for q in list(p)[:4]] + [f"Median  KLD: {s['kld_median']:10.6f}"]
    out += [f"{q:>5}   KLD: {p[q]:10.6f}" for q in list(p)[4:]] + [f"Minimum KLD: {s['kld_min']:10.6f}", ""]
    d = s["delta_p_percentiles"]
    out += [
        "====== Token probability statistics ======",
        f"Mean    Δp: {_pm(s['delta_p'], pct=True)}",
        f"Maximum Δp: {100 * s['delta_p_max']:6.3f}%",
    ]
    out += [f"{q:>5}   Δp: {100 * d[q]:6.3f}%" for q in list(d)[:5]] + [
        f"Median  Δp: {100 * s['delta_p_median']:6.3f}%"
    ]
    out += [f"{q:>5}   Δp: {100 * d[q]:6.3f}%" for q in list(d)[5:]] + [f"Minimum Δp: {100 * s['delta_p_min']:6.3f}%"]
    out += [f"RMS Δp    : {_pm(s['rms_delta_p'], pct=True)}", f"Same top p: {_pm(s['same_top_p'], pct=True)}"]
    return out
