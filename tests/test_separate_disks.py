"""A sweep on Ray nodes that share no disk with the driver, on one machine.

Each worker node is a real `ray start` inside its own mount namespace (`unshare --mount`), with
a tmpfs over the driver's pytest tree (the model, the corpus, the warehouse), over the driver's
model cache and over its own HOME: like another computer, it sees none of the driver's files.
The head takes no CPUs, so every cell runs on those nodes. Needs root (as CI runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, sql, write_spec

pytestmark = [
    pytest.mark.slow,  # starts a Ray cluster
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for per-node mount namespaces"
    ),
]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(address: str) -> int:
    code = (
        "import ray; ray.init(address=%r, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))" % address
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else 0


class StartFailed(Exception):
    """A Ray process of the test cluster exited while starting (its logs attached)."""


def _wait_for(address: str, nodes: int, procs: list, tmp: Path) -> None:
    deadline = time.time() + 120
    while _alive_nodes(address) < nodes:
        logs = {f: (tmp / f).read_text()[-1500:] for f in sorted(os.listdir(tmp)) if f.endswith(".log")}
        if any(p.poll() is not None for p in procs):
            raise StartFailed(logs)
        assert time.time() < deadline, logs
        time.sleep(2)


@contextlib.contextmanager
def isolated_cluster(tmp: Path, hidden: list[Path], workers: int, prepare: str = ""):
    """A head on loopback with no CPUs, and `workers` one-CPU nodes that cannot see `hidden`.
    A port is picked free and bound moments later: another cluster of this machine (the other
    test worker's) can take it in between, and that node then exits at once. The cluster is
    started again from scratch then, with new ports, at most three times."""
    for attempt in range(3):
        run = tmp / f"try{attempt}"
        run.mkdir()
        try:
            cm = _cluster(run, hidden, workers, prepare)
            address = cm.__enter__()
        except StartFailed:
            if attempt == 2:
                raise
            continue
        try:
            yield address
        finally:
            cm.__exit__(None, None, None)
        return


@contextlib.contextmanager
def _cluster(tmp: Path, hidden: list[Path], workers: int, prepare: str):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # loopback only: nothing listens outside
    procs = [
        subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=0",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=env,
            start_new_session=True,
            stdout=open(tmp / "head.log", "w"),
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        _wait_for(address, 1, procs, tmp)
        for i in range(workers):
            home = tmp / f"node{i}-home"
            home.mkdir()
            mounts = " && ".join(f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in [*hidden, home])
            # nodes on one machine: each agent needs its own ports (Ray's defaults collide)
            ports = " ".join(
                f"--{p}={_free_port()}"
                for p in (
                    "dashboard-agent-listen-port",
                    "dashboard-agent-grpc-port",
                    "metrics-export-port",
                    "runtime-env-agent-port",
                    "node-manager-port",
                    "object-manager-port",
                )
            )
            script = (
                f"set -e; {mounts}; {prepare or 'true'}; exec {RAY} start --address={address} "
                f"--node-ip-address=127.0.0.1 --num-cpus=1 --block --disable-usage-stats {ports}"
            )
            procs.append(
                subprocess.Popen(
                    ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                    env={**env, "HOME": str(home), "LOGIT_MATRIX_CACHE": str(home / "cache")},
                    start_new_session=True,
                    stdout=open(tmp / f"node{i}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            _wait_for(address, i + 2, procs, tmp)  # one at a time: simultaneous registrations time out here
        yield address
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _hidden(tmp_path_factory) -> list[Path]:
    from common.files import cache_root

    return [tmp_path_factory.getbasetemp(), cache_root()]


def test_sweep_on_nodes_without_the_drivers_disk(tiny_model, short_corpus, swept, tmp_path_factory):
    base = tmp_path_factory.mktemp("isolated")
    mine = shutil.copytree(tiny_model, base / "my-checkpoint")  # a candidate checkpoint only the driver has
    spec = write_spec(
        base / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        include=[
            {
                "engine": "llamacpp",
                "dtype": "f16",
                "attention": "default",
                "layers": [1],
                "decode": {"steps": 2, "at": [3]},
            }
        ],
        candidates=[{"model": "tiny", "path": str(mine), "dtype": "fp32", "attention": "sdpa"}],
    )
    wh = base / "wh"
    with isolated_cluster(Path(tmp_path_factory.mktemp("cluster")), _hidden(tmp_path_factory), 2) as address:
        r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", address, "--json", timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["cells_done"] == 4 and summary["rows_delivery"]["node"] == 0
    assert summary["rows_delivery"]["driver"] == 8 and summary["rows_delivery"]["bytes_to_driver"] > 0
    cells = sql(
        wh,
        "select cell_id, engine, status, rows_via, model_via, bit_reproducible, rows_per_repeat, repeats, "
        "artifact, artifact_sha256 from cells order by cell_id",
    )
    assert [c["status"] for c in cells] == ["done"] * 4
    # the candidate's directory reached its node through the depot, checked by its weights digest
    (cand,) = [c for c in cells if c["engine"] == "hf" and c["artifact"]]
    assert cand["artifact"] != str(mine) and f"artifact-{cand['artifact_sha256']}" in cand["artifact"]
    assert {(c["rows_via"], c["model_via"]) for c in cells} == {("driver", "shipped")}
    assert all(c["bit_reproducible"] for c in cells)
    # every row landed exactly once, as many as the cells say
    dup = sql(
        wh, "select cell_id, repeat, prompt_id, position, path, step from logits group by all having count(*) <> 1"
    )
    assert dup == []
    n = sql(wh, "select count(*) as n from logits where path is null")[0]["n"]
    assert n == sum(c["rows_per_repeat"] * c["repeats"] for c in cells) > 0
    # no node of the driver's wrote a cell, and the driver's disk holds every shard
    head = sql(wh, "select distinct node_id from cells")
    assert len(head) >= 1 and all(h["node_id"] for h in head)
    runs = sql(wh, "select rows_delivery from runs")
    assert json.loads(runs[0]["rows_delivery"])["driver"] == 8
    # the HF rows sent through the driver are the bytes a local run writes itself
    _, local_wh, _, _ = swept
    # (by attention, not cell id: this run's reference also records layers and decode rows, which
    # gives it another id and leaves its rows' bytes as they are)
    q = (
        "select c.attention, l.repeat, l.prompt_id, l.position, l.row_hash from logits l join cells c using (cell_id) "
        "where c.engine = 'hf' and c.dtype = 'fp32' and c.artifact_sha256 is null and l.path is null order by all"
    )
    mine, local = sql(wh, q), sql(local_wh, q)
    assert mine and mine == local
    # the layer states of the llama.cpp cell (and of its reference, which records the layers its
    # model's cells ask for) came through the depot too: layer 1 and the final norm at every row
    states = sql(
        wh,
        "select c.engine, count(*) as n, count(distinct s.layer) as layers, any_value(c.rows_per_repeat) "
        "* any_value(c.repeats) as rows from layer_states s join cells c using (cell_id) group by all",
    )
    assert sorted((s["engine"], s["layers"], s["n"] == 2 * s["rows"]) for s in states) == [
        ("hf", 2, True),
        ("llamacpp", 2, True),
    ]
    # and so did the side files (a decode and a prefill row per prompt, step and repeat)
    dec = sql(
        wh,
        "select c.engine, l.path, count(*) as n, any_value(c.n_prompts) * any_value(c.repeats) * 2 as want "
        "from logits l join cells c using (cell_id) where l.path is not null group by all",
    )
    assert sorted((d["engine"], d["path"], d["n"] == d["want"]) for d in dec) == [
        ("hf", "decode", True),
        ("hf", "prefill", True),
        ("llamacpp", "decode", True),
        ("llamacpp", "prefill", True),
    ]
    # analysis and the report see every cell
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-2000:]
    assert len(sql(wh, "select * from summary")) == 4
    lay = sql(wh, "select layer, cosine_min from layer_summary order by layer_index")
    assert [x["layer"] for x in lay] == ["layer.1", "final_norm"] and all(x["cosine_min"] > 0.9999 for x in lay)
    rep = run_cli("report", "--warehouse", str(wh), "--out", str(base / "report"))
    assert rep.returncode == 0, rep.stderr[-2000:]
    html = (base / "report" / "report.html").read_text()
    assert all(c["cell_id"] in html for c in cells)


def test_a_node_whose_copy_of_the_weights_differs_is_refused(tiny_model, short_corpus, tmp_path_factory):
    """The node has a directory at the model's path, with other weights: exit 2, one line naming
    the node and both hashes, and no rows in the warehouse."""
    from safetensors.numpy import load_file, save_file

    from common.files import weights_digest

    base = tmp_path_factory.mktemp("tampered")
    other = Path(f"/tmp/lm-other-weights-{os.getpid()}")  # outside the hidden tree: the node can copy it
    shutil.rmtree(other, ignore_errors=True)
    shutil.copytree(tiny_model, other)
    t = load_file(other / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"] * 1.01
    save_file(t, other / "model.safetensors", metadata={"format": "pt"})
    spec = write_spec(
        base / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    wh = base / "wh"
    plant = f"mkdir -p {tiny_model} && cp -r {other}/. {tiny_model}/"
    try:
        with isolated_cluster(
            Path(tmp_path_factory.mktemp("cluster")), _hidden(tmp_path_factory), 1, prepare=plant
        ) as address:
            r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", address, timeout=600)
    finally:
        want, got = weights_digest(tiny_model), weights_digest(other)
        shutil.rmtree(other)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("matrix: error: node ") and want in lines[-1] and got in lines[-1], lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)
    assert sql(wh, "select count(*) as n from logits")[0]["n"] == 0
