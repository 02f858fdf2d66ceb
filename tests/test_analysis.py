"""Analysis metrics against independent implementations, and `matrix analyze` / `report` end to end."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.special import rel_entr
from scipy.stats import spearmanr

from analysis import metrics as M
from analysis.analyze import Shard, centroid_tables
from tests.conftest import run_cli, sql

LN2 = np.log(2.0)


def _random_pair(seed=0, rows=8, vocab=2000, noise=0.3):
    rng = np.random.default_rng(seed)
    a = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    return a, (a + rng.normal(size=a.shape) * noise).astype(np.float32)


def _check_against_scipy(a, b):
    m = M.row_metrics(a, b, np.arange(len(a)))
    lp, lq = M.log_softmax64(a), M.log_softmax64(b)
    p, q = np.exp(lp), np.exp(lq)
    np.testing.assert_allclose(m["kld"], rel_entr(p, q).sum(-1), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(m["kld_reverse"], rel_entr(q, p).sum(-1), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(m["js"], [jensenshannon(x, y) ** 2 for x, y in zip(p, q)], rtol=1e-7, atol=1e-15)
    top = np.argsort(-a, axis=-1, kind="stable")[:, :10]
    want = [spearmanr(a[i, top[i]], b[i, top[i]]).statistic for i in range(len(a))]
    np.testing.assert_allclose(m["spearman_top10"], want, rtol=1e-9, atol=1e-12)
    cos = (a.astype(np.float64) * b).sum(-1) / np.linalg.norm(a.astype(np.float64), axis=-1) / np.linalg.norm(b.astype(np.float64), axis=-1)
    np.testing.assert_allclose(m["cosine"], cos, rtol=1e-12)
    assert (m["kld"] >= 0).all() and (m["js"] >= 0).all() and (m["js"] <= LN2).all()
    return m


@pytest.mark.parametrize("noise", [1e-3, 0.3, 5.0])
def test_metrics_match_scipy_on_random_rows(noise):
    a, b = _random_pair(noise=noise)
    m = _check_against_scipy(a, b)
    rev = M.row_metrics(b, a, np.arange(len(a)))
    np.testing.assert_allclose(m["js"], rev["js"], rtol=1e-12)  # JS is symmetric
    np.testing.assert_allclose(m["kld"], rev["kld_reverse"], rtol=1e-12)


def test_metrics_match_scipy_on_real_captured_rows(swept):
    _, wh, _, _ = swept
    cells = {c["dtype"] + "." + c["attention"]: c["cell_id"] for c in sql(wh, "select * from cells")}
    ta = pq.read_table(wh / "logits" / cells["bf16.eager"] / "r0.parquet")
    tb = pq.read_table(wh / "logits" / cells["fp32.sdpa"] / "r0.parquet")
    a = np.asarray(ta["logits"].to_pylist()[:24], dtype=np.float32)
    b = np.asarray(tb["logits"].to_pylist()[:24], dtype=np.float32)
    m = _check_against_scipy(a, b)
    assert 0 < m["kld"].mean() < 0.1


def test_identical_rows_give_exact_zeros_and_float32_accumulation_is_equivalent():
    a, _ = _random_pair()
    m = M.row_metrics(a, a.copy(), np.arange(len(a)))
    for k in ("kld", "kld_reverse", "js", "nmse", "max_abs_diff", "delta_p"):
        assert (m[k] == 0.0).all(), k
    assert (m["cosine"] == 1.0).all() and (m["norm_ratio"] == 1.0).all() and m["top1_match"].all()
    # float32 log-softmax with float64 sums agrees with the float64 path to 1e-9
    a, b = _random_pair(noise=0.3)
    lp32 = a - a.max(-1, keepdims=True)
    lp32 = lp32 - np.log(np.exp(lp32).astype(np.float64).sum(-1, keepdims=True)).astype(np.float32)
    lq32 = b - b.max(-1, keepdims=True)
    lq32 = lq32 - np.log(np.exp(lq32).astype(np.float64).sum(-1, keepdims=True)).astype(np.float32)
    k32 = (np.exp(lp32.astype(np.float64)) * (lp32.astype(np.float64) - lq32)).sum(-1)
    np.testing.assert_allclose(k32, M.row_metrics(a, b, np.arange(len(a)))["kld"], atol=1e-6)


def test_kl_is_never_negative_and_bad_input_is_an_error_not_a_clamp():
    for seed in range(5):
        a, b = _random_pair(seed=seed, noise=10.0 ** -seed)
        assert (M.kl(M.log_softmax64(a), M.log_softmax64(b)) >= 0).all()
    bogus = np.log(np.full((1, 4), 0.5))  # not a distribution: sums to 2
    with pytest.raises(M.MetricError, match="Q is not a distribution"):
        M.kl(np.log(np.full((1, 4), 0.25)), bogus)


def test_nan_rows_are_refused():
    a, b = _random_pair()
    b[2, 7] = np.nan
    with pytest.raises(M.MetricError, match=r"non-finite logits in rows \[2\]"):
        M.row_metrics(a, b, np.arange(len(a)))


def _shard(cid, logits):
    n = len(logits)
    return Shard(cid, {("p", i): i for i in range(n)}, logits, np.full(n, -1), ["p"] * n, list(range(n)))


def test_centroid_of_one_stack_is_that_stack_and_rank_includes_the_reference():
    a, b = _random_pair(rows=4, noise=0.5)
    cent, pairs = centroid_tables({"only": _shard("only", a)}, "only", "mean_prob")
    assert set(cent["kld_centroid_stack"].to_pylist()) == {0.0} and pairs.num_rows == 0
    c = a + 3.0  # same distribution as a (a shift), different raw logits
    cent, pairs = centroid_tables({"a": _shard("a", a), "b": _shard("b", b), "c": _shard("c", c)}, "a", "mean_prob")
    per = {}
    for cid, k in zip(cent["cell_id"].to_pylist(), cent["kld_centroid_stack"].to_pylist()):
        per.setdefault(cid, []).append(k)
    assert all(v > 0 for ks in per.values() for v in ks)
    assert np.mean(per["b"]) > np.mean(per["a"])  # two of three stacks agree: b is the outlier
    assert {(x, y) for x, y in zip(pairs["cell_a"].to_pylist(), pairs["cell_b"].to_pylist())} == \
        {("a", "b"), ("a", "c"), ("b", "c")}


def test_analyze_and_report_end_to_end(swept, tmp_path):
    _, wh, _, _ = swept
    r = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    total = sql(wh, "select sum(repeats * rows_per_repeat) as n from cells")[0]["n"]
    assert out["metric_rows"] == total == sql(wh, "select count(*) as n from metrics")[0]["n"]
    ref = sql(wh, "select max(kld) as k, min(top1_match::int) as t from metrics where cell_id = reference_cell_id")[0]
    assert ref == {"k": 0.0, "t": 1}  # the reference against itself, both repeats: exact zeros
    summary = {s["dtype"] + "." + s["attention"]: s for s in sql(wh, "select * from summary")}
    assert summary["bf16.eager"]["is_reference"] and not summary["fp32.eager"]["below_resolution"]
    assert 0 < summary["fp32.eager"]["kld_mean"] < 0.05 and summary["fp32.eager"]["top1_agreement"] > 0.9
    ranges = sql(wh, "select distinct range from summary_by_range")
    assert {x["range"] for x in ranges} <= {"0-511", "512-2047", "2048-8191", "8192+"}
    cs = sql(wh, "select cell_id, rank_closest from centroid_summary")
    assert sorted(c["rank_closest"] for c in cs) == [1, 2, 3, 4]
    # SQL functions over logits columns agree with the metrics table
    k = sql(wh, """select max(abs(kld(r.logits, s.logits) - m.kld)) as d from metrics m
                   join logits s on s.cell_id = m.cell_id and s.prompt_id = m.prompt_id and s.position = m.position
                        and s.repeat = m.repeat
                   join logits r on r.cell_id = m.reference_cell_id and r.prompt_id = m.prompt_id
                        and r.position = m.position and r.repeat = 0
                   where m.repeat = 0 and m.cell_id <> m.reference_cell_id""")[0]["d"]
    assert k < 1e-12

    r = run_cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "kld mean" in r.stdout and "reference" in r.stdout
    page = (tmp_path / "rep" / "report.html").read_text()
    for ident in ("kld-position", "pairwise-js", "top1", "centroid"):
        assert f'id="{ident}"' in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained


def test_analyze_bad_input(swept, tmp_path):
    _, wh, _, _ = swept
    r = run_cli("analyze", "--warehouse", str(wh), "--reference", "no-such-cell")
    assert r.returncode == 2 and "--reference no-such-cell: no captured cell" in r.stderr
    # a NaN in one stored row: reported with its cell and position, never averaged in
    bad = tmp_path / "wh"
    shutil.copytree(wh, bad)
    cell = sql(bad, "select cell_id from cells where dtype='fp32' and attention='sdpa'")[0]["cell_id"]
    f = bad / "logits" / cell / "r0.parquet"
    t = pq.read_table(f)
    rows = t["logits"].to_pylist()
    rows[3][100] = float("nan")
    t = t.set_column(t.schema.get_field_index("logits"), "logits", pa.array(rows, t.schema.field("logits").type))
    pq.write_table(t, f)
    before = sorted(p.name for p in (bad / "logits").rglob("*.parquet"))
    r = run_cli("analyze", "--warehouse", str(bad))
    assert r.returncode == 2 and "NaN/Inf" in r.stderr and cell in r.stderr, r.stderr
    assert sorted(p.name for p in (bad / "logits").rglob("*.parquet")) == before
    empty = tmp_path / "empty"
    run_cli("sql", "select 1", "--warehouse", str(empty))
    (empty).mkdir()
    (empty / "WAREHOUSE.json").write_text('{"format": "logit-matrix-warehouse", "schema_version": 2}')
    r = run_cli("analyze", "--warehouse", str(empty))
    assert r.returncode == 2 and "no captured cells" in r.stderr
