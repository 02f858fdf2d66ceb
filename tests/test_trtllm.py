"""TensorRT-LLM backend: its pure logic on CPU; the real engine only with CUDA (marker gpu)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from backends import trtllm_backend as T
from common.stack import StackDesc
from store.warehouse import widen
from tests.conftest import run_cli, write_spec


def _cell(options=None, **over):
    return StackDesc.of(
        **{
            "model": "m",
            "engine": "trtllm",
            "dtype": "bf16",
            "attention": "default",
            "tp": 1,
            "device": "h200",
            "options": tuple(sorted((options or {}).items())),
            **over,
        }
    )


def test_llm_arguments_turn_block_reuse_off_and_ask_for_context_logits():
    kw = T.llm_kwargs(_cell(), "/models/m", 4096)
    assert kw["kv_cache_config"] == {"enable_block_reuse": False} and kw["enable_chunked_prefill"] is False
    assert kw["backend"] == "pytorch" and kw["attn_backend"] == "TRTLLM" and kw["dtype"] == "bfloat16"
    assert "build_config" not in kw and "quant_config" not in kw
    eng = T.llm_kwargs(_cell(options={"trt_backend": "tensorrt"}, dtype="fp8", tp=2), "/m", 2048)
    assert eng["build_config"]["gather_context_logits"] is True and eng["build_config"]["max_seq_len"] == 2048
    assert eng["quant_config"] == {"quant_algo": "FP8"} and eng["tensor_parallel_size"] == 2
    assert "attn_backend" not in eng
    assert T.llm_kwargs(_cell(attention="flashinfer"), "/m", 64)["attn_backend"] == "FLASHINFER"
    assert T.sampling_kwargs() == {
        "max_tokens": 1,
        "return_context_logits": True,
        "temperature": 0.0,
        "detokenize": False,
    }


def test_context_logits_are_sliced_at_the_sampled_positions_in_native_dtype():
    ctx = torch.randn(40, 100).to(torch.bfloat16)  # (n_tokens, vocab) as the engine returns them
    native = T.native_rows(ctx)
    assert native.dtype == np.uint16
    np.testing.assert_array_equal(widen(native), ctx.float().numpy())  # bf16 bits kept exactly
    rows = T.slice_context(native, 40, [0, 32, 39])
    np.testing.assert_array_equal(rows, native[[0, 32, 39]])
    with pytest.raises(ValueError, match="block reuse on"):
        T.slice_context(native[8:], 40, [0])  # a reused prefix: only the suffix came back


def test_trtllm_cells_without_the_library_are_skipped_with_the_reason(tiny_model, short_corpus, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        include=[
            {"engine": "trtllm", "dtype": "bf16", "attention": "default", "device": "h200", "trt_backend": "tensorrt"},
            {"engine": "trtllm", "dtype": "bf16", "attention": "default", "device": "cpu"},
        ],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    import json

    skipped = {s["device"]: s["reason"] for s in json.loads(r.stdout)["skipped"]}
    if importlib.util.find_spec("tensorrt_llm") is None:
        assert "needs the Python package 'tensorrt_llm'" in skipped["h200"]
    assert "does not run on device cpu" in skipped["cpu"] or "tensorrt_llm" in skipped["cpu"]


@pytest.mark.gpu
def test_trtllm_real_context_logits_match_hf_on_gpu(tmp_path):
    if importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available():
        pytest.skip("needs tensorrt_llm and a CUDA GPU")
    import os

    model = os.environ.get("LOGIT_MATRIX_GPU_MODEL")
    if not model:
        pytest.skip("set LOGIT_MATRIX_GPU_MODEL to a local HF model directory")
    b = T.TrtllmBackend(_cell(dtype="bf16", device="cuda"), model, 4)
    b.load()
    try:
        ids = list(range(1, 65))
        rows = b.forward(ids, [0, 32, 63])
        assert rows.shape[0] == 3 and np.isfinite(widen(rows)).all()
        again = b.forward(ids, [0, 32, 63])
        np.testing.assert_array_equal(rows, again)  # bit-reproducible with block reuse off
    finally:
        b.close()
