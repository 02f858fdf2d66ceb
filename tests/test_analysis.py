"""Analysis metrics against independent implementations, and `matrix analyze` / `report` end to end."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.special import rel_entr
from scipy.stats import spearmanr

from analysis import metrics as M
from analysis.centroid import centroid_tables
from store.warehouse import row_hash
from tests.conftest import run_cli, run_process, sql, write_spec
from tests.float64_rows import matrix

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster

LN2 = np.log(2.0)


def _random_pair(seed=0, rows=8, vocab=2000, noise=0.3):
    rng = np.random.default_rng(seed)
    a = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    return a, (a + rng.normal(size=a.shape) * noise).astype(np.float32)


def _softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _check_against_scipy(a, b):
    m = M.row_metrics(a, b, np.arange(len(a)))
    p, q = _softmax64(a), _softmax64(b)
    np.testing.assert_allclose(m["kld"], rel_entr(p, q).sum(-1), rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(m["kld_reverse"], rel_entr(q, p).sum(-1), rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(m["js"], [jensenshannon(x, y) ** 2 for x, y in zip(p, q)], rtol=1e-7, atol=1e-14)
    top = np.argsort(-a, axis=-1, kind="stable")[:, :10]
    want = [spearmanr(a[i, top[i]], b[i, top[i]]).statistic for i in range(len(a))]
    np.testing.assert_allclose(m["spearman_top10"], want, rtol=1e-9, atol=1e-12)
    tb = np.argsort(-b, axis=-1, kind="stable")[:, :10]
    for k in (5, 10):  # top-k overlap from an independent full sort
        want = [len(set(top[i, :k]) & set(tb[i, :k])) / k for i in range(len(a))]
        np.testing.assert_array_equal(m[f"top{k}_overlap"], want)
    np.testing.assert_array_equal(m["top1_match"], a.argmax(-1) == b.argmax(-1))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = (a64 * b64).sum(-1) / np.linalg.norm(a64, axis=-1) / np.linalg.norm(b64, axis=-1)
    np.testing.assert_allclose(m["cosine"], cos, rtol=1e-12)
    np.testing.assert_allclose(m["norm_ratio"], np.linalg.norm(b64, axis=-1) / np.linalg.norm(a64, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(m["max_abs_diff"], np.abs(a64 - b64).max(-1), rtol=0)
    nxt = np.arange(len(a))
    np.testing.assert_allclose(m["delta_p"], q[nxt, nxt] - p[nxt, nxt], rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(m["entropy_ref"], -(p * np.log(p)).sum(-1), rtol=1e-9, atol=1e-13)
    assert (m["kld"] >= 0).all() and (m["js"] >= 0).all() and (m["js"] <= LN2).all()
    return m


@pytest.mark.parametrize("noise", [1e-3, 0.3, 5.0])
def test_metrics_match_scipy_on_random_rows(noise):
    a, b = _random_pair(noise=noise)
    m = _check_against_scipy(a, b)
    rev = M.row_metrics(b, a, np.arange(len(a)))
    np.testing.assert_allclose(m["js"], rev["js"], rtol=1e-12)  # JS is symmetric
    np.testing.assert_allclose(m["kld"], rev["kld_reverse"], rtol=1e-12)


def test_vocab_not_a_multiple_of_the_topk_block_and_ties():
    # 1,000 logits: 15 blocks of 64 plus a tail of 40, the largest values placed in the tail
    a, b = _random_pair(rows=5, vocab=1000, noise=0.2)
    a[:, 995], b[:, 990] = 30.0, 30.0
    _check_against_scipy(a, b)
    # bf16-like ties at the top: argmax semantics (lowest id wins) on both sides
    t = np.round(a * 4) / 4
    t[:, 3] = t[:, 700] = t.max(-1) + 1
    m = M.row_metrics(t, t[:, ::-1].copy())
    np.testing.assert_array_equal(m["top1_match"], t.argmax(-1) == t[:, ::-1].argmax(-1))


def test_metrics_match_scipy_on_real_captured_rows(swept):
    _, wh, _, _ = swept
    cells = {c["dtype"] + "." + c["attention"]: c["cell_id"] for c in sql(wh, "select * from cells")}
    ta = pq.read_table(wh / "logits" / cells["bf16.eager"] / "r0.parquet")
    tb = pq.read_table(wh / "logits" / cells["fp32.sdpa"] / "r0.parquet")
    a = matrix(ta["logits"].slice(0, 24), np.float32)
    b = matrix(tb["logits"].slice(0, 24), np.float32)
    m = _check_against_scipy(a, b)
    assert 0 < m["kld"].mean() < 0.1


def test_stored_bf16_rows_measure_as_their_widened_rows(monkeypatch):
    """Stored rows (bf16 bits and each row's shift) go to the kernel as they are: the metrics of
    their widened float32 rows (top-k and max |diff| identical, sums to the rounding of another
    summation order), and the numpy twin agrees as closely as it does on floats. A row masked
    (-inf), a NaN, and a row stored without a shift included."""
    from store.values import Bf16Rows, shift_by_max, to_bf16

    a, b = _random_pair(seed=3, rows=40, vocab=4099, noise=0.2)  # not a multiple of the block: a tail
    a[2, 11], b[5, 100] = -np.inf, np.nan
    sides = []
    for x in (a, b):
        z, m = shift_by_max(x)
        m[7] = 0.0  # as a row kept without a shift
        sides.append(Bf16Rows.of(to_bf16(z), m))
    wide = [s.widened() for s in sides]
    assert wide[0].dtype == np.float32 and np.isneginf(wide[0][2, 11]) and np.isnan(wide[1][5, 100])
    nxt = np.arange(40) * 97 % 4099
    stored, floats = M.row_metrics(*sides, nxt), M.row_metrics(*wide, nxt)
    assert list(stored["nonfinite"]) == list(floats["nonfinite"]) and stored["nonfinite"][5] == "stack"
    for k in ("top1_match", "top5_overlap", "top10_overlap", "spearman_top10", "max_abs_diff"):
        np.testing.assert_array_equal(stored[k], floats[k], err_msg=k)
    for k, v in stored.items():
        if k != "nonfinite":
            np.testing.assert_allclose(v, floats[k], rtol=1e-10, atol=1e-15, err_msg=k)
    assert np.nanmin(stored["kld"]) > 1e-3  # real divergences, not zeros
    mixed = M.row_metrics(sides[0], wide[1], nxt)  # one side stored, the other float32: widened
    np.testing.assert_array_equal(mixed["kld"], floats["kld"])
    monkeypatch.setattr(M, "_KERNEL", M._reduce_numpy)  # the numpy twin widens them itself
    numpy = M.row_metrics(*sides, nxt)
    for k in ("kld", "kld_reverse", "js", "cosine", "entropy_ref", "nll_stack"):
        np.testing.assert_allclose(numpy[k], stored[k], rtol=1e-12, atol=1e-15, err_msg=k)


def test_identical_rows_give_exact_zeros_and_native_equals_numpy(monkeypatch):
    a, _ = _random_pair()
    m = M.row_metrics(a, a.copy(), np.arange(len(a)))
    for k in ("kld", "kld_reverse", "js", "nmse", "max_abs_diff", "delta_p"):
        assert (m[k] == 0.0).all(), k
    assert (m["cosine"] == 1.0).all() and (m["norm_ratio"] == 1.0).all() and m["top1_match"].all()
    # the C kernel and the same arithmetic in numpy agree far inside 1e-9, in float32 and float64,
    # over rows spread across threads (40 rows: several of the kernel's tasks)
    assert M.kernel_mode() == "native"  # CI and dev machines have a C compiler
    for kind in (np.float32, np.float64):
        a, b = (x.astype(kind) for x in _random_pair(rows=40, noise=0.3))
        native = M.row_metrics(a, b, np.arange(len(a)))
        monkeypatch.setattr(M, "_KERNEL", M._reduce_numpy)
        numpy = M.row_metrics(a, b, np.arange(len(a)))
        monkeypatch.setattr(M, "_KERNEL", M._reduce_native)
        for k in (
            "kld",
            "kld_reverse",
            "js",
            "cosine",
            "nmse",
            "entropy_ref",
            "entropy_stack",
            "nll_ref",
            "max_abs_diff",
        ):
            np.testing.assert_allclose(native[k], numpy[k], rtol=1e-12, atol=1e-15, err_msg=k)
        np.testing.assert_allclose(native["delta_p"], numpy["delta_p"], rtol=1e-9, atol=1e-15)
        for k in ("top1_match", "top10_overlap", "spearman_top10"):
            np.testing.assert_array_equal(native[k], numpy[k], err_msg=k)
    # rows that are not finite: a NaN, an infinite logit, a masked (-inf) token on one side or
    # both, a row masked whole; flagged and left out the same way by both
    a, b = _random_pair(rows=6, noise=0.3)
    b[0, 7], a[1, 0], a[2, 5], b[3, 9], a[4], b[5, 64] = np.nan, np.inf, -np.inf, -np.inf, -np.inf, np.nan
    a[3, 9] = -np.inf
    got = {}
    for kernel in (M._reduce_native, M._reduce_numpy):
        monkeypatch.setattr(M, "_KERNEL", kernel)
        got[kernel] = M.row_metrics(a, b, np.arange(6))
    native, numpy = got.values()
    assert (
        list(native["nonfinite"])
        == list(numpy["nonfinite"])
        == ["stack", "reference", "reference", "both", "reference", "stack"]
    )
    for k, v in native.items():
        if k != "nonfinite":
            np.testing.assert_array_equal(v, numpy[k], err_msg=k)


def test_kl_is_never_negative():
    for seed in range(6):
        a, b = _random_pair(seed=seed, noise=10.0**-seed)
        m = M.row_metrics(a, b)
        assert (m["kld"] >= 0).all() and (m["kld_reverse"] >= 0).all() and (m["js"] >= 0).all()


def test_nan_rows_are_flagged_per_row_not_averaged():
    a, b = _random_pair()
    b[2, 7] = np.nan
    a[5, 0] = np.inf
    m = M.row_metrics(a, b, np.arange(len(a)))
    assert list(m["nonfinite"]) == [None, None, "stack", None, None, "reference", None, None]
    assert np.isnan(m["kld"][[2, 5]]).all() and np.isfinite(m["kld"][[0, 1, 3, 4, 6, 7]]).all()
    clean = M.row_metrics(a[[0, 1, 3]], b[[0, 1, 3]])
    np.testing.assert_array_equal(m["kld"][[0, 1, 3]], clean["kld"])  # neighbours are untouched


def _shard(cid, logits):
    return [("p", i) for i in range(len(logits))], logits


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
    assert {(x, y) for x, y in zip(pairs["cell_a"].to_pylist(), pairs["cell_b"].to_pylist())} == {
        ("a", "b"),
        ("a", "c"),
        ("b", "c"),
    }


def test_analyze_and_report_end_to_end(swept, tmp_path):
    _, wh, _, _ = swept
    r = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    # every repeat of every cell, except the reference's repeat 0: it is the yardstick, not measured against itself
    total = sql(wh, "select sum((repeats - is_reference::int) * rows_per_repeat) as n from cells")[0]["n"]
    assert out["metric_rows"] == total == sql(wh, "select count(*) as n from metrics")[0]["n"]
    ref = sql(
        wh,
        "select max(kld) as k, min(top1_match::int) as t, min(repeat) as r from metrics "
        "where cell_id = reference_cell_id",
    )[0]
    assert ref == {"k": 0.0, "t": 1, "r": 1}  # the reference's repeat 1 against its repeat 0: exact zeros
    summary = {s["dtype"] + "." + s["attention"]: s for s in sql(wh, "select * from summary")}
    assert summary["bf16.eager"]["is_reference"] and not summary["fp32.eager"]["below_resolution"]
    assert 0 < summary["fp32.eager"]["kld_mean"] < 0.05 and summary["fp32.eager"]["top1_agreement"] > 0.9
    ranges = sql(wh, "select distinct range from summary_by_range")
    assert {x["range"] for x in ranges} <= {"0-511", "512-2047", "2048-8191", "8192+"}
    cs = sql(wh, "select cell_id, rank_closest from centroid_summary")
    assert sorted(c["rank_closest"] for c in cs) == [1, 2, 3, 4]
    # SQL functions over logits columns agree with the metrics table
    k = sql(
        wh,
        """select max(abs(kld(r.logits, s.logits) - m.kld)) as d from metrics m
                   join logits s on s.cell_id = m.cell_id and s.prompt_id = m.prompt_id and s.position = m.position
                        and s.repeat = m.repeat
                   join logits r on r.cell_id = m.reference_cell_id and r.prompt_id = m.prompt_id
                        and r.position = m.position and r.repeat = 0
                   where m.repeat = 0 and m.cell_id <> m.reference_cell_id""",
    )[0]["d"]
    assert k < 1e-12

    r = run_process("report", "--warehouse", str(wh), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "kld mean" in r.stdout and "reference" in r.stdout
    page = (tmp_path / "rep" / "report.html").read_text()
    for ident in ("kld-summary-0", "kld-cdf-0", "kld-position-0", "pairwise-js-0", "top1-0", "centroid-0"):
        assert f'id="{ident}"' in page
    bare = re.sub(r'xmlns(:\w+)?="http://www\.w3\.org/[^"]*"', "", page)  # XML namespace names, never fetched
    assert "http://" not in bare and "https://" not in bare  # self-contained


def test_analyze_bad_input(swept, tmp_path):
    _, wh, _, _ = swept
    r = run_process("analyze", "--warehouse", str(wh), "--reference", "no-such-cell")
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
    # as if the engine had returned the NaN: the row's hash is of those values (else it is damage)
    hashes = t["row_hash"].to_pylist()
    hashes[3] = row_hash(np.array(rows[3], dtype=np.float32))
    t = t.set_column(t.schema.get_field_index("row_hash"), "row_hash", pa.array(hashes))
    pq.write_table(t, f)
    before = sorted(p.name for p in (bad / "logits").rglob("*.parquet"))
    r = run_cli("analyze", "--warehouse", str(bad), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "NaN/Inf" in r.stderr and cell in r.stderr and "position" in r.stderr, r.stderr
    assert json.loads(r.stdout)["nonfinite_rows"] == 1
    assert sorted(p.name for p in (bad / "logits").rglob("*.parquet")) == before
    flagged = sql(bad, "select * from metrics where nonfinite is not null")
    assert len(flagged) == 1 and flagged[0]["cell_id"] == cell and flagged[0]["nonfinite"] == "stack"
    assert flagged[0]["kld"] is None and flagged[0]["top1_match"] is None  # null: never averaged in
    s = sql(bad, f"select rows, nonfinite_rows, kld_mean from summary where cell_id = '{cell}'")[0]
    clean = sql(bad, f"select avg(kld) as k from metrics where cell_id = '{cell}' and repeat = 0 and nonfinite is null")
    assert s["nonfinite_rows"] == 1 and s["kld_mean"] == pytest.approx(clean[0]["k"], rel=1e-12)
    c = sql(bad, f"select count(*) filter (where nonfinite) as n from centroid_metrics where cell_id = '{cell}'")
    assert c[0]["n"] == 1
    empty = tmp_path / "empty"
    run_cli("sql", "select 1", "--warehouse", str(empty))
    (empty).mkdir()
    (empty / "WAREHOUSE.json").write_text('{"format": "logit-matrix-warehouse", "schema_version": 3}')
    r = run_cli("analyze", "--warehouse", str(empty))
    assert r.returncode == 2 and "no captured cells" in r.stderr


def test_centroid_groups_from_the_spec_relabel_without_recapturing(swept, tiny_model, short_corpus, tmp_path):
    _, wh, _, _ = swept
    wh2 = tmp_path / "wh"
    shutil.copytree(wh, wh2)
    spec = write_spec(
        tmp_path / "grouped.yaml",
        tiny_model,
        short_corpus,
        centroid={"definition": "mean_logprob", "groups": {"fp32": {"dtype": "fp32"}}},
    )
    rows_before = sql(wh2, "select count(*) as n from logits")[0]["n"]
    r = run_cli("run", str(spec), "--warehouse", str(wh2))
    assert r.returncode == 0 and "relabelled 4 captured cell(s)" in r.stderr, r.stderr[-2000:]
    assert sql(wh2, "select count(*) as n from logits")[0]["n"] == rows_before  # nothing captured again
    r = run_cli("analyze", "--warehouse", str(wh2), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["centroid"] == "mean_logprob" and json.loads(r.stdout)["groups"] == 2
    got = sql(
        wh2,
        """select c.dtype, s.centroid_group, s.rank_closest from centroid_summary s
                      join cells c using (cell_id) order by all""",
    )
    assert {(g["dtype"], g["centroid_group"]) for g in got} == {("bf16", "tiny"), ("fp32", "fp32")}
    assert sorted(g["rank_closest"] for g in got) == [1, 1, 2, 2]  # ranked within each group
    assert {m["centroid"] for m in sql(wh2, "select distinct centroid from centroid_metrics")} == {"mean_logprob"}
    pairs = sql(wh2, "select count(*) as n from pairwise")[0]["n"]
    assert pairs == 2  # one pair per group of two
    # the groups taken away again: the fp32 group's files go, the model's one group has all 6 pairs
    plain = write_spec(tmp_path / "plain.yaml", tiny_model, short_corpus)
    assert run_cli("run", str(plain), "--warehouse", str(wh2)).returncode == 0
    r = run_cli("analyze", "--warehouse", str(wh2))
    assert r.returncode == 0 and "removed pairwise/tiny.fp32.parquet: no such centroid group now" in r.stderr, r.stderr
    assert sorted(p.name for p in (wh2 / "pairwise").iterdir()) == ["tiny.parquet"]
    assert sql(wh2, "select count(*) as n from pairwise")[0]["n"] == 6
    bad = write_spec(tmp_path / "bad.yaml", tiny_model, short_corpus, centroid={"groups": {"x y": {"dtype": "fp32"}}})
    r = run_cli("run", str(bad), "--warehouse", str(wh2))
    assert r.returncode == 2 and "centroid.groups" in r.stderr and "'x y'" in r.stderr, r.stderr
