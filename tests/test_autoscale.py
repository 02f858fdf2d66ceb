"""A cell whose node type is not running yet: `matrix run --cluster-config` lets it wait for the
autoscaler instead of refusing it, and the autoscaler really starts the node.

Ray's fake multi-node provider (the one Ray's own autoscaler tests use) launches real raylets on
this machine when demand appears. The head has 1 CPU and no Apple resource; the launcher config
has a "mac" node type with `apple-m3: 1`, none running. The MLX cell can only run there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli, sql, write_spec

RAY = str(Path(sys.executable).with_name("ray"))
CONFIG = {
    "cluster_name": "fake_multinode",
    "max_workers": 1,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "mac": {"resources": {"CPU": 2, "apple-m3": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1},
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


# `ray stop --force` below ends every Ray process it can see, so this file never runs beside another
# test's cluster as it is: `make test` runs it in PID, mount and network namespaces of its own, or
# after the parallel pass, alone (scripts/test-suite.sh).
pytestmark = [pytest.mark.serial, pytest.mark.slow]  # starts a Ray cluster


@pytest.fixture()
def autoscaling_head(tmp_path):
    # The fake provider's nodes join the head at the default port, so the head must own 6379;
    # never take over a cluster someone is already running there.
    if _port_in_use(6379):
        pytest.skip("port 6379 is in use (a Ray head is running?): the fake autoscaler needs it")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
    subprocess.run(
        [RAY, "start", "--head", f"--autoscaling-config={cfg}", "--num-cpus=1", "--include-dashboard=false"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield cfg
    finally:
        # the fake nodes are processes of this machine that no handle reaches: stop them all
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_a_cell_waits_for_the_node_type_the_autoscaler_starts(autoscaling_head, tiny_model, short_corpus, tmp_path):
    pytest.importorskip("mlx_lm")
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        devices=["cpu"],
        reference={"engine": "hf", "dtype": "fp32", "device": "cpu"},
        repeats=1,
        include=[{"engine": "mlx", "dtype": "fp32", "attention": "default", "device": "apple-m3"}],
    )
    wh = tmp_path / "wh"
    # live nodes only: no Apple node exists yet, so the cell is refused up front, nothing captured
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", "auto")
    assert r.returncode == 2 and "apple-m3: no node of the cluster is one" in r.stderr, r.stderr[-2000:]
    # with the launcher config the cell waits for the "mac" node type, which the autoscaler starts
    # the progress line while the node starts, every second: read when the run loop is imported,
    # so the run is a process of its own
    r = run_cli(
        "run",
        str(spec),
        "--warehouse",
        str(wh),
        "--address",
        "auto",
        "--cluster-config",
        str(autoscaling_head),
        "--json",
        timeout=900,
        env={"LOGIT_MATRIX_HEARTBEAT_S": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "waits for the autoscaler to start mac" in r.stderr
    beats = [ln for ln in r.stderr.splitlines() if ln.startswith("waiting ")]
    # the cell's build is asked on the node the autoscaler starts for it, before the cell is placed
    assert any(
        " for engine builds: " in ln
        and "tiny.mlx.fp32.default.tp1.apple-m3-" in ln
        and "(for the autoscaler to start a node)" in ln
        for ln in beats
    ), beats
    assert any("running: tiny.mlx.fp32.default.tp1.apple-m3-" in ln and " capture r0 for " in ln for ln in beats), beats

    assert json.loads(r.stdout)["cells_done"] == 2
    cells = {c["engine"]: c for c in sql(wh, "select engine, status, node_id from cells")}
    assert cells["mlx"]["status"] == cells["hf"]["status"] == "done"
    assert cells["mlx"]["node_id"] != cells["hf"]["node_id"]  # on the node started for it, not the head
