"""A cell whose load skips ends as skipped whatever order its queued calls come back in.

The driver queues load, parity and every capture on a cell's actor at once, and Ray runs
queued calls even after an earlier one raised. The real llama.cpp backend with Q2_K on the
2-layer SmolLM2 (hidden size 576 holds no Q2_K tensor) raises SkipCell in load, after
converting and quantising; the later calls must raise that same SkipCell, and the driver must
skip the cell even when it takes those later futures first.
"""

from __future__ import annotations

import pytest

from backends.base import SkipCell
from tests.conftest import write_spec

pytestmark = pytest.mark.slow  # starts a Ray cluster

pytest.importorskip("llama_cpp")

REPEATS = 8  # sweeps, half of them in the bad order (forced: each one is the race, lost)
ACTOR_REPEATS = 5  # fresh actors, each asked in the bad order (an actor start costs ~7 s here)
REASON = "the tensor shapes do not allow q2_k"


@pytest.fixture(scope="module")
def local_ray():
    import ray

    # address "local": a new cluster of our own, never one a `ray start --head` of another test left
    # recorded in /tmp/ray/ray_current_cluster (a bare ray.init would try to join that)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()  # the test owns this process's Ray connection, as the CLI does


@pytest.fixture(scope="module")
def plan_for(tiny_model, short_corpus, tmp_path_factory):
    """A fresh plan and empty warehouse per call: the fp32 reference and the Q2_K cell, llama.cpp only."""
    from matrix.run import runner
    from matrix.spec.cells import load_spec
    from store import Warehouse

    d = tmp_path_factory.mktemp("race")
    spec_path = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        engines=["llamacpp"],
        dtypes=["fp32", "q2_k"],
        attention=["default"],
        reference={"engine": "llamacpp", "dtype": "fp32"},
        repeats=2,
    )

    def make(i: int):
        spec = load_spec(spec_path)
        wh = Warehouse(d / f"wh{i}")
        return runner.prepare(spec, wh, lambda m: None), wh

    return make


def skip_of(ray, ref) -> SkipCell:
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(ref, timeout=300)
    assert isinstance(e.value.cause, SkipCell), repr(e.value.cause)
    return e.value.cause


def test_calls_queued_behind_a_skipped_load_raise_the_loads_skip(local_ray, plan_for):
    from actors.ray_actor import StackActor
    from actors.stack_actor import Delivery
    from matrix.spec.cells import model_copy, stack_desc

    ray = local_ray
    plan, _ = plan_for(0)
    cell = next(c for c in plan.matrix.cells if c.dtype == "q2_k")
    mp = plan.models[cell.model]
    model = mp.resolved
    desc = stack_desc(cell, model)
    texts = [(p.prompt_id, p.text, p.token_ids) for p in mp.prompts]
    ids = [(p.prompt_id, p.token_ids) for p in mp.prompts]
    for _ in range(ACTOR_REPEATS):
        actor = StackActor.options(num_cpus=1).remote(
            desc, model_copy(model), 1, Delivery("/nonexistent-warehouse", "nonce", None)
        )
        load = actor.load.remote()
        parity = actor.parity.remote(texts, mp.special, mp.vocab)
        captures = [actor.capture.remote("run", r, ids, 16) for r in range(2)]
        # the bad order: the calls queued behind the load are taken first
        got = [skip_of(ray, f) for f in captures + [parity, load]]
        assert all(str(g).startswith(REASON) for g in got), got
        assert len({str(g) for g in got}) == 1
        ray.kill(actor)


def test_sweep_skips_the_cell_whatever_order_its_futures_come_back_in(local_ray, plan_for, monkeypatch):
    """Half the runs take futures as Ray returns them; the other half wait for every future and
    take them newest first, so the Q2_K cell's captures and parity reach the driver before its load."""
    from matrix.run import execute, runner
    from matrix.run.ray_executor import RayExecutor

    ray = local_ray
    real_wait = ray.wait
    newest_first = {"on": False}

    def wait(refs, num_returns=1, timeout=None):
        if not newest_first["on"]:
            return real_wait(refs, num_returns=num_returns, timeout=timeout)
        ready, rest = real_wait(refs, num_returns=len(refs), timeout=None)
        order = {r: i for i, r in enumerate(refs)}
        return sorted(ready, key=order.get, reverse=True), rest

    monkeypatch.setattr(ray, "wait", wait)
    for i in range(REPEATS):
        newest_first["on"] = i % 2 == 1
        plan, wh = plan_for(i)
        wh.create()
        with wh.lock():
            ex = RayExecutor()
            plan = runner.bind(plan, wh, ex, lambda m: None)
            summary = execute.execute(plan, wh, ["test"], None, lambda m: None, ex)
        cells = {r["dtype"]: r for r in wh.read_all("cells")}
        assert summary["cells_done"] == 2 and summary["rows_written"] > 0, (i, summary)
        assert cells["q2_k"]["status"] == "skipped" and cells["q2_k"]["skip_reason"].startswith(REASON), (i, cells)
        assert cells["fp32"]["status"] == "done" and cells["fp32"]["repeats"] == 2, (i, cells)
        assert [r["status"] for r in wh.read_all("runs")] == ["done"], i
