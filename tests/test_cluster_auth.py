"""The local cluster `matrix run` starts is not left open: Ray's ports listen on every interface,
so it runs in token mode with a token only this user can read."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # starts a Ray cluster

SCRIPT = r"""
import json, os, subprocess, sys
from matrix.run.cluster import init_ray
ray = init_ray(None)
gcs = ray.get_runtime_context().gcs_address
code = "import ray; ray.init(address=%r, log_to_driver=False); print('connected', ray.cluster_resources()['CPU'])" % gcs
clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
out = {}
for name, env in (("no token", {**clean, "RAY_AUTH_MODE": "disabled"}),
                  ("wrong token", {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
                  ("its token", dict(os.environ))):
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    out[name] = {"rc": r.returncode, "out": r.stdout + r.stderr}
out["mode"] = os.environ.get("RAY_AUTH_MODE")
print(json.dumps(out))
ray.shutdown()
"""


def test_local_cluster_runs_with_a_private_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(LOGIT_MATRIX_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["mode"] == "token"
    assert got["no token"]["rc"] != 0 and "auth" in got["no token"]["out"].lower(), got["no token"]["out"][-1500:]
    assert got["wrong token"]["rc"] != 0 and "InvalidAuthToken" in got["wrong token"]["out"], got["wrong token"]["out"][
        -1500:
    ]
    assert got["its token"]["rc"] == 0 and "connected" in got["its token"]["out"], got["its token"]["out"][-1500:]
    token_file = tmp_path / "cache" / "ray-auth-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert len(token) == 64 and token not in r.stdout + r.stderr


def test_matrix_run_and_analyze_start_their_token_cluster(tiny_model, short_corpus, tmp_path):
    """`matrix run` as a user types it (no RAY_AUTH_* in the environment, as in `make demo`): Ray's
    auth settings are read once, at `import ray`, so nothing may import it before init_ray sets them."""
    from tests.conftest import sql, write_spec

    spec = write_spec(
        tmp_path / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(LOGIT_MATRIX_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "matrix", "run", str(spec), "--warehouse", str(tmp_path / "wh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sql(tmp_path / "wh", "select status, executor, ray_address from runs")
    assert [(x["status"], x["executor"]) for x in runs] == [("done", "ray")] and runs[0]["ray_address"], runs
    assert (tmp_path / "cache" / "ray-auth-token").is_file()
    a = subprocess.run(
        [sys.executable, "-m", "matrix", "analyze", "--workers", "2", "--warehouse", str(tmp_path / "wh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )  # its Ray tasks: the same order
    assert a.returncode == 0 and "2 at a time" in a.stderr, a.stderr[-3000:]
