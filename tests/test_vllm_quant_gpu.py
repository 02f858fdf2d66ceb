"""vLLM's quantised stacks on a GPU (marked gpu, skipped without CUDA and vLLM).

fp8 is quantised at load from the reference checkpoint (LOGIT_MATRIX_GPU_MODEL), against the HF
bf16 reference on the same GPU. Pre-quantised checkpoints (AWQ, GPTQ, ModelOpt NVFP4) cannot be
made on a GPU box without a model hub, so they come as directories of the same model:
LOGIT_MATRIX_GPU_QUANT_CHECKPOINTS="awq=/dir,gptq=/dir,nvfp4=/dir", each run as a candidate.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_cli, sql, write_spec

torch = pytest.importorskip("torch")
MODEL = os.environ.get("LOGIT_MATRIX_GPU_MODEL")
CHECKPOINTS = dict(kv.split("=", 1) for kv in os.environ.get("LOGIT_MATRIX_GPU_QUANT_CHECKPOINTS", "").split(",") if kv)


def _vllm() -> bool:
    from backends.vllm_backend import vllm_python

    return vllm_python() is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (MODEL and torch.cuda.is_available() and _vllm()), reason="needs CUDA, vLLM and LOGIT_MATRIX_GPU_MODEL"
    ),
]


def _sweep(tmp_path, short_corpus, include=(), candidates=()):
    spec = write_spec(
        tmp_path / "spec.yaml",
        MODEL,
        short_corpus,
        dtypes=["bf16"],
        attention=["eager"],
        devices=["cuda"],
        reference={"engine": "hf", "dtype": "bf16", "attention": "eager"},
        repeats=2,
        include=list(include),
        candidates=list(candidates),
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    return wh


def test_vllm_fp8_quantised_at_load_against_the_bf16_reference(tmp_path, short_corpus):
    wh = _sweep(tmp_path, short_corpus, include=[{"engine": "vllm", "dtype": "fp8", "attention": "default"}])
    (row,) = sql(
        wh,
        "select c.status, c.settings, c.bit_reproducible, s.kld_mean, s.top1_agreement "
        "from cells c join summary s using (cell_id) where c.engine = 'vllm'",
    )
    settings = json.loads(row["settings"])
    assert row["status"] == "done" and settings["quantization"] == "fp8", settings
    assert settings["engine_args"]["quantization"] == "fp8" and settings["engine_args"]["dtype"] == "bfloat16"
    assert 0 < row["kld_mean"] < 0.1 and row["top1_agreement"] > 0.8, row
    print("GPU_VLLM_FP8 " + json.dumps({k: row[k] for k in ("kld_mean", "top1_agreement", "bit_reproducible")}))


@pytest.mark.skipif(not CHECKPOINTS, reason="needs LOGIT_MATRIX_GPU_QUANT_CHECKPOINTS (awq=DIR,gptq=DIR,nvfp4=DIR)")
def test_vllm_runs_pre_quantised_checkpoints_as_candidates(tmp_path, short_corpus):
    cands = [
        {"model": "tiny", "engine": "vllm", "path": d, "attention": "default", "name": k}
        for k, d in sorted(CHECKPOINTS.items())
    ]
    wh = _sweep(tmp_path, short_corpus, candidates=cands)
    rows = sql(
        wh,
        "select c.dtype, c.status, c.skip_reason, c.error, c.settings, c.artifact_recipe, s.kld_mean "
        "from cells c left join summary s using (cell_id) where c.engine = 'vllm'",
    )
    got = {json.loads(r["artifact_recipe"] or "{}").get("label"): r for r in rows}
    for name in CHECKPOINTS:
        r = got[name]
        if r["status"] == "skipped":  # e.g. nvfp4 on a GPU that is not Blackwell: said, not failed
            assert r["skip_reason"], r
            continue
        assert r["status"] == "done" and r["dtype"] == name, r
        assert json.loads(r["settings"])["quantization"], r
        assert 0 < r["kld_mean"] < 0.5, r
