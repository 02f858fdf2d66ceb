"""A local run's first host starts while the driver still tokenises, and the run takes it over:
real worker processes and the test model's GGUF files (matrix/run/early.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from tests.test_kld_command import N_CTX, ggufs, text  # noqa: F401 - fixtures

__all__ = ["ggufs", "text"]


def _job(ggufs, text, wh: Path):  # noqa: F811 - the fixture, passed in
    from matrix.spec import kld
    from matrix.spec.cells import load_spec

    spec_path, _, _ = kld.write_job(
        kld.classify(ggufs["f16"], "--reference"),
        [kld.classify(ggufs["q8_0"], "--candidate")],
        Path(text),
        N_CTX,
        2,
        str(wh),
        lambda line: None,
    )
    return load_spec(spec_path)


class Ahead:
    """LocalExecutor.load_ahead wrapped: each cell it started a host for, with the host and the
    number of cells done at that moment."""

    def __init__(self, ex, cells_done):
        self.ex, self.real, self.cells_done, self.started = ex, ex.load_ahead, cells_done, []
        ex.load_ahead = self

    def __call__(self, cell, *args):
        ok = self.real(cell, *args)
        if ok:
            self.started.append((cell.cell_id, self.ex.early[cell.cell_id][0], self.cells_done()))
        return ok


def _run(spec, wh, ex, nonce, lines):
    from matrix.run import execute, runner

    plan = runner.prepare(spec, wh, lines.append)
    wh.create()
    with wh.lock(lines.append):
        plan = runner.bind(plan, wh, ex, lines.append, runner.Resume(own_cluster=True))
        ex.keep_early(set(plan.todo))
        return plan, execute.execute(plan, wh, [], None, lines.append, ex, nonce)


def test_the_first_host_starts_ahead_and_the_run_takes_it_over(ggufs, text, tmp_path):  # noqa: F811
    from matrix.run import early
    from matrix.run.local import LocalExecutor
    from store import Warehouse

    spec, wh, ex, lines = _job(ggufs, text, tmp_path / "wh"), Warehouse(str(tmp_path / "wh")), LocalExecutor(), []
    nonce = early.start_first_host(spec, wh, ex, lines.append)
    ((ref, (host, _)),) = ex.early.items()
    assert nonce and ref.startswith(early.first_cell(spec).stack_id) and host.proc is not None  # spawned at once
    ahead = Ahead(ex, lambda: sum(line.startswith("[cells") and " done" in line for line in lines))
    plan, summary = _run(spec, wh, ex, nonce, lines)
    assert summary["cells_done"] == 2 and not summary["failed"]
    assert ex.started == 2  # two cells, two processes: the reference's started ahead, the candidate's loaded ahead
    assert any(line.startswith(f"loaded {ref} ") and f"(pid {host.proc.pid})" in line for line in lines), lines
    # the candidate's host started while its reference was in flight, and the run took it over
    ((cand, cand_host, done_then),) = ahead.started
    assert cand != ref and done_then == 0
    assert any(line.startswith(f"loaded {cand} ") and f"(pid {cand_host.proc.pid})" in line for line in lines), lines
    assert not ex.early and ex.free_cpus == ex.cpus and not ex.running  # every CPU given back
    assert plan.reference_cells[spec.cells[0].model] == ref
    again = LocalExecutor()  # the reference is done: a later run starts nothing ahead
    assert early.start_first_host(spec, Warehouse(str(tmp_path / "wh")), again, lines.append) is None
    assert again.started == 0 and not again.early


def test_a_host_started_ahead_for_a_cell_the_run_does_not_start_is_stopped(ggufs, text, tmp_path):  # noqa: F811
    from matrix.run import early
    from matrix.run.local import LocalExecutor
    from store import Warehouse

    spec, ex = _job(ggufs, text, tmp_path / "wh"), LocalExecutor()
    assert early.start_first_host(spec, Warehouse(str(tmp_path / "wh")), ex, print) is not None
    ((host, load),) = ex.early.values()
    assert ex.free_cpus == ex.cpus - host.cpus
    ex.keep_early(set())  # e.g. the reference was captured by another build the run reuses
    assert host.gone and not ex.early and ex.free_cpus == ex.cpus
    assert load.done and "stopped" in str(load.error)


def test_no_host_loads_ahead_where_memory_would_not_hold_two_models(ggufs, text, tmp_path, monkeypatch):  # noqa: F811
    from matrix.run import local
    from matrix.run.local import LocalExecutor
    from store import Warehouse

    monkeypatch.setattr(local, "available_memory", lambda: 1 << 30)  # less than twice a file and a GiB
    spec, wh, ex, lines = _job(ggufs, text, tmp_path / "wh"), Warehouse(str(tmp_path / "wh")), LocalExecutor(), []
    ahead = Ahead(ex, lambda: 0)
    _, summary = _run(spec, wh, ex, None, lines)
    assert summary["cells_done"] == 2 and not summary["failed"] and ex.started == 2
    assert not ahead.started and ex.free_cpus == ex.cpus


class Sent:
    """A host's socket that records what the executor sends (method names), and starts nothing."""

    def __init__(self):
        self.methods = []

    def send(self, msg):
        self.methods.append(msg[0] if msg[0] == "init" else msg[1])

    def close(self):
        self.methods.append("closed")


