"""The README's two-machine recipe, run as written on one machine: the head's lines, the joining
machine's lines inside its own mount and PID namespaces (a tmpfs over the head's files, its own
HOME, its own processes, so join-node.sh's `ray stop` cannot reach the head), then the driver's.

What one machine changes, and nothing else: HEAD_IP is the loopback; the head takes no CPUs, so
every cell runs on the joined node, which sees none of the head's disk; the joined node's fixed
ports are others than the head's (on two machines they are the same numbers) and `scp` of the
token is a `cp`; the spec is a small one on the test model; BUCKET is a bucket of a local S3
server. `ray start` fixes ports 6379-6381 and `ray stop` ends every Ray process here: `serial`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli, write_spec
from tests.test_object_warehouse import BUCKET, S3, _environ, _free_port
from tests.test_readme import blocks

pytestmark = [
    pytest.mark.serial,
    pytest.mark.network,  # the joining machine's lines install the project (pip's build dependencies)
    pytest.mark.slow,  # starts a Ray cluster
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("unshare"),
        reason="needs root and unshare for the joined node's namespaces",
    ),
]


JOINED = "logit-matrix-test-node-joined"  # printed by the node's shell once its lines ran


def parts() -> dict[str, str]:
    """The recipe's block cut at its three comments: head, joining machine, driver."""
    (block,) = blocks("A sweep on two or more machines", "sh")
    head, rest = block.split("# each other machine", 1)
    node, driver = rest.split("# the driver", 1)
    return {"head": head, "node": "# each other machine" + node, "driver": "# the driver" + driver}


def _env(home: Path, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), LOGIT_MATRIX_CACHE=str(home / "cache"), **extra)
    return env


def _bash(script: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@contextlib.contextmanager
def joined_node(script: str, env: dict, hidden: list[Path], log: Path):
    """The joining machine's lines in new mount and PID namespaces; the namespace's first process
    stays until the test ends, and its end ends every process of the node."""
    mounts = " && ".join(f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in [*hidden, Path(env["HOME"])])
    inner = f"set -euo pipefail; {mounts}; cd {REPO}\n{script}\necho {JOINED}; exec sleep infinity"
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "bash", "-c", inner],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_joined(proc, log: Path, timeout: float = 600) -> None:
    import time

    deadline = time.time() + timeout
    while JOINED not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(2)


def test_two_machines_as_written(tiny_model, short_corpus, tmp_path_factory):
    base = tmp_path_factory.mktemp("two-machines")
    head_home, node_home = Path(os.environ.get("TMPDIR", "/tmp")) / f"lm-head-{os.getpid()}", base / "node-home"
    shutil.rmtree(head_home, ignore_errors=True)
    head_home.mkdir()
    spec = write_spec(
        base / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager", "sdpa"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"},
        repeats=1,
    )
    s3 = S3(base)
    with _environ(s3.env):  # boto3 finds the local server through the environment
        s3.start()
    p = parts()
    head = (
        p["head"]
        .replace("HEAD_IP", "127.0.0.1")
        .replace("--include-dashboard=false", "--include-dashboard=false --num-cpus 0")
    )
    ports = {"6380": _free_port(), "6381": _free_port(), "10002": 20002, "10200": 20200}
    node = re.sub(r"\b(6380|6381|10002|10200)\b", lambda m: str(ports[m.group(1)]), p["node"])
    agent = " ".join(
        f"--{k}={_free_port()}"
        for k in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
    )
    node = node.replace('RAY_START_ARGS="', f'RAY_START_ARGS="--node-ip-address 127.0.0.1 {agent} ')
    wire = Path(f"{head_home}-wire")  # what scp carries: the token, the only file the node gets from the head
    node = node.replace("scp -p HEAD_IP:.ray/auth_token", f"cp -p {wire}/auth_token").replace("HEAD_IP", "127.0.0.1")
    # the driver's lines run in the head's shell, where the venv is active
    driver = ". .venv/bin/activate\n" + p["driver"].replace("HEAD_IP", "127.0.0.1").replace(
        "configs/smoke.yaml", str(spec)
    ).replace("BUCKET", BUCKET)
    try:
        r = _bash(head, _env(head_home, {}), timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert (head_home / ".ray" / "auth_token").stat().st_mode & 0o077 == 0
        shutil.rmtree(wire, ignore_errors=True)
        wire.mkdir(mode=0o700)
        shutil.copy2(head_home / ".ray" / "auth_token", wire / "auth_token")
        hidden = [tmp_path_factory.getbasetemp(), head_home]
        with joined_node(node, _env(node_home, s3.env), hidden, base / "node.log") as proc:
            _wait_joined(proc, base / "node.log")
            r = _bash(driver, _env(head_home, s3.env), timeout=1200)
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
            assert "2/2 cells complete" in r.stderr, r.stderr[-2000:]
        _check_warehouse(f"s3://{BUCKET}/sweeps/first", s3.env)
    finally:
        _bash(f"{Path(sys.executable).parent / 'ray'} stop --force", _env(head_home, {}), timeout=120)
        s3.proc.terminate()
        s3.proc.wait(timeout=60)
        shutil.rmtree(head_home, ignore_errors=True)
        shutil.rmtree(wire, ignore_errors=True)


def _check_warehouse(uri: str, env: dict) -> None:
    """Both cells done on the joined node (not the head), the model shipped to it, the run on the cluster."""

    def sql(q: str) -> list[dict]:
        r = run_cli("sql", q, "--warehouse", uri, "--format", "json", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    cells = sql("select status, attention, node_id, model_via, rows_via from cells order by attention")
    assert [(c["status"], c["attention"]) for c in cells] == [("done", "eager"), ("done", "sdpa")], cells
    assert {c["model_via"] for c in cells} == {"shipped"}  # the node cannot see the head's copy of the model
    (run,) = sql("select status, executor, ray_address from runs")
    assert run["status"] == "done" and run["executor"] == "ray" and run["ray_address"] == "127.0.0.1:6379", run
    assert sql("select count(*) as n from logits")[0]["n"] > 0
