"""HF stacks on a CUDA device (marked gpu; run on a GPU box, skipped elsewhere).

LOGIT_MATRIX_GPU_MODEL names an HF model directory (a GPU box may have no
package index, so the model travels with the command). Checks: bf16 and fp32
captures are bit-reproducible on the GPU; the GPU's fp32 logits agree with the
CPU's; the GPU's bf16 drift from the CPU is measured (KL, top-1), not assumed.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
MODEL = os.environ.get("LOGIT_MATRIX_GPU_MODEL")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (MODEL and torch.cuda.is_available()), reason="needs CUDA and LOGIT_MATRIX_GPU_MODEL"),
]

IDS = [1, 504, 3365, 8187, 418, 3732, 28, 564, 260, 9726, 5001, 15407, 1326, 1069, 9043, 31, 2] * 40


def run(dtype, attention, device, threads=8):
    from backends.hf_backend import HFBackend
    from common.positions import Positions
    from common.stack import StackDesc

    be = HFBackend(StackDesc.of("hf", dtype, attention, device=device), MODEL, threads)
    be.load()
    pos = Positions.every(32).of(len(IDS))
    return be, be.forward(IDS, pos), be.forward(IDS, pos)


def test_cuda_stacks_are_bit_reproducible_and_drift_from_cpu_is_measured():
    from analysis.metrics import row_metrics
    from store.warehouse import widen

    report = {}
    for dtype in ("fp32", "bf16"):
        for attention in ("eager", "sdpa"):
            be, g1, g2 = run(dtype, attention, "h200")
            assert np.array_equal(g1, g2), (dtype, attention)  # same settings twice: same bits
            _, c1, _ = run(dtype, attention, "cpu")
            m = row_metrics(widen(c1), widen(g1), np.full(len(g1), -1))
            report[f"{dtype}.{attention}"] = {
                "gpu": be.settings()["gpu"],
                "max_abs_diff": float(m["max_abs_diff"].max()),
                "kld_mean": float(m["kld"].mean()),
                "top1": float(m["top1_match"].mean()),
            }
            if dtype == "fp32":
                assert m["max_abs_diff"].max() < 5e-3, report  # TF32 is off by default for matmul
            else:
                assert m["kld"].mean() < 0.05 and m["top1_match"].mean() >= 0.8, report
    print("GPU_REPORT " + json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_report.json"), "w") as f:
            json.dump(report, f, indent=1)


@pytest.mark.skipif(
    not (MODEL and torch.cuda.is_available() and torch.cuda.device_count() >= 2),
    reason="needs 2 CUDA GPUs and LOGIT_MATRIX_GPU_MODEL (heads divisible by 2)",
)
def test_hf_tp2_over_nccl_matches_tp1(tmp_path, short_corpus):
    from pathlib import Path

    from tests.conftest import run_cli, sql, write_spec

    spec = write_spec(
        tmp_path / "tp.yaml",
        Path(MODEL),
        short_corpus,
        dtypes=["fp32"],
        attention=["sdpa"],
        devices=["cuda"],
        tp=[1, 2],
        repeats=2,
        reference={"engine": "hf", "dtype": "fp32", "device": "cuda", "tp": 1},
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    tp2 = sql(wh, "select cell_id, status, bit_reproducible, settings from cells where tp = 2")[0]
    assert tp2["status"] == "done" and tp2["bit_reproducible"], tp2
    tp = json.loads(tp2["settings"])["tensor_parallel"]
    assert tp["backend"] == "nccl" and len(tp["cuda_visible_devices"].split(",")) == 2, tp  # both GPUs, P2P
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    m = sql(
        wh, f"select max(max_abs_diff) as d, min(top1_match::int) as t from metrics where cell_id = '{tp2['cell_id']}'"
    )[0]
    assert m["d"] < 1e-2 and m["t"] == 1, m
