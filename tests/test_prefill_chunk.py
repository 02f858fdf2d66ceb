"""Prefill chunking, a plug-in axis (extras/prefill_chunk.py), on the real 2-layer SmolLM2 cut: each
prompt fed again in chunks of N tokens that continue the KV cache, its rows graded against the same
cell's whole prefill in the view the plug-in declares, and that view checked against a float64 KL
computed from the stored rows; its card line and report chart."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from backends import vllm_backend as V
from common.stack import StackDesc
from store.warehouse import widen
from tests.conftest import run_cli, sql, write_spec
from tests.float64_rows import log_softmax, matrix
from tests.test_report_browser import MODEL_CHARTS, check_report, needs_chromium

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

pytest.importorskip("llama_cpp")

VLLM = V.vllm_python() is not None

IDS = [(i * 7919) % 49000 + 100 for i in range(150)]
SIZES = [16, 64]


def test_each_engine_feeds_a_prompt_in_chunks_that_continue_its_kv_cache(tiny_model):
    """chunked_rows(ids, positions, N) against one whole forward at the same positions: the same
    argmax, rows within a measured distance; a chunk as long as the prompt is a whole prefill."""
    from backends.hf_backend import HFBackend
    from backends.llamacpp_backend import LlamaCppBackend

    keep = [0, 15, 16, 40, 63, 64, 100, 149]  # chunk edges on both sides
    for cls, dtype, att in ((HFBackend, "fp32", "eager"), (LlamaCppBackend, "f16", "default")):
        be = cls(StackDesc.of(cls.engine, dtype, att), str(tiny_model), 2)
        be.load()
        whole = widen(be.forward(IDS, keep))  # (rows, vocab)
        for n in SIZES:
            got = widen(be.chunked_rows(IDS, keep, n))
            assert got.shape == whole.shape == (len(keep), 49152)
            assert (got.argmax(-1) == whole.argmax(-1)).all(), (cls.engine, n)
            assert np.abs(got - whole).max() < 0.1, (cls.engine, n, float(np.abs(got - whole).max()))
        # one chunk holding the whole prompt is the whole prefill, bit for bit
        assert np.array_equal(be.chunked_rows(IDS, keep, len(IDS)), be.forward(IDS, keep)), cls.engine


@pytest.fixture(scope="module")
def chunked(tiny_model, short_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("chunked")
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        include=[
            {"engine": "hf", "dtype": "fp32", "attention": "sdpa", "prefill_chunk": SIZES},
            {"engine": "llamacpp", "dtype": "f16", "attention": "default", "prefill_chunk": SIZES},
            # vLLM's chunked prefill (its scheduler's per-step budget); skipped, saying why, without .venv-vllm
            {"engine": "vllm", "dtype": "fp32", "attention": "default", "prefill_chunk": SIZES},
        ],
    )
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    a = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert a.returncode == 0, a.stderr[-3000:]
    return wh, json.loads(a.stdout)


def _oracle(wh, cell_id: str) -> dict[int, dict]:
    """Per chunk size, from the cell's side file alone: float64 KL(whole ‖ chunked) of each row pair."""
    t = pq.read_table(wh / "logits" / cell_id / "d0.parquet")
    x = matrix(t["logits"])  # (rows, vocab) float64
    keys = list(
        zip(t["path"].to_pylist(), t["prompt_id"].to_pylist(), t["position"].to_pylist(), t["step"].to_pylist())
    )
    at = {k: i for i, k in enumerate(keys)}
    same = t["row_hash"].to_pylist()
    out: dict[int, dict] = {}
    for (path, prompt, pos, step), i in at.items():
        if path != "chunked":
            continue
        j = at[("prefill", prompt, pos, 0)]  # the whole prefill's row, stored once for every size
        p, q = log_softmax(x[j]), log_softmax(x[i])
        o = out.setdefault(step, {"kld": [], "identical": 0, "top1": []})
        o["kld"].append(float(np.sum(np.exp(p) * (p - q))))
        o["identical"] += same[i] == same[j]
        o["top1"].append(x[i].argmax() == x[j].argmax())
    return out


