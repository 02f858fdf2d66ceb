"""Faults met the way a user meets them, on real Ray and the real engines (the 2-layer SmolLM2).

Each test checks the rows exactly: every captured cell has the row count its prompts give at the
spec's stride, and its repeats hash the same (bit-reproducible), before and after the fault.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.positions import Positions
from tests.conftest import REPO, run_cli, shared_cluster, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

STRIDE = 16
REMOVED_NODE_REPEATS = 24


def _popen(*args: str, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.Popen(
        [sys.executable, "-m", "matrix", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _run(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout, env=env)


def _on(executor: str) -> tuple[str, ...]:
    """The flags of a run on this executor: Ray's is this pytest worker's cluster (the tests kill
    actors and hosts, never a node, so the cluster itself stays as it was)."""
    return ("--executor", "local") if executor == "local" else ("--address", shared_cluster())


def expected_rows(wh: Path, max_tokens: int | None = None) -> int:
    """Rows per repeat the prompts give at STRIDE (what every complete shard must hold)."""
    ids = [p["token_ids"] for p in sql(wh, "select token_ids from prompts")]
    return sum(len(Positions.every(STRIDE).fed(t, max_tokens)[1]) for t in ids)


def row_hashes(wh: Path, cell_id: str) -> dict[int, list[str]]:
    rows = sql(
        wh,
        f"select repeat, prompt_id, position, row_hash from logits where cell_id = '{cell_id}' "
        "order by repeat, prompt_id, position",
    )
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


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_sigkill_of_one_actor_retries_only_that_cell(tiny_model, short_corpus, tmp_path, executor):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=3,
        stride=STRIDE,
    )
    wh = tmp_path / "wh"
    p = _popen("run", str(spec), "--warehouse", str(wh), *_on(executor))
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


def cut_short(model_dir: Path, where: Path) -> Path:
    """A copy of the checkpoint whose weights file stops halfway: safetensors refuses its header."""
    shutil.copytree(model_dir, where)
    (f,) = where.glob("*.safetensors")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return where


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_a_cell_that_fails_is_recorded_the_others_complete_and_a_rerun_retries_only_it(
    tiny_model, short_corpus, tmp_path, executor
):
    """A candidate checkpoint whose weights file is cut short: a real library error (safetensors)
    where the cell loads, raised again on every try (not retried within the run)."""
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        candidates=[{"model": "tiny", "path": str(cut_short(Path(tiny_model), tmp_path / "cut")), "name": "cut"}],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=2,
        stride=STRIDE,
    )
    wh = tmp_path / "wh"
    r = _run("run", str(spec), "--warehouse", str(wh), "--json", *_on(executor))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    (bad,) = out["failed"]
    why = out["failed"][bad]
    assert why.startswith("SafetensorError: Error while deserializing header"), why
    assert r.stderr.strip().splitlines()[-1] == f"  {bad}: {why}"
    cells = {"cut" if c["cell_id"] == bad else "ref": c for c in sql(wh, "select * from cells")}
    assert (cells["cut"]["status"], cells["cut"]["error_class"], cells["cut"]["attempts"]) == (
        "failed",
        "SafetensorError",
        1,
    )
    assert f"{cells['cut']['error_class']}: {cells['cut']['error']}" == why
    assert sql(wh, f"select count(*) as n from logits where cell_id = '{bad}'") == [{"n": 0}]
    assert_exact(wh, cells["ref"], 2)
    hf_hashes = row_hashes(wh, cells["ref"]["cell_id"])
    (run,) = sql(wh, "select status, cells_done, cells_failed from runs")
    assert (run["status"], run["cells_done"], run["cells_failed"]) == ("done", 1, 1)
    st = _run("status", "--warehouse", str(wh), "--json")
    assert {c["cell_id"]: c["why"] for c in json.loads(st.stdout)["cells"]}[bad] == why

    again = _run("run", str(spec), "--warehouse", str(wh), "--json", *_on(executor))
    assert again.returncode == 1
    assert json.loads(again.stdout)["cells_run"] == 1  # only the failed cell, the HF cell is complete
    assert row_hashes(wh, cells["ref"]["cell_id"]) == hf_hashes
    skip = _run("run", str(spec), "--warehouse", str(wh), "--json", "--skip-failed", *_on(executor))
    assert skip.returncode == 0, skip.stderr[-2000:]
    summary = json.loads(skip.stdout)
    assert summary["cells_run"] == 0 and "--skip-failed" in summary["left_out"][bad.partition("@")[0]]
    r = _run("analyze", "--warehouse", str(wh))  # a failed cell has no rows: analysis goes on without it
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_sigterm_is_an_interrupt_and_the_run_resumes(tiny_model, short_corpus, tmp_path, executor):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=2,
        stride=STRIDE,
    )
    wh = tmp_path / "wh"
    p = _popen("run", str(spec), "--warehouse", str(wh), *_on(executor))
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
    r = _run("run", str(spec), "--warehouse", str(wh), *_on(executor))
    assert r.returncode == 0, r.stderr[-2000:]
    for c in sql(wh, "select * from cells"):
        assert_exact(wh, c, 2)
    workers = [int(m.group(1)) for line in lines if (m := re.match(r"loaded \S+ on \S+ \(pid (\d+)\)", line))]
    assert workers and not any(Path(f"/proc/{pid}").exists() for pid in workers)  # none outlives the run


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
        # enough repeats that the node is gone before the last one ends: on an AVX-512 box a
        # repeat of the cut model takes 0.1 s, and 4 of them finished before the raylet was killed
        spec = write_spec(
            tmp_path / "s.yaml",
            tiny_model,
            short_corpus,
            dtypes=["bf16"],
            attention=["eager"],
            reference={"engine": "hf", "dtype": "bf16"},
            repeats=REMOVED_NODE_REPEATS,
            stride=STRIDE,
        )
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
        assert_exact(wh, cell, REMOVED_NODE_REPEATS)
    finally:
        c.shutdown()


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_a_frozen_actor_is_stopped_by_the_time_limit(tiny_model, short_corpus, tmp_path, executor):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=2,
        stride=STRIDE,
        capture_timeout_s=15,
    )
    wh = tmp_path / "wh"
    # the limit spans several heartbeats, so one names the frozen cell even when the machine is busy
    p = _popen("run", str(spec), "--warehouse", str(wh), *_on(executor), LOGIT_MATRIX_HEARTBEAT_S="3")
    frozen, lines = None, []
    for line in p.stderr:
        lines.append(line)
        m = re.match(r"loaded (\S+\.bf16\.\S+) on \S+ \(pid (\d+)\)", line)
        if m and frozen is None:
            os.kill(int(m.group(2)), signal.SIGSTOP)  # the engine hangs: no error, no progress
            frozen = m.group(1)
    assert p.wait(timeout=60) == 1, "".join(lines)[-3000:]
    log = "".join(lines)
    assert f"{frozen} FAILED after 1 attempt(s): Timeout: " in log and "ran past 15s (capture_timeout_s)" in log
    assert re.search(rf"running: .*{re.escape(frozen)} (tokenizer parity|capture r0) for \d+s", log), log[-2000:]
    cells = {c["dtype"]: c for c in sql(wh, "select * from cells")}
    assert (cells["bf16"]["status"], cells["bf16"]["error_class"]) == ("failed", "Timeout")
    assert_exact(wh, cells["fp32"], 2)


# -- a full disk -----------------------------------------------------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")


def _mount(path: Path, opts: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)


def _temps(wh: Path) -> list[Path]:
    return [p for p in wh.rglob("*") if p.name.startswith(".tmp") or p.name.endswith(".part")]


@needs_root
def test_a_full_disk_stops_the_run_with_its_cause_and_leaves_nothing_partial(tiny_model, short_corpus, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=2,
        stride=STRIDE,
    )
    wh = tmp_path / "wh"
    _mount(wh, "size=14m")  # room for two of the four ~5.5 MB shards
    try:
        r = _run("run", str(spec), "--warehouse", str(wh))
        assert r.returncode == 1, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert re.fullmatch(
            rf"matrix: error: No space left on device writing {re.escape(str(wh))}/\S+ "
            r"\([0-9.]+ MiB free of 14 MiB there\) \(--debug for the traceback\)",
            last,
        ), last
        assert "Traceback" not in r.stderr
        assert _temps(wh) == []
        (run,) = sql(wh, "select status, error from runs")
        assert run["status"] == "failed" and run["error"].startswith("StorageError: No space left on device writing ")
        done = sql(wh, "select * from cells where status = 'done'")
        assert len(done) < 2  # the run stopped: not every cell is done, and none is done without its rows
        for c in done:
            assert_exact(wh, c, 2)
        v = _run("verify", "--warehouse", str(wh), "--json")
        assert v.returncode == 0 and json.loads(v.stdout)["damage"] == [], v.stdout[-2000:]

        subprocess.run(["mount", "-o", "remount,size=64m", str(wh)], check=True)  # space freed
        r = _run("run", str(spec), "--warehouse", str(wh))
        assert r.returncode == 0, r.stderr[-3000:]
        for c in sql(wh, "select * from cells"):
            assert_exact(wh, c, 2)
    finally:
        subprocess.run(["umount", "-l", str(wh)], check=False)


@needs_root
def test_a_full_disk_at_the_runs_write_keeps_the_cause_for_the_next_run(tiny_model, short_corpus, tmp_path):
    """runs/ on a tmpfs with one inode for files: the run's first row fits, no rewrite does (the
    first comes when a cell is done), the final one included. The outcome waits on this machine
    and the next run records it."""
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
        stride=STRIDE,
        threads=2,
    )
    wh = tmp_path / "wh"
    (wh / "runs").mkdir(parents=True)
    _mount(wh / "runs", "size=1m,nr_inodes=2")
    cache = tmp_path / "cache"
    env = {"LOGIT_MATRIX_CACHE": str(cache)}
    try:
        r = _run("run", str(spec), "--warehouse", str(wh), env=env)
        assert r.returncode == 1, r.stderr[-3000:]
        assert "could not record the end of run" in r.stderr and "no free inodes" in r.stderr
        markers = list((cache / "unrecorded-runs").rglob("*.json"))
        assert len(markers) == 1 and json.loads(markers[0].read_text())["status"] == "failed"
        saved = {p.name: p.read_bytes() for p in (wh / "runs").iterdir()}
    finally:
        subprocess.run(["umount", "-l", str(wh / "runs")], check=False)
    for name, data in saved.items():  # the disk is replaced by a bigger one, with its files
        (wh / "runs" / name).write_bytes(data)
    assert [r["status"] for r in sql(wh, "select status from runs")] == ["running"]
    r = _run("run", str(spec), "--warehouse", str(wh), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sql(wh, "select status, error from runs order by started_at")
    assert [x["status"] for x in runs] == ["failed", "done"]
    assert (
        runs[0]["error"].startswith("StorageError: No space left on device writing ")
        and "no free inodes" in runs[0]["error"]
    )
    assert not list((cache / "unrecorded-runs").rglob("*.json"))
    cells = sql(wh, "select * from cells")
    assert len(cells) == 2
    for c in cells:
        assert_exact(wh, c, 1)


# -- damaged files ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def captured(capture):
    """A finished two-cell sweep to damage copies of (the session's, shared by its spec)."""
    return capture(
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=2,
        stride=STRIDE,
    )


def _copy(captured, tmp_path) -> tuple[Path, Path, dict]:
    spec, src = captured
    wh = tmp_path / "wh"
    shutil.copytree(src, wh)
    cells = {c["dtype"]: c for c in sql(wh, "select * from cells")}
    return spec, wh, cells


def test_a_flipped_byte_is_caught_by_verify_and_analyze_and_recaptured_on_request(captured, tmp_path):
    spec, wh, cells = _copy(captured, tmp_path)
    bf16 = cells["bf16"]["cell_id"]
    before = row_hashes(wh, bf16)
    shard = wh / "logits" / bf16 / "r1.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the logits pages, far from the footer
    shard.write_bytes(bytes(data))

    v = _run("verify", "--warehouse", str(wh), "--json")
    assert v.returncode == 1, v.stderr[-2000:]
    report = json.loads(v.stdout)
    assert report["damaged_files"] == [str(shard)] and report["shards"] == 4
    assert all(d["cell_id"] == bf16 and d["repeat"] == 1 for d in report["damage"])
    assert f"DAMAGED {shard}" in v.stderr

    a = _run("analyze", "--warehouse", str(wh))
    assert a.returncode == 2 and a.stderr.strip().splitlines()[-1].startswith(f"matrix: error: {shard}: "), a.stderr[
        -2000:
    ]
    a = _run("analyze", "--warehouse", str(wh), "--skip-damaged", "--json")
    assert a.returncode == 0, a.stderr[-2000:]
    assert [d.split(":")[0] for d in json.loads(a.stdout)["damaged"]] == [str(shard)]
    assert sql(wh, "select count(*) as n from cells") == [{"n": 2}]  # SQL over the other tables works

    r = _run("run", str(spec), "--warehouse", str(wh), "--recapture-damaged")
    assert r.returncode == 0, r.stderr[-3000:]
    moved = list((wh / "damaged").rglob("r1.parquet"))
    assert len(moved) == 1 and moved[0].read_bytes() == bytes(data)  # kept, never deleted
    assert row_hashes(wh, bf16) == before  # captured again, bit for bit
    assert _run("verify", "--warehouse", str(wh)).returncode == 0


def test_a_truncated_shard_is_not_done_and_sql_still_works(captured, tmp_path):
    spec, wh, cells = _copy(captured, tmp_path)
    fp32 = cells["fp32"]["cell_id"]
    shard = wh / "logits" / fp32 / "r0.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    r = _run("sql", "select count(*) as n from cells", "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == [{"n": 2}], r.stderr  # a query that reads no logits
    # one that reads them: the damaged file is named and left out, the cell's other repeat still there
    q = f"select count(*) as n from logits where cell_id = '{fp32}'"
    r = _run("sql", q, "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == [{"n": cells["fp32"]["rows_per_repeat"]}], r.stderr
    assert f"matrix: warning: {shard}: damaged" in r.stderr
    assert _run("status", "--warehouse", str(wh)).returncode == 0
    v = _run("verify", "--warehouse", str(wh), "--json")
    assert v.returncode == 1 and json.loads(v.stdout)["damaged_files"] == [str(shard)]
    run = _run("run", str(spec), "--warehouse", str(wh))
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        f"matrix: error: {shard}: damaged (unreadable: "
        + run.stderr.split("(unreadable: ", 1)[1].split(")")[0]
        + "); run `matrix verify`, or `matrix run --recapture-damaged` to move it aside and capture it again"
    ), run.stderr
    assert "Traceback" not in run.stderr
    run = _run("run", str(spec), "--warehouse", str(wh), "--recapture-damaged")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_exact(wh, sql(wh, f"select * from cells where cell_id = '{fp32}'")[0], 2)


def test_a_truncated_table_file_leaves_the_other_tables_queryable(captured, tmp_path):
    _, wh, cells = _copy(captured, tmp_path)
    f = next((wh / "tokenizer_parity").iterdir())
    f.write_bytes(f.read_bytes()[:40])
    r = _run("sql", "select count(*) as n from logits", "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["n"] > 0, r.stderr
    v = _run("verify", "--warehouse", str(wh), "--json")
    assert v.returncode == 1 and json.loads(v.stdout)["damaged_files"] == [str(f)]


@pytest.mark.parametrize("where", ["spec", "corpus"])
def test_latin1_input_is_one_line_and_exit_2(tiny_model, short_corpus, tmp_path, where):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
    )
    if where == "spec":
        spec.write_bytes(spec.read_bytes().replace(b"name: test", "name: caf\u00e9".encode("latin-1")))
        bad, what = spec, "spec file"
    else:
        corpus = tmp_path / "corpus"
        shutil.copytree(short_corpus.parent, corpus)
        (corpus / "prose.txt").write_bytes("Caf\u00e9 au lait.".encode("latin-1"))
        spec.write_text(spec.read_text().replace(str(short_corpus), str(corpus / "corpus.yaml")))
        bad, what = corpus / "prose.txt", f"the file of prompts[1] in {corpus / 'corpus.yaml'}"
    r = _run("run", str(spec), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"matrix: error: {bad}: {what} is not UTF-8 text: byte 0xe9 at offset "
        + r.stderr.split("at offset ")[1].split(" ")[0]
        + " (line "
        + r.stderr.split("(line ")[1].split(")")[0]
        + "); save it as UTF-8"
    ]
    assert not (tmp_path / "wh").exists()
