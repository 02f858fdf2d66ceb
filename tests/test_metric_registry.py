"""The metric registry (common/metric_defs.py) is what the views, the gates and the card aggregate,
and kld_by_confidence buckets rows by the reference's top-1 probability as a float64 computation of
its own over the stored logits does."""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.special import rel_entr

from analysis import aggregates as A
from analysis import metrics as M
from analysis.sql import VIEWS, view_columns
from common import metric_defs as D
from store.schema import METRICS, TABLES
from tests.conftest import analyzed_copy, run_cli, sql
from tests.float64_rows import matrix


def test_every_registry_metric_is_a_metrics_column_and_a_row_metrics_output():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 300)).astype(np.float32)
    out = M.row_metrics(a, a + np.float32(0.1) * rng.standard_normal((3, 300)).astype(np.float32))
    for m in D.REGISTRY:
        assert m.column in METRICS.names, m.column
        assert m.column in out or m.column == "storage_floor", m.column  # the floor is the capture's, not the kernel's
        boolean = METRICS.field(m.column).type == pa.bool_()
        assert boolean == any(a.kind == "share" for a in m.aggs), m.column  # a share is of a boolean's rows
        assert all(a.kind in D.KINDS and set(a.shown) <= set(D.SHOWN_IN) for a in m.aggs)
    aliases = [(a.alias, s) for m in D.REGISTRY for a in m.aggs for s in a.shown]
    assert len(aliases) == len(set(aliases))  # no column twice in one view


def test_the_views_take_their_aggregates_from_the_registry():
    cols = {v: [c for c, _ in cs] for v, cs in view_columns().items()}
    for view in (D.SUMMARY, D.BY_RANGE, D.BY_CONFIDENCE, D.BY_POSITION):
        for alias, expr in A.aggregate_sql(view):
            assert f"{expr} AS {alias}" in VIEWS[view] and alias in cols[view], (view, alias)
    # the summary's reference row: the registry's constants, under the same columns
    assert A.select_sql(D.SUMMARY, reference=True) in VIEWS["summary"]
    every_mean = {a.alias for m in D.REGISTRY for a in m.aggs if a.kind == "mean" and D.SUMMARY in a.shown}
    assert every_mean <= set(cols["summary"]) and {"kld_mean", "js_mean", "nmse_mean"} <= every_mean
    from analysis.card import NUMBERS
    from analysis.gates import GATES

    assert {a.alias for _, a in D.aggregates(D.CARD)} <= set(NUMBERS) <= set(cols["summary"])
    assert {g: v[0] for g, v in GATES.items()} == {g: a.alias for g, (_, a) in D.gates().items()}
    assert GATES["cosine_min"][1:] == (">=", "smallest per-row cosine of raw logits", "-cosine")
    assert GATES["norm_ratio_tol"][1] == "<=" and GATES["norm_ratio_tol"][3] == "abs(norm_ratio - 1)"


def test_the_fixture_gates_aggregate_as_the_warehouse_gates(tmp_path):
    """The numpy twin gives the SQL's numbers on the same rows (nulls skipped by both)."""
    rng = np.random.default_rng(1)
    n = 200
    rows = {m.column: rng.random(n) for m in D.REGISTRY}
    rows["top1_match"] = rng.random(n) < 0.8
    rows["spearman_top10"][:3] = np.nan  # an undefined Spearman: null in the table
    table = pa.table({k: pa.array(v, mask=np.isnan(v) if v.dtype.kind == "f" else None) for k, v in rows.items()})
    con = duckdb.connect(":memory:")
    con.register("metrics", table)
    for shown in (D.GATES, D.BY_CONFIDENCE, D.BY_POSITION, D.SUMMARY):
        got = dict(
            zip(
                [a for a, _ in A.aggregate_sql(shown, None)],
                con.execute(f"SELECT {A.select_sql(shown, None)} FROM metrics").fetchone(),
            )
        )
        want = A.numpy_values(shown, rows)
        assert got.keys() == want.keys()
        for k in got:
            assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), (shown, k)


def test_every_kind_gives_the_same_figure_in_sql_and_numpy():
    """Each aggregate kind, as SQL (agg) and as numpy, over the same values with a null among them."""
    rng = np.random.default_rng(2)
    x = rng.random(101) * 3
    x[7] = np.nan
    flag = rng.random(101) < 0.3
    con = duckdb.connect(":memory:")
    con.register("t", pa.table({"x": pa.array(x, mask=np.isnan(x)), "b": flag}))
    for kind in D.KINDS:
        col, values = ("b", flag) if kind == "share" else ("x", x)
        (got,) = con.execute(f"SELECT {A.agg(kind, col)} FROM t").fetchone()
        assert got == pytest.approx(A.numpy_value(kind, values), rel=1e-12), kind
    assert A.numpy_value("exp_mean", x) == pytest.approx(np.exp(np.nanmean(x)), rel=1e-15)
    assert A.numpy_value("p10", x) == pytest.approx(np.quantile(x[~np.isnan(x)], 0.1), rel=1e-15)


def test_no_analysis_module_writes_an_aggregate_by_hand():
    """avg(, stddev_samp( and quantile_cont( are written once, in analysis/aggregates.py; every
    other module of analysis/ (and every plug-in's view) selects its figures through it."""
    from pathlib import Path

    root = Path(A.__file__).parent
    for f in [*root.glob("*.py"), *(root.parent / "extras").glob("*.py")]:
        if f.name == "aggregates.py":
            continue
        code = "\n".join(line.split("#", 1)[0] for line in f.read_text().splitlines())
        for written in ("avg(", "stddev_samp(", "quantile_cont("):
            assert written not in code, (f.name, written)
    batch = [c for c, _ in view_columns()["batch_drift"]]
    assert "kld_stderr" in batch and "kld_se" not in batch


