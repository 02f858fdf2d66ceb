"""The C kernels (common/native.py): built once per machine into the cache, the numpy twin where
no compiler is, and the same numbers either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, numpy as np
from analysis import metrics as M
from store.floors import Storage
rng = np.random.default_rng(5)
a = (rng.standard_normal((20, 3001)) * 3).astype(np.float32)
b = (a + 0.2 * rng.standard_normal(a.shape)).astype(np.float32)
m = M.row_metrics(a, b, np.arange(20))
st = Storage("bf16")
stored, shift = st.keep(a)
print(json.dumps({"mode": M.kernel_mode(), "kld": m["kld"].tolist(), "js": m["js"].tolist(),
                  "top10": m["top10_overlap"].tolist(), "bits": int(stored.astype(np.int64).sum()),
                  "shift": shift.tolist(), "floor": st.floor_sum}))
"""


def probe(tmp_path: Path, **env) -> tuple[dict, str]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LOGIT_MATRIX_CACHE": str(tmp_path), **env},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_built_once_into_the_cache_and_the_numpy_twin_without_a_compiler(tmp_path):
    native, err = probe(tmp_path)
    assert native["mode"] == "native" and "could not be built" not in err
    built = sorted(p.name for p in (tmp_path / "kernels").glob("*.so"))
    assert [n.split("-")[0] for n in built] == ["floors_kernel", "metrics_kernel"]
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")}
    again, _ = probe(tmp_path)  # a second process loads what the first built
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")} == stamps
    assert again == native

    bare, err = probe(tmp_path / "bare", CC=str(tmp_path / "no-such-cc"))
    assert bare["mode"] == "numpy"
    assert err.count("could not be built") == 2 and "Traceback" not in err  # one line per kernel, once
    np.testing.assert_allclose(bare["kld"], native["kld"], rtol=1e-12)
    np.testing.assert_allclose(bare["js"], native["js"], rtol=1e-11)
    assert bare["top10"] == native["top10"] and bare["bits"] == native["bits"] and bare["shift"] == native["shift"]
    np.testing.assert_allclose(bare["floor"], native["floor"], rtol=1e-4)  # float32 sums in numpy, float64 in C
    assert not (tmp_path / "bare" / "kernels").exists() or not list((tmp_path / "bare" / "kernels").glob("*.so"))


def test_the_scalar_build_without_libmvec_gives_the_same_metrics(tmp_path):
    vector, _ = probe(tmp_path / "vector")
    # the scalar variants alone, as where glibc's libmvec is missing (macOS, musl)
    only_scalar = "from common import native; native.VARIANTS = native.VARIANTS[1:]\n"
    run = subprocess.run(
        [sys.executable, "-c", only_scalar + PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LOGIT_MATRIX_CACHE": str(tmp_path / "s")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    scalar = json.loads(run.stdout.strip().splitlines()[-1])
    assert scalar["mode"] == "native"
    np.testing.assert_allclose(scalar["kld"], vector["kld"], rtol=1e-12)
    np.testing.assert_allclose(scalar["js"], vector["js"], rtol=1e-11)
    assert scalar["bits"] == vector["bits"] and scalar["shift"] == vector["shift"]
