"""Faults met the way a user meets them, on real Ray and the real engines (the 2-layer SmolLM2).

Each test checks the rows exactly: every captured cell has the row count its prompts give at the
spec's stride, and its repeats hash the same (bit-reproducible), before and after the fault.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from backends.base import sampled_positions
from tests.conftest import REPO, sql, write_spec

STRIDE = 16


def _popen(*args: str, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.Popen([sys.executable, "-m", "matrix", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "matrix", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def expected_rows(wh: Path, max_tokens: int | None = None) -> int:
    """Rows per repeat the prompts give at STRIDE (what every complete shard must hold)."""
    n = [p["n_tokens"] for p in sql(wh, "select n_tokens from prompts")]
    return sum(len(sampled_positions(min(t, max_tokens or t), STRIDE)) for t in n)


def row_hashes(wh: Path, cell_id: str) -> dict[int, list[str]]:
    rows = sql(wh, f"select repeat, prompt_id, position, row_hash from logits where cell_id = '{cell_id}' "
                   "order by repeat, prompt_id, position")
    out: dict[int, list[str]] = {}
    for r in rows:
        out.setdefault(r["repeat"], []).append(r["row_hash"])
    return out


def assert_exact(wh: Path, cell: dict, repeats: int) -> None:
    """A done cell: every repeat complete, with rows that hash the same in every repeat."""
    hashes = row_hashes(wh, cell["cell_id"])
    assert sorted(hashes) == list(range(repeats)), (cell["cell_id"], sorted(hashes))
    want = expected_rows(wh, cell.get("max_tokens"))
    assert all(len(h) == want for h in hashes.values()), (cell["cell_id"], {r: len(h) for r, h in hashes.items()}, want)
    assert all(h == hashes[0] for h in hashes.values()), cell["cell_id"]
    assert cell["rows_per_repeat"] == want and cell["bit_reproducible"]


def test_sigkill_of_one_actor_retries_only_that_cell(tiny_model, short_corpus, tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32", "bf16"], attention=["eager"],
                      reference={"engine": "hf", "dtype": "fp32"}, repeats=3, stride=STRIDE)
    wh = tmp_path / "wh"
    p = _popen("run", str(spec), "--warehouse", str(wh))
    killed, lines = None, []
    for line in p.stderr:
        lines.append(line)
        m = re.match(r"loaded (\S+\.bf16\.\S+) on \S+ \(pid (\d+)\)", line)
        if m and killed is None:
            os.kill(int(m.group(2)), signal.SIGKILL)  # the bf16 cell's actor, while the fp32 cell captures
            killed = m.group(1)
    assert p.wait(timeout=60) == 0, "".join(lines)[-3000:]
    assert killed, "".join(lines)[-3000:]
    log = "".join(lines)
    assert f"{killed}: " in log and "starting it again (attempt 2 of at most 3)" in log
    cells = {c["dtype"]: c for c in sql(wh, "select * from cells")}
    assert {d: (c["status"], c["attempts"]) for d, c in cells.items()} == {"fp32": ("done", 1), "bf16": ("done", 2)}
    for c in cells.values():
        assert_exact(wh, c, 3)
    (run,) = sql(wh, "select status, cells_done, cells_failed, rows_written from runs")
    assert run["status"] == "done" and run["cells_done"] == 2 and run["cells_failed"] == 0


def test_a_cell_that_fails_is_recorded_the_others_complete_and_a_rerun_retries_only_it(
        tiny_model, short_corpus, tmp_path):
    """llama.cpp cannot make a quantised V cache without flash attention: a real engine error on
    the cell's own settings, raised again on every try (not retried within the run)."""
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32"], attention=["eager"],
                      include=[{"engine": "llamacpp", "dtype": "f16", "attention": "eager", "kv_cache": "q8_0"}],
                      reference={"engine": "hf", "dtype": "fp32"}, repeats=2, stride=STRIDE)
    wh = tmp_path / "wh"
    r = _run("run", str(spec), "--warehouse", str(wh), "--json")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    (bad,) = out["failed"]
    assert out["failed"][bad] == "RuntimeError: llama.cpp could not create a context"
    assert r.stderr.strip().splitlines()[-1] == f"  {bad}: RuntimeError: llama.cpp could not create a context"
    cells = {c["engine"]: c for c in sql(wh, "select * from cells")}
    assert (cells["llamacpp"]["status"], cells["llamacpp"]["error_class"], cells["llamacpp"]["attempts"]) == \
        ("failed", "RuntimeError", 1)
    assert cells["llamacpp"]["error"] == "llama.cpp could not create a context"
    assert sql(wh, f"select count(*) as n from logits where cell_id = '{bad}'") == [{"n": 0}]
    assert_exact(wh, cells["hf"], 2)
    hf_hashes = row_hashes(wh, cells["hf"]["cell_id"])
    (run,) = sql(wh, "select status, cells_done, cells_failed from runs")
    assert (run["status"], run["cells_done"], run["cells_failed"]) == ("done", 1, 1)

    again = _run("run", str(spec), "--warehouse", str(wh), "--json")
    assert again.returncode == 1
    assert json.loads(again.stdout)["cells_run"] == 1  # only the failed cell, the HF cell is complete
    assert row_hashes(wh, cells["hf"]["cell_id"]) == hf_hashes
    skip = _run("run", str(spec), "--warehouse", str(wh), "--json", "--skip-failed")
    assert skip.returncode == 0, skip.stderr[-2000:]
    summary = json.loads(skip.stdout)
    assert summary["cells_run"] == 0 and "--skip-failed" in summary["left_out"][bad.partition("@")[0]]
    r = _run("analyze", "--warehouse", str(wh))  # a failed cell has no rows: analysis goes on without it
    assert r.returncode == 0, r.stderr[-2000:]