def test_the_graded_view_is_a_float64_kl_of_the_stored_rows(chunked):
    wh, summary = chunked
    engines = ["hf", "llamacpp", *(["vllm"] if VLLM else [])]
    assert summary["decode"]["cells"] == len(engines)
    cells = {c["engine"]: c for c in sql(wh, "select * from cells where settings like '%prefill_chunk%'")}
    assert sorted(cells) == engines
    view = sql(wh, "select * from prefill_chunk_drift order by engine, chunk")
    assert [(v["engine"], v["chunk"]) for v in view] == [(e, n) for e in engines for n in SIZES]
    for v in view:
        cell = cells[v["engine"]]
        o = _oracle(wh, cell["cell_id"])[v["chunk"]]
        assert v["rows"] == len(o["kld"]) == cell["rows_per_repeat"], v
        side = pq.read_metadata(wh / "logits" / cell["cell_id"] / "d0.parquet").num_rows
        assert side == (1 + len(SIZES)) * cell["rows_per_repeat"]  # the whole prefill's rows once, a chunked per size
        assert v["kld_mean"] == pytest.approx(np.mean(o["kld"]), rel=1e-9, abs=1e-15), v
        # one row's KL sums a vocabulary of terms: its rounding is ~1e-15 absolute (HF's rows ~1e-11 apart)
        assert v["kld_max"] == pytest.approx(max(o["kld"]), rel=1e-9, abs=1e-13), v
        assert v["identical_rows"] == o["identical"] and v["top1_agreement"] == pytest.approx(np.mean(o["top1"]))
        assert v["kld_vs_reference"] is not None and v["kld_whole_vs_reference"] is not None
    settings = json.loads(cells["llamacpp"]["settings"])["prefill_chunk"]
    assert settings == {"sizes": SIZES, "whole": {"n_batch": 2048, "n_ubatch": 512}}
    if VLLM:  # measured on a Xeon with AMX: bit for bit the whole prefill's rows in steps of 16 or 64
        whole = json.loads(cells["vllm"]["settings"])["prefill_chunk"]["whole"]
        assert whole == {"max_num_batched_tokens": V.MAX_MODEL_LEN}, whole
        vl = [v for v in view if v["engine"] == "vllm"]
        assert all(v["top1_agreement"] == 1.0 and v["kld_max"] < 1e-6 for v in vl), vl
    # llama.cpp's chunks run other ubatch shapes than its whole prefill: measured apart, top-1 kept
    ll = [v for v in view if v["engine"] == "llamacpp"]
    assert all(v["kld_max"] > 0 and v["top1_agreement"] >= 0.98 for v in ll), ll


def test_its_card_line_and_report_chart(chunked, tmp_path):
    wh, _ = chunked
    cid = sql(wh, "select cell_id from cells where engine = 'llamacpp'")[0]["cell_id"]
    r = run_cli("card", cid, "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("Prefill in chunks of")]
    assert [line.split()[4] for line in lines] == ["16", "64"] and "rows bit-identical" in lines[0], r.stdout
    r = run_cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>Prefill in chunks</h2>" in page and 'id="prefill-chunk"' in page


@needs_chromium
def test_the_chunk_chart_renders_in_headless_chromium(chunked, tmp_path):
    """The report's browser check (tests/test_report_browser.py) over this warehouse: the chunk
    chart drawn with a line per chunked cell, its labels clear of each other."""
    wh, _ = chunked
    got = check_report(wh, tmp_path, ["prefill-chunk", *(c.format(k=0) for c in MODEL_CHARTS)])
    chart = {c["id"]: c for c in got["charts"]}["prefill-chunk"]
    # a cell bit-identical at every size (vLLM on CPU, fp32) has no point on the log axis: its rows are in the table
    positive = {v["cell_id"] for v in sql(wh, "select cell_id from prefill_chunk_drift where kld_mean > 0")}
    assert chart["series"] == len(positive) >= 1, chart  # llama.cpp's chunks, at least, run other kernels


def test_a_bad_chunk_size_is_one_line_exit_2(tiny_model, short_corpus, tmp_path):
    bad = write_spec(
        tmp_path / "c.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        prefill_chunk=[16, 0],
    )
    r = run_cli("cells", str(bad))
    assert r.returncode == 2, r.stderr
    assert "c.yaml: prefill_chunk: must be a chunk size in tokens or a non-empty list of them" in r.stderr, r.stderr
    # an engine without the hook (MLX here) is skipped with the reason, the others planned
    spec = write_spec(
        tmp_path / "m.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        include=[{"engine": "mlx", "dtype": "fp32", "attention": "default", "prefill_chunk": 32}],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    skipped = json.loads(r.stdout)["skipped"]
    assert [s["reason"] for s in skipped] == [
        "engine mlx cannot feed a prompt in chunks here (the cell asks for prefill_chunk)"
    ], skipped
