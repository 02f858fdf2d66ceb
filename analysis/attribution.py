"""Which tensors cost the KL: each group of tensors raised (or lowered) alone on top of a base quant,
measured against the reference, ranked by KL removed per MiB added; then the upgrades applied
cumulatively in the ranking's order, each step a real file measured (matrix/api/attribute.py).

A group's ΔKL is the base's KL mean minus the variant's over the same scored rows; its error is the
paired one, the standard error of the per-row differences (the two files are measured on the same
tokens, so their noise largely cancels), by perplexity.cpp's mean_and_uncertainty.
"""

from __future__ import annotations

import math

import numpy as np

from analysis.kld_stats import mean_se

MIB = 1 << 20


def summary(stats: dict) -> dict:
    """The figures a quant author reads off each file: KL mean ± s.e., p99, p99.9, same top, PPL ratio."""
    if not stats.get("rows"):
        return {"rows": 0}
    p = stats["kld_percentiles"]
    return {
        "rows": stats["rows"],
        "kld": stats["kld"],
        "kld_p99": p["99.0%"],
        "kld_p99_9": p["99.9%"],
        "same_top_p": stats["same_top_p"],
        "ppl_ratio": stats["ppl_ratio"],
    }


def paired_delta(con, base_cell: str, cell: str) -> list[float]:
    """[mean, s.e.] of KL(base row) - KL(variant row) over the rows both scored: the KL a group's
    change removes (negative: it adds KL)."""
    t = con.execute(
        """SELECT b.kld AS b, v.kld AS v FROM metrics b JOIN metrics v
             ON b.prompt_id = v.prompt_id AND b.position = v.position AND b.repeat = v.repeat
           WHERE b.cell_id = ? AND v.cell_id = ? AND b.repeat = 0
             AND b.nonfinite IS NULL AND v.nonfinite IS NULL AND b.nll_stack IS NOT NULL
           ORDER BY b.prompt_id, b.position""",
        [base_cell, cell],
    ).fetchnumpy()
    d = np.asarray(t["b"], dtype=np.float64) - np.asarray(t["v"], dtype=np.float64)
    return list(mean_se(d))


def score(delta_kl: float, delta_bytes: int) -> float | None:
    """KL removed per MiB the file gains: a raise's KL removed per MiB added, and equally a lower's KL
    added per MiB saved (both signs flip). None where no byte moves."""
    return None if delta_bytes == 0 else delta_kl / (delta_bytes / MIB)


SAME_AS_BASE = (
    "its file is the base's, byte for byte: every tensor it names is already at that type in the base, "
    "or llama.cpp falls back to the base's type for it"
)
NOT_MEASURED = "its cell did not complete (the run says why)"


def rank(variants: list[dict], direction: str, base_sha256: str) -> list[dict]:
    """The variants of one direction in ranking order, each with `rank` (1-based) or, where its file
    is the base's or was not measured, `rank` None and `dropped` saying why.

    raise: one that removes KL without adding bytes comes first (most KL removed first), then those
    that add bytes by KL removed per MiB added, highest first; one that adds no bytes and removes no
    KL comes last. lower: by KL added per MiB saved, lowest first (the cheapest bytes to give up);
    one that saves no bytes comes last."""
    dropped = [
        {**v, "rank": None, "dropped": SAME_AS_BASE if v["sha256"] == base_sha256 else NOT_MEASURED}
        for v in variants
        if v["sha256"] == base_sha256 or v.get("delta_kl") is None
    ]
    kept = [v for v in variants if v["sha256"] != base_sha256 and v.get("delta_kl") is not None]
    if direction == "raise":
        free = sorted(
            (v for v in kept if v["delta_bytes"] <= 0 and v["delta_kl"][0] > 0), key=lambda v: -v["delta_kl"][0]
        )
        paid = sorted((v for v in kept if v["delta_bytes"] > 0), key=lambda v: -v["score"])
        order = free + paid + [v for v in kept if v["delta_bytes"] <= 0 and v["delta_kl"][0] <= 0]
    else:
        saving = sorted((v for v in kept if v["delta_bytes"] < 0), key=lambda v: v["score"])
        order = saving + [v for v in kept if v["delta_bytes"] >= 0]
    return [{**v, "rank": i + 1, "dropped": None} for i, v in enumerate(order)] + dropped


def frontier_order(ranked: list[dict]) -> list[dict]:
    """The raises that remove KL, in ranking order: the steps of the cumulative frontier."""
    return [v for v in ranked if v["rank"] is not None and v["delta_kl"][0] > 0]


def fmt_mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def table(result: dict) -> list[str]:
    """The ranking and the frontier as markdown, for the terminal and the docs."""
    base = result["base"]
    if not base["summary"].get("rows"):
        return [f"base {result['recipe']}: no scored rows (every row non-finite, or the text too short)"]
    out = [
        f"base {result['recipe']}: {fmt_mib(base['size']['file_bytes'])} MiB, "
        f"{base['size']['bits_per_weight']:.3f} bpw, KL {_pm(base['summary']['kld'])}",
        "",
    ]
    for direction in ("raise", "lower"):
        rows = [v for v in result["variants"] if v["direction"] == direction]
        if not rows:
            continue
        verb = "KL removed per MiB added" if direction == "raise" else "KL added per MiB saved"
        out += [
            f"| rank | group | {direction} to | tensors (types in the file) | others moved | ΔMiB | ΔKL (paired) "
            f"| {verb} |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for v in rows:
            types = ", ".join(f"{n} {t}" for t, n in sorted(v["types"].items()))
            sc = "—" if v["score"] is None else f"{v['score']:.3g}"
            rk = (
                v["rank"]
                if v["rank"] is not None
                else ("dropped: the base's file" if v["dropped"] == SAME_AS_BASE else "dropped: not measured")
            )
            out.append(
                f"| {rk} | {v['group']} | {v['type']} | {types} | {len(v['changed_outside'])} | "
                f"{v['delta_bytes'] / MIB:+.3f} | "
                f"{'—' if v['delta_kl'] is None else _pm(v['delta_kl'])} | {sc} |"
            )
        out.append("")
    if result["frontier"]:
        out += [
            "| step | groups raised | MiB | bpw | KL mean ± s.e. | KL p99.9 | same top |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in result["frontier"]:
            s = p["summary"]
            out.append(
                f"| {p['step']} | {', '.join(p['groups']) or '(base)'} | {fmt_mib(p['size']['file_bytes'])} | "
                f"{p['size']['bits_per_weight']:.3f} | {_pm(s['kld'])} | {s['kld_p99_9']:.4g} | "
                f"{100 * s['same_top_p'][0]:.2f} % |"
            )
    return out


def _pm(v: list) -> str:
    return f"{v[0]:.4g} ± {v[1]:.2g}" if v[1] and math.isfinite(v[1]) else f"{v[0]:.4g}"