def _views_over(metrics: pa.Table) -> duckdb.DuckDBPyConnection:
    """Every derived view over empty tables, the metrics table holding these rows."""
    con = duckdb.connect(":memory:")
    for table, schema in TABLES.items():
        con.register(f"_empty_{table}", pa.table({f.name: pa.array([], f.type) for f in schema}))
        con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    con.register("_rows", metrics)
    con.execute("CREATE OR REPLACE VIEW metrics AS SELECT * FROM _empty_metrics UNION ALL BY NAME SELECT * FROM _rows")
    for name, body in VIEWS.items():
        con.execute(f"CREATE VIEW {name} AS {body}")
    return con


def test_confidence_buckets_are_lo_inclusive_and_the_last_holds_1():
    p = [0.0, 0.0999999, 0.1, 0.35, 0.9, 0.95, 1.0, None, 0.5]
    n = len(p)
    con = _views_over(
        pa.table(
            {
                "cell_id": ["c"] * n,
                "reference_cell_id": ["r"] * n,
                "repeat": pa.array([0] * (n - 1) + [1], pa.int32()),
                "kld": pa.array(np.arange(n, dtype=np.float64)),
                "top1_match": [True] * n,
                "p_top1_ref": pa.array(p, pa.float64()),
            }
        )
    )
    got = con.execute("SELECT lo, hi, rows, kld_mean FROM kld_by_confidence ORDER BY lo").fetchall()
    # 0.5 is repeat 1 (not the capture) and the null row is in no bucket
    assert got == [(0.0, 0.1, 2, 0.5), (0.1, 0.2, 1, 2.0), (0.3, 0.4, 1, 3.0), (0.9, 1.0, 3, 5.0)]


def _rows(wh, cell_id: str) -> dict[tuple[str, int], np.ndarray]:
    t = pq.read_table(wh / "logits" / cell_id / "r0.parquet", columns=["prompt_id", "position", "logits"])
    x = matrix(t["logits"])  # (rows, vocab): float32 values widened
    return {(p, q): x[i] for i, (p, q) in enumerate(zip(t["prompt_id"].to_pylist(), t["position"].to_pylist()))}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def analyzed(swept, tmp_path_factory):
    return analyzed_copy(swept, tmp_path_factory, "confidence")


def test_kld_by_confidence_matches_a_float64_computation_over_the_stored_rows(analyzed):
    wh, cells = analyzed
    ref = _rows(wh, cells["bf16.eager"])
    edges = np.asarray(D.CONFIDENCE_EDGES)
    for name in ("fp32.eager", "fp32.sdpa", "bf16.sdpa"):
        stk = _rows(wh, cells[name])
        per: dict[int, list] = {}
        for key, s in stk.items():
            r = ref[key]
            p_top = float(np.exp(r.max() - (r.max() + np.log(np.exp(r - r.max()).sum()))))
            assert np.abs(edges - p_top).min() > 1e-9  # no row on an edge, where rounding could pick the bucket
            b = min(int(np.searchsorted(edges, p_top, side="right")) - 1, len(edges) - 2)
            kl = float(rel_entr(_softmax(r), _softmax(s)).sum())
            per.setdefault(b, []).append((kl, r.argmax() == s.argmax(), p_top))
        got = sql(wh, f"select * from kld_by_confidence where cell_id = '{cells[name]}' order by lo")
        assert [(g["lo"], g["hi"]) for g in got] == [(edges[b], edges[b + 1]) for b in sorted(per)]
        for g, b in zip(got, sorted(per)):
            kl, top1, p_top = (np.asarray(v, dtype=np.float64) for v in zip(*per[b]))
            assert g["rows"] == len(kl) and g["reference_cell_id"] == cells["bf16.eager"]
            # a row's KL summed over the vocabulary in float64 by two methods differs by ~5e-15 (either
            # one's rounding): 1e-12 relative where the mean is large, 1e-14 absolute where it is not
            assert g["kld_mean"] == pytest.approx(kl.mean(), rel=1e-12, abs=1e-14)
            assert g["top1_agreement"] == pytest.approx(top1.mean(), rel=1e-12)
            assert g["p_top1_ref_mean"] == pytest.approx(p_top.mean(), rel=1e-12)
        assert sum(g["rows"] for g in got) == len(stk)


def test_the_card_gives_kld_by_confidence(analyzed):
    wh, cells = analyzed
    cell = cells["fp32.sdpa"]
    r = run_cli("card", cell, "--warehouse", str(wh), "--format", "json", "--allow-undisclosed")
    assert r.returncode == 0, r.stderr[-2000:]
    card = json.loads(r.stdout)
    view = sql(wh, f"select * from kld_by_confidence where cell_id = '{cell}' order by lo")
    assert card["by_confidence"] == view and view
    md = run_cli("card", cell, "--warehouse", str(wh), "--allow-undisclosed").stdout
    assert "| reference top-1 probability | rows | mean KLD ± s.e. | p99 KLD | top-1 agreement |" in md
    v = view[0]
    assert f"| {v['lo']:.1f}–{v['hi']:.1f} | {v['rows']} | {v['kld_mean']:.4g} ± " in md