def test_sigterm_is_an_interrupt_and_the_run_resumes(tiny_model, short_corpus, tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32", "bf16"], attention=["eager"],
                      reference={"engine": "hf", "dtype": "fp32"}, repeats=2, stride=STRIDE)
    wh = tmp_path / "wh"
    p = _popen("run", str(spec), "--warehouse", str(wh))
    lines = []
    for line in p.stderr:
        lines.append(line)
        if " done" in line and line.startswith("[cells"):  # one cell finished: the runs row says so
            p.send_signal(signal.SIGTERM)
            break
    lines += p.stderr.readlines()
    assert p.wait(timeout=120) == 130, "".join(lines)[-3000:]
    assert lines[-1].strip() == "matrix: interrupted; run the same command again to resume", lines[-3:]
    assert not any("Traceback" in line for line in lines)
    (run,) = sql(wh, "select status, cells_done, rows_written from runs")
    assert run["status"] == "interrupted" and run["cells_done"] >= 1 and run["rows_written"] > 0
    r = _run("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    for c in sql(wh, "select * from cells"):
        assert_exact(wh, c, 2)


def _node_of(cluster, pid: int):
    """The cluster_utils node whose raylet is the parent of this worker process."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    return next(n for n in cluster.worker_nodes if n.all_processes["raylet"][0].process.pid == ppid)


def test_a_node_that_leaves_mid_capture_its_cell_completes_on_another(tiny_model, short_corpus, tmp_path):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        c.add_node(num_cpus=1)
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["bf16"], attention=["eager"],
                          reference={"engine": "hf", "dtype": "bf16"}, repeats=4, stride=STRIDE)
        wh = tmp_path / "wh"
        p = _popen("run", str(spec), "--warehouse", str(wh), "--address", c.address)
        lines, removed = [], False
        for line in p.stderr:
            lines.append(line)
            m = re.match(r"loaded \S+ on \S+ \(pid (\d+)\)", line)
            if m and not removed:  # the node whose raylet started the cell's actor leaves
                c.remove_node(_node_of(c, int(m.group(1))), allow_graceful=False)
                removed = True
        assert p.wait(timeout=60) == 0, "".join(lines)[-3000:]
        log = "".join(lines)
        assert removed and "starting it again (attempt 2" in log, log[-3000:]
        (cell,) = sql(wh, "select * from cells")
        assert cell["status"] == "done" and cell["attempts"] >= 2
        assert_exact(wh, cell, 4)
    finally:
        c.shutdown()


def test_a_frozen_actor_is_stopped_by_the_time_limit(tiny_model, short_corpus, tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_model, short_corpus, dtypes=["fp32", "bf16"], attention=["eager"],
                      reference={"engine": "hf", "dtype": "fp32"}, repeats=2, stride=STRIDE, capture_timeout_s=8)
    wh = tmp_path / "wh"
    p = _popen("run", str(spec), "--warehouse", str(wh), LOGIT_MATRIX_HEARTBEAT_S="3")
    frozen, lines = None, []
    for line in p.stderr:
        lines.append(line)
        m = re.match(r"loaded (\S+\.bf16\.\S+) on \S+ \(pid (\d+)\)", line)
        if m and frozen is None:
            os.kill(int(m.group(2)), signal.SIGSTOP)  # the engine hangs: no error, no progress
            frozen = m.group(1)
    assert p.wait(timeout=60) == 1, "".join(lines)[-3000:]
    log = "".join(lines)
    assert f"{frozen} FAILED after 1 attempt(s): Timeout: " in log and "ran past 8s (capture_timeout_s)" in log
    assert re.search(rf"running: .*{re.escape(frozen)} (tokenizer parity|capture r0) for \d+s", log), log[-2000:]
    cells = {c["dtype"]: c for c in sql(wh, "select * from cells")}
    assert (cells["bf16"]["status"], cells["bf16"]["error_class"]) == ("failed", "Timeout")
    assert_exact(wh, cells["fp32"], 2)
