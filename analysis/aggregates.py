"""The registry's aggregates (common/metric_defs.py) as SQL and as numpy: the one place that writes
`avg(kld) AS kld_mean` and its siblings (`avg(`, `stddev_samp(`, `quantile_cont(` appear nowhere else in
analysis/; tests/test_metric_registry.py checks it). The views (analysis/sql.py), the admission gates
(analysis/gates.py) and the card take their SQL from `select_sql`; the fixture gates
(analysis/truncated.py), which hold their rows in memory, take the same aggregates from `numpy_values`.

Null rows (a flagged NaN/Inf row, an undefined Spearman) are skipped by both, as SQL's aggregates do.
"""

from __future__ import annotations

import numpy as np

from common import metric_defs as D

# {x}: the column, qualified by its table where the query joins several
SQL = {
    "mean": "avg({x})",
    "stderr": "stddev_samp({x}) / sqrt(count({x}))",  # the rows that have a value: a flagged row has none
    "median": "median({x})",
    "p10": "quantile_cont({x}, 0.1)",
    "p90": "quantile_cont({x}, 0.9)",
    "p99": "quantile_cont({x}, 0.99)",
    "p999": "quantile_cont({x}, 0.999)",
    "max": "max({x})",
    "min": "min({x})",
    "share": "avg({x}::INT)",
    "max_dev1": "max(abs({x} - 1))",
    "exp_mean": "exp(avg({x}))",
}
assert set(SQL) == set(D.KINDS)


def agg(kind: str, x: str) -> str:
    """One aggregate (common/metric_defs.py KINDS) of a column or expression `x`, as SQL: what every
    view over another table than `metrics` selects its figures with."""
    return SQL[kind].format(x=x)


def aggregate_sql(shown: str, table: str | None = "m", reference: bool = False) -> list[tuple[str, str]]:
    """(alias, SQL expression) of every registry aggregate shown in `shown` (common/metric_defs.py
    SHOWN_IN), over the metrics columns of `table` (None: unqualified). reference: the constants the
    reference's own row shows instead (it is the yardstick, not measured against itself)."""
    out = []
    for metric, agg in D.aggregates(shown):
        if reference:
            v = D.reference_value(metric, agg)
            out.append((agg.alias, "NULL::DOUBLE" if v is None else f"{v!r}::DOUBLE"))
        else:
            col = f"{table}.{metric.column}" if table else metric.column
            out.append((agg.alias, SQL[agg.kind].format(x=col)))
    return out


def select_sql(shown: str, table: str | None = "m", reference: bool = False) -> str:
    """`expr AS alias, ...` of aggregate_sql, for a SELECT list."""
    return ", ".join(f"{expr} AS {alias}" for alias, expr in aggregate_sql(shown, table, reference))


def bucket_values() -> str:
    """kld_by_confidence's buckets as SQL VALUES rows: (lo, hi) of each, DOUBLE (CONFIDENCE_EDGES)."""
    e = D.CONFIDENCE_EDGES
    return ", ".join(f"({lo!r}::DOUBLE, {hi!r}::DOUBLE)" for lo, hi in zip(e, e[1:]))


def position_bucket_values() -> str:
    """position_buckets' buckets as SQL VALUES rows: (bucket, lo, hi) of each, hi null for the open
    last one (POSITION_BUCKETS)."""
    return ", ".join(
        f"('{label}', {lo}::INTEGER, {'NULL' if hi is None else hi}::INTEGER)" for label, lo, hi in D.POSITION_BUCKETS
    )


def _stderr(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")


NUMPY = {
    "mean": np.nanmean,
    "stderr": _stderr,
    "median": np.nanmedian,
    "p10": lambda x: np.nanquantile(x, 0.1),  # linear interpolation, as quantile_cont
    "p90": lambda x: np.nanquantile(x, 0.9),
    "p99": lambda x: np.nanquantile(x, 0.99),
    "p999": lambda x: np.nanquantile(x, 0.999),
    "max": np.nanmax,
    "min": np.nanmin,
    "share": lambda x: np.mean(x),
    "max_dev1": lambda x: np.nanmax(np.abs(x - 1)),
    "exp_mean": lambda x: float(np.exp(np.nanmean(x))),
}
assert set(NUMPY) == set(D.KINDS)


def numpy_value(kind: str, values: np.ndarray) -> float:
    """One aggregate of one metric's per-row values (NaN rows skipped)."""
    return float(NUMPY[kind](values))


def numpy_values(shown: str, rows: dict[str, np.ndarray], columns: dict[str, str] | None = None) -> dict[str, float]:
    """{alias: value} of every registry aggregate shown in `shown`, over per-row arrays held in memory.
    columns: the array a metric's values are under where it is not its own column's name."""
    columns = columns or {}
    return {
        agg.alias: numpy_value(agg.kind, rows[columns.get(metric.column, metric.column)])
        for metric, agg in D.aggregates(shown)
    }