def _no_process(self, gpu_ids, log_dir, n):
    """Worker.spawn without the host: a sleeping process of its own session stands in for it
    (stopping a host kills its session)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    self.proc, self.conn, self.gpu_ids = proc, Sent(), gpu_ids
    for msg in [("init", self.init)] + self.outbox:
        self._send(msg)
    self.outbox = []


def test_a_host_loaded_ahead_waits_for_its_cpus_with_its_calls_held(tmp_path, monkeypatch):
    from common.stack import StackDesc
    from matrix.run.local import LocalExecutor
    from matrix.run.local_worker import Worker

    monkeypatch.setattr(Worker, "spawn", _no_process)
    gguf = tmp_path / "cand.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    cell = SimpleNamespace(cell_id="cand", tp=1, device="cpu", artifact=str(gguf), engine="llamacpp")
    desc, model = StackDesc.of("llamacpp", "q8_0", "default"), SimpleNamespace(path="m")
    ex = LocalExecutor()
    assert ex.load_ahead(cell, desc, model, ex.cpus, "delivery")
    ((w, _),) = ex.early.values()
    assert w.conn.methods == ["init", "load"] and w.cpus_held == 0 and ex.free_cpus == ex.cpus
    other = SimpleNamespace(**{**vars(cell), "cell_id": "other"})
    assert not ex.load_ahead(other, desc, model, ex.cpus, "delivery")  # one host ahead at a time
    ex.free_cpus = 0  # the cell before it holds every CPU still
    work = SimpleNamespace(
        prompts=[("p0", "text", [1, 2, 3])],
        repeats=[0],
        run_id="run",
        keep=1,
        store="bf16",
        metrics_ref="ref",
        values=False,
        special={},
        vocab=8,
        delivery="delivery",
        gpu_share=1,
    )
    started = ex.start(cell, desc, model, ex.cpus, [], work)
    assert started.actor is w and w in ex.line and w.conn.methods == ["init", "load"]  # adopted, its calls held
    ex.free_cpus = ex.cpus  # that cell's host is gone
    ex._pump()
    assert w.conn.methods == ["init", "load", "warm_metrics", "parity", "capture"] and w.cpus_held == ex.cpus
    assert ex.free_cpus == 0 and not ex.line and ex.running.count(w) == 1
    ex.stop(started)
    assert ex.free_cpus == ex.cpus and not ex.running and w.gone and w.proc.poll() is not None


def test_nothing_loads_ahead_off_the_cpu_or_from_a_checkpoint_directory(tmp_path):
    from common.stack import StackDesc
    from matrix.run.local import LocalExecutor

    ex, desc = LocalExecutor(), StackDesc.of("llamacpp", "q8_0", "default")
    gguf = tmp_path / "cand.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    for device, artifact in (("mps", gguf), ("cpu", tmp_path), ("cpu", None)):
        cell = SimpleNamespace(cell_id="c", tp=1, device=device, artifact=artifact and str(artifact), engine="llamacpp")
        assert not ex.load_ahead(cell, desc, SimpleNamespace(), 1, "delivery")
    assert not ex.early and ex.started == 0
