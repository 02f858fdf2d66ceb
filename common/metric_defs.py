"""The per-row metrics and their aggregates, declared once for every layer that shows them.

A metric is one column of the `metrics` table: one output of `analysis.metrics.row_metrics` per
row, stored under the same name (store/schema.py METRICS holds its Parquet type). Its aggregates
are what the views, the admission gates and the model card show of it, each under the column name
it has there. `analysis/aggregates.py` turns them into SQL (and into numpy where a caller holds the
rows in memory); nothing else writes `avg(kld)` or its siblings by hand.

Adding a metric: compute it per row in `analysis/metrics.py` `_metrics` (bump KERNEL_VERSION so
`matrix analyze` recomputes older files), give it a nullable column in store/schema.py METRICS
(with a migration), and declare it below with the aggregates that show it. The views, gates and
card pick it up from here. The views over other tables (centroid, layer, side-path and plug-in
metrics) name their figures where they select them, each through one of the KINDS below
(`analysis.aggregates.agg`).

Plain data only (no numpy, no pyarrow): store/, analysis/ and the driver all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where an aggregate is shown: the views of analysis/sql.py, the gates of analysis/gates.py (and the
# fixture gates of analysis/truncated.py), the numbers of a model card (analysis/card.py).
SUMMARY, BY_RANGE, BY_CONFIDENCE, GATES, CARD = "summary", "summary_by_range", "kld_by_confidence", "gates", "card"
BY_POSITION = "position_buckets"
SHOWN_IN = (SUMMARY, BY_RANGE, BY_CONFIDENCE, BY_POSITION, GATES, CARD)

# What an aggregate computes over the rows of a group (null rows skipped, as SQL does):
# mean | stderr (standard error of the mean) | median | p10 | p90 | p99 | p999 (linear interpolation) | max |
# min | share (of a boolean's rows that are true) | max_dev1 (largest |value - 1|, for a ratio whose ideal
# is 1) | exp_mean (exp of the mean: a perplexity from per-row negative log-likelihoods)
KINDS = ("mean", "stderr", "median", "p10", "p90", "p99", "p999", "max", "min", "share", "max_dev1", "exp_mean")
KIND_WORDS = {"mean": "mean", "stderr": "s.e.", "median": "median", "p10": "p10", "p90": "p90", "p99": "p99"}
KIND_WORDS |= {"p999": "p99.9", "max": "max", "min": "min", "share": "", "max_dev1": "max |x - 1| of"}
KIND_WORDS |= {"exp_mean": "exp of the mean"}

# The buckets of kld_by_confidence: the reference's top-1 probability in [lo, hi), the last [0.9, 1.0]
CONFIDENCE_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# The buckets of position_buckets: (label, lo, hi) of the rows at positions [lo, hi); hi None: no end.
# Fixed, unlike `--ranges`, so a long-context figure reads the same in every warehouse.
POSITION_BUCKETS = (("0-1k", 0, 1024), ("1k-4k", 1024, 4096), ("4k-16k", 4096, 16384), ("16k+", 16384, None))


@dataclass(frozen=True)
class Agg:
    kind: str  # KINDS
    alias: str  # the column (or gate-measured key) it gives
    shown: tuple[str, ...]  # SHOWN_IN: where it is shown
    gate: str | None = None  # the gate (configs/gates.yaml) that reads it, GATES in `shown`
    gate_about: str = ""  # what that gate measures, in words


@dataclass(frozen=True)
class Metric:
    column: str  # row_metrics' output and the metrics table's column
    label: str  # how a card names it
    worse: str  # "higher" | "lower" | "off1" (a ratio: further from 1): a gate's threshold is <= or >=
    same: float | bool | None  # its value where a row equals the reference's: the reference's own summary row
    aggs: tuple[Agg, ...] = ()
    rank: str | None = None  # SQL ranking rows worst first for its gates (default: from `worse`)

    def rank_sql(self) -> str:
        if self.rank:
            return self.rank
        return {"higher": self.column, "lower": f"-{self.column}", "off1": f"abs({self.column} - 1)"}[self.worse]


_S, _R, _C, _P, _G, _K = SUMMARY, BY_RANGE, BY_CONFIDENCE, BY_POSITION, GATES, CARD

# In the order their aggregates appear in the views (summary, summary_by_range, kld_by_confidence,
# position_buckets).
REGISTRY = (
    Metric(
        "kld",
        "KLD",
        "higher",
        0.0,
        (
            Agg(
                "mean", "kld_mean", (_S, _R, _C, _P, _G, _K), "mean_kld", "mean KL(P_ref || P_stack) over sampled rows"
            ),
            Agg("stderr", "kld_stderr", (_S, _R, _C, _P, _K)),
            Agg("median", "kld_median", (_S, _R, _K)),
            Agg("p90", "kld_p90", (_S, _R)),
            Agg("p99", "kld_p99", (_S, _R, _C, _G, _K), "p99_kld", "99th percentile of per-row KL"),
            Agg("p999", "kld_p999", (_S, _R)),
            Agg("max", "kld_max", (_S, _R, _G, _K), "max_kld", "largest single-row KL (an isolated spike rejects)"),
        ),
    ),
    Metric("kld_reverse", "reverse KLD", "higher", 0.0, (Agg("mean", "kld_reverse_mean", (_S, _K)),)),
    Metric(
        "js",
        "JS",
        "higher",
        0.0,
        (Agg("mean", "js_mean", (_S, _R, _G, _K), "mean_js", "mean Jensen-Shannon divergence"),),
    ),
    Metric(
        "top1_match",
        "top-1 agreement",
        "lower",
        True,
        (
            Agg(
                "share",
                "top1_agreement",
                (_S, _R, _C, _P, _G, _K),
                "top1_agreement",
                "share of rows whose argmax matches the reference",
            ),
        ),
        rank="CASE WHEN top1_match THEN 0 ELSE 1 + kld END",  # a disagreement, the larger KL first
    ),
    # p_stack(next token) - p_ref(next token): lower is worse, the candidate less sure of the text than its
    # reference; null at a prompt's last position (no next token)
    Metric("delta_p", "Δp (next token)", "lower", 0.0, (Agg("mean", "delta_p_mean", (_P,)),)),
    Metric("storage_floor", "storage floor", "higher", None, (Agg("mean", "storage_floor", (_S,)),)),
    Metric(
        "nmse",
        "NMSE",
        "higher",
        0.0,
        (
            Agg("mean", "nmse_mean", (_S, _G, _K), "mean_nmse", "mean NMSE of raw logits"),
            Agg("max", "nmse_max", (_G,), "max_nmse", "largest per-row NMSE of raw logits"),
        ),
    ),
    Metric(
        "max_abs_diff",
        "max abs diff",
        "higher",
        0.0,
        (Agg("max", "max_abs_diff", (_S, _G, _K), "max_abs_diff", "largest |Δlogit| of any row (raw logits)"),),
    ),
    Metric(
        "spearman_top10",
        "Spearman (top-10)",
        "lower",
        1.0,
        (
            Agg(
                "mean",
                "spearman_mean",
                (_S, _G, _K),
                "spearman_mean",
                "mean Spearman rank correlation over the reference's top-10",
            ),
            Agg("min", "spearman_min", (_G,), "spearman_min", "smallest per-row Spearman over the reference's top-10"),
        ),
    ),
    Metric(
        "cosine",
        "cosine",
        "lower",
        1.0,
        (Agg("min", "cosine_min", (_G,), "cosine_min", "smallest per-row cosine of raw logits"),),
    ),
    Metric(
        "norm_ratio",
        "norm ratio",
        "off1",
        1.0,
        (
            Agg(
                "max_dev1",
                "norm_ratio_dev",
                (_G,),
                "norm_ratio_tol",
                "largest |‖stack‖/‖ref‖ − 1| over rows (what cosine misses)",
            ),
        ),
    ),
    # the reference's own top-1 probability, exp(ref_top1 - logsumexp(ref)): kld_by_confidence buckets by it
    Metric(
        "p_top1_ref",
        "reference top-1 probability",
        "higher",
        None,
        (Agg("mean", "p_top1_ref_mean", (_C,)),),
    ),
)
BY_COLUMN = {m.column: m for m in REGISTRY}


def aggregates(shown: str) -> list[tuple[Metric, Agg]]:
    """(metric, aggregate) of every aggregate shown in `shown`, in declaration order."""
    if shown not in SHOWN_IN:
        raise ValueError(f"{shown}: not one of {', '.join(SHOWN_IN)}")
    return [(m, a) for m in REGISTRY for a in m.aggs if shown in a.shown]


def reference_value(metric: Metric, agg: Agg) -> float | None:
    """What the reference's own row shows: the aggregate of rows that all equal the reference's
    (None where the metric has no such value, as the storage floor of a row never stored)."""
    if metric.same is None:
        return None
    if agg.kind == "stderr":
        return 0.0
    if agg.kind == "max_dev1":
        return abs(float(metric.same) - 1.0)
    return float(metric.same)


def gates() -> dict[str, tuple[Metric, Agg]]:
    """gate name -> (metric, the aggregate it reads), in declaration order."""
    return {a.gate: (m, a) for m, a in aggregates(GATES) if a.gate}


def comparison(metric: Metric) -> str:
    """A gate's threshold is an upper bound where higher is worse, a lower bound where lower is."""
    return ">=" if metric.worse == "lower" else "<="
