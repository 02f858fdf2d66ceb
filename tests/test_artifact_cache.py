"""The artifact cache: keyed by content, not path; listed; pruned without touching what a running
cell holds (real MLX conversions of the 2-layer SmolLM2, a real sweep paused mid-run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

pytest.importorskip("mlx_lm")


def test_the_same_model_in_two_directories_converts_once(tiny_model, tmp_path, monkeypatch):
    from backends import artifacts
    from backends.mlx_backend import convert

    monkeypatch.setenv("LOGIT_MATRIX_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_model, a)
    shutil.copytree(tiny_model, b)
    first, second = convert(str(a), None, "fp32"), convert(str(b), None, "fp32")
    assert first["path"] == second["path"] and first["sha256"] == second["sha256"]
    assert first["recipe"]["source"] == str(a) and second["recipe"]["source"] == str(b)  # each cell says its own
    (only,) = artifacts.listing()
    assert only.kind == "mlx" and only.bytes > 1_000_000 and only.recipe["tool"] == "mlx_lm.convert"
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))  # other content: another artifact
    third = convert(str(b), None, "fp32")
    assert third["path"] != first["path"] and len(artifacts.listing()) == 2


def test_prune_spares_what_a_running_sweep_holds(tiny_model, short_corpus, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "LOGIT_MATRIX_CACHE": str(cache), "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        repeats=1,  # the MLX cell is held at its load, whatever the run's length
        reference={"engine": "hf", "dtype": "fp32"},
        include=[{"engine": "mlx", "dtype": "fp32", "attention": "default"}],
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "matrix", "run", str(spec), "--warehouse", str(tmp_path / "wh"), "--executor", "local"],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    lines, paused = [], None
    for line in p.stderr:
        lines.append(line)
        m = re.match(r"loaded \S+\.mlx\.\S+ on \S+ \(pid (\d+)\)", line)
        if m:
            paused = int(m.group(1))
            os.kill(paused, signal.SIGSTOP)  # the cell holds its artifact, mid-run
            break
    assert paused, "".join(lines)[-3000:]
    try:
        r = run_cli("cache", "prune", "--json", env={"LOGIT_MATRIX_CACHE": str(cache)})
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        held = [a for a in out["in_use"] if a["kind"] == "mlx"]
        assert len(held) == 1 and os.path.isdir(held[0]["dir"]), out
        assert "a running cell holds it" in r.stderr
    finally:
        os.kill(paused, signal.SIGCONT)
    lines += p.stderr.readlines()
    assert p.wait(timeout=300) == 0, "".join(lines)[-3000:]
    listed = run_cli(
        "cache", "list", "--warehouse", str(tmp_path / "wh"), "--json", env={"LOGIT_MATRIX_CACHE": str(cache)}
    )
    items = json.loads(listed.stdout)["artifacts"]
    assert [len(a["cells"]) for a in items if a["kind"] == "mlx"] == [1], items
    r = run_cli(
        "cache", "prune", "--keep-used-by", str(tmp_path / "wh"), "--json", env={"LOGIT_MATRIX_CACHE": str(cache)}
    )
    assert json.loads(r.stdout)["removed"] == []  # the warehouse's cell ran it
    r = run_cli("cache", "prune", "--json", env={"LOGIT_MATRIX_CACHE": str(cache)})
    assert [a["kind"] for a in json.loads(r.stdout)["removed"]] == ["mlx"] and not os.path.isdir(held[0]["dir"])
    bad = run_cli("cache", "prune", "--older-than", "soon", env={"LOGIT_MATRIX_CACHE": str(cache)})
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "matrix: error: --older-than: expected a duration like 30d, 12h or 90m, got 'soon'"
    ]
