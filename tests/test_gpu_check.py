"""scripts/gpu-check.sh end to end on its CPU path, in an environment with what a bare CUDA image
has (no ray, duckdb, llama-cpp-python, vllm, mlx; gguf and accelerate only as the wheels it
carries), then the dev box's side: the CPU fp32 reference of the same file, the merge, the analysis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli, sql

BARE_DROPS = [
    "ray",
    "duckdb",
    "llama-cpp-python",
    "vllm",
    "mlx",
    "mlx-lm",
    "mlx-cpu",
    "gguf",
    "accelerate",
    "psutil",
    "logit-matrix",
]

pytestmark = pytest.mark.slow  # downloads the carried wheels (make gpu-wheels) and captures in a bare environment


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-check")
    subprocess.run(
        [sys.executable, "scripts/bare_env.py", str(d / "bare"), "--drop", *BARE_DROPS],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    w = subprocess.run(
        ["make", "gpu-wheels", f"GPU_WHEELS_DIR={d / 'wheels'}"], cwd=REPO, capture_output=True, text=True
    )
    assert w.returncode == 0, w.stderr[-2000:]
    cut = run_cli("models", "cut", "smollm2-135m", "--layers", "1", "--gguf", "--out", str(d / "m1.gguf"))
    assert cut.returncode == 0, cut.stderr[-2000:]
    subprocess.run(["xz", "-0", "-T2", str(d / "m1.gguf")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(d / "bare" / "bin" / "python"), GPU_CHECK_WHEELS=str(d / "wheels"), CUDA_VISIBLE_DEVICES="")
    env["GPU_CHECK_BATCH"] = "[1, 2]"  # HF bf16 at batch 1 and 2 too (the GPU run: [1, 8, 32])
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh", str(d / "m1.gguf.xz"), str(d / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return d, r.stdout + r.stderr


def test_the_bare_environment_lacks_what_the_image_lacks(gpu_check):
    d, _ = gpu_check
    mods = "('ray', 'duckdb', 'llama_cpp', 'mlx', 'gguf', 'accelerate')"
    probe = f"import importlib.util as u; print([m for m in {mods} if u.find_spec(m)])"
    out = subprocess.run([str(d / "bare" / "bin" / "python"), "-c", probe], capture_output=True, text=True, cwd=d)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cpu_path_captures_every_kernel_within_the_size_limits(gpu_check):
    d, log = gpu_check
    wheels = {m[1]: int(m[2]) for m in re.finditer(r"carried wheel (\S+\.whl) \((\d+) KiB\)", log)}
    assert sorted(w.split("-")[0] for w in wheels) == ["accelerate", "gguf"], log[-3000:]
    assert f"carried wheels: {sum((d / 'wheels' / w).stat().st_size for w in wheels) // 1024} KiB in all" in log
    assert "no CUDA device here: the CPU path" in log
    assert log.count("PyTorch has that SDPA kernel on CUDA devices only") == 6  # efficient, cudnn x 3 dtypes
    files = [p for p in (d / "out").rglob("*") if p.is_file()]
    assert max(p.stat().st_size for p in files) < 16 * 2**20 and sum(p.stat().st_size for p in files) < 64 * 2**20
    summary = json.loads((d / "out" / "summary.json").read_text())
    got = {tuple(c["cell_id"].split(".")[2:4]) for c in summary}
    assert got == {(dt, a) for dt in ("fp32", "bf16", "f16") for a in ("eager", "sdpa_math", "sdpa_flash")}
    assert len(summary) == 9 + 6  # and bf16 at batch 1 and 2 for each of the three
    assert all(c["status"] == "done" and c["bit_reproducible"] for c in summary)
    assert all(c["nvml"].startswith("no NVIDIA GPU") for c in summary), summary[0]
    (run,) = sql(d / "out" / "warehouse", "select executor, ray_address, status from runs")
    assert run == {"executor": "local", "ray_address": None, "status": "done"}


def test_merged_into_the_cpu_reference_and_analysed(gpu_check):
    d, _ = gpu_check
    ref = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--reference", str(d / "m1.gguf.xz"), str(d / "ref")],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(d / "wheels")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    wh = d / "ref" / "warehouse"
    m = run_cli("merge", str(d / "out" / "warehouse"), "--into", str(wh), "--json")
    assert m.returncode == 0 and len(json.loads(m.stdout)["sources"][0]["merged"]) == 15, m.stderr[-2000:]
    reference = (d / "ref" / "reference-cell").read_text().strip()
    a = run_cli("analyze", "--warehouse", str(wh), "--reference", reference)
    assert a.returncode == 0, a.stderr[-2000:]
    kl = {
        (r["dtype"], r["attention"]): r["kld_mean"]
        for r in sql(
            wh,
            f"select c.dtype, c.attention, s.kld_mean from summary s join cells c using (cell_id) "
            f"where s.cell_id <> '{reference}' and c.batch_size is null",
        )
    }
    assert len(kl) == 9 and kl[("fp32", "eager")] == 0.0  # the same stack on the same CPU: bit-identical
    for a_ in ("eager", "sdpa_math", "sdpa_flash"):
        assert kl[("fp32", a_)] < 1e-8 < kl[("f16", a_)] < kl[("bf16", a_)] < 1e-2, kl
    drift = sql(wh, "select attention, batch_size, rows, kld_mean from batch_drift order by attention")
    assert [(r["attention"], r["batch_size"]) for r in drift] == [("eager", 2), ("sdpa_flash", 2), ("sdpa_math", 2)]
    assert all(r["rows"] > 0 and r["kld_mean"] < 1e-2 for r in drift), drift
