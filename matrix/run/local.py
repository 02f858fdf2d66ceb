"""The local executor: each cell's host is a worker process of this machine, without Ray (under
`hosts: shared`, one worker serves the cells of one loaded model in turn: reuse()).

For a machine that cannot join a cluster (a locked-down GPU box, a laptop, a CI runner) or a job
too small to pay for one. The run loop, the order rules, the retry policy and every row are the
same as on Ray (matrix/run/launch.py): only where a host runs differs. A host asks for what its
Ray actor would (threads, or threads x tp; one GPU, or tp), waits in line until this machine has
them free, and gets its GPUs through CUDA_VISIBLE_DEVICES. A host that dies takes only its own
calls down (WorkerDied: retried like a dead actor). Cells whose ranks must be Ray actors (tp
ranks over torch.distributed, vLLM's Ray executor) need a cluster: check() says so before anything runs.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from fractions import Fraction
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from backends import backend_class
from common.errors import UserError
from common.files import cache_root
from common.stack import Cell, ModelCopy, StackDesc
from matrix.run import placement
from matrix.run.launch import Call, Kind, Started, Work, measures_in_host, queue_calls, reuse_host
from matrix.run.local_node import NODE_ID, available_memory, gpu_pool, local_node
from matrix.run.local_worker import Future, Worker, interpreter


def _prune(log_dir: Path, keep_days: float = 7.0) -> None:
    """Worker logs older than a week go (each run writes one per cell start)."""
    if not log_dir.is_dir():
        return
    old = time.time() - keep_days * 86400
    for p in log_dir.glob("*.log"):
        with contextlib.suppress(FileNotFoundError):  # another run pruned it first
            if p.stat().st_mtime < old:
                p.unlink()


def check(cells: list[Cell]) -> None:
    """Exit 2 before anything runs for a cell only a Ray cluster can run."""
    for c in cells:
        cls = backend_class(c.engine)
        if c.tp > 1 and cls.tp_workers == "ranks":
            why = f"its {c.tp} tensor-parallel ranks are Ray actors (torch.distributed)"
        elif cls.workers_in_group(c):
            why = "the engine starts its own Ray workers (vllm_executor: ray)"
        else:
            continue
        raise UserError(f"{c.stack_id}: {why}; run it with --executor ray")


class LocalExecutor:
    """Hosts in worker processes of this machine, started in the order asked as resources free up."""

    name = "local"

    def __init__(self):
        self.node = local_node()
        self.cpus = int(self.node.resources["CPU"])
        self.free_cpus = self.cpus
        # each GPU's share still free: a host of a tp 1 cell under `cells_per_gpu: N` takes 1/N of one
        self.gpu_free = {g: Fraction(1) for g in gpu_pool()[0] or (["0"] if self.node.resources.get("mps") else [])}
        self.line: list[Worker] = []  # not started yet, in the order asked
        self.running: list[Worker] = []
        self.started = 0
        self.closing = False  # the run is stopping: no waiting host starts any more
        self.early: dict[str, tuple[Worker, Future]] = {}  # cell id -> a host started ahead (prestart), its load
        self.log_dir = cache_root() / "local-workers"
        _prune(self.log_dir)

    def nodes(self) -> list:
        return [self.node]

    def here(self) -> str:
        return NODE_ID

    def open(self, where: str, nonce: str):
        from actors.stack_actor import Delivery

        return Delivery(where, nonce, None)  # every host of this machine writes its own shards

    def _worker(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, delivery, share: int = 1) -> Worker:
        gpus = cell.tp if placement.NEEDS[cell.device].gpu else 0
        return Worker(
            cell.cell_id,
            (desc, model, threads, delivery),
            min(self.cpus, threads * cell.tp),
            gpus,
            backend_class(cell.engine).runtime_env(desc, threads),
            Fraction(1, share) if gpus == 1 else Fraction(1),
        )

    def prestart(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, delivery) -> None:
        """Start a cell's host and its engine load before the run asks for the cell
        (matrix/run/early.py); start() takes it over when asked with the same arguments."""
        w = self._worker(cell, desc, model, threads, delivery)
        self.line.append(w)
        self.early[cell.cell_id] = (w, w.call("load"))
        self._pump()

    def load_ahead(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, delivery) -> bool:
        """Start now the host of a cell the run starts once the cell in flight is done (a candidate
        measured against its reference as it captures), so its process start and engine load run
        beside that capture instead of after it. Until the run starts its cell it holds no CPUs and
        runs nothing but its load; then it waits in line for its CPUs like any host (start()). One
        such host at a time, for a CPU cell of one rank run on a file (a GGUF candidate), where this
        machine's free memory holds that file twice over and a GiB more; -> whether it started."""
        ahead = any(w.cpus_held == 0 and w.proc is not None and not w.gone for w, _ in self.early.values())
        if ahead or self.closing or cell.cell_id in self.early or cell.tp != 1 or cell.device != "cpu":
            return False
        if not cell.artifact or not Path(cell.artifact).is_file():
            return False  # a checkpoint directory's size says nothing of its memory
        if 2 * Path(cell.artifact).stat().st_size + (1 << 30) > available_memory():
            return False
        w = self._worker(cell, desc, model, threads, delivery)
        self.early[cell.cell_id] = (w, w.call("load"))
        self.running.append(w)  # holding no CPUs until the run starts its cell
        self.started += 1
        w.spawn([], self.log_dir, self.started)
        return True

    def keep_early(self, cell_ids) -> None:
        """Stop the hosts started ahead for cells the run will not start (done, or left out)."""
        for cid in [c for c in self.early if c not in cell_ids]:
            self.stop(Started(self.early.pop(cid)[0]))

    def _adopt(self, w: Worker) -> tuple[Worker, Future | None]:
        """(the host started ahead for w's cell with w's very arguments, its load), or (w, None)."""
        early, load = self.early.pop(w.cell_id, (None, None))
        if early is None:
            return w, None
        same = (early.init, early.cpus, early.gpus, early.gpu_part, early.env)
        if same == (w.init, w.cpus, w.gpus, w.gpu_part, w.env) and not early.gone:
            return early, load
        self.stop(Started(early))  # asked with other arguments: that one goes, this one starts
        return w, None

    def start(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work) -> Started:
        w, load = self._adopt(self._worker(cell, desc, model, threads, work.delivery, work.gpu_share))
        if load is None:
            self.line.append(w)
        elif w in self.running and not w.cpus_held:  # loaded ahead: its calls wait with it for its CPUs
            w.holding = True
            self.line.append(w)
        if measures_in_host(cell, work):  # before load, so the two overlap (it returns at once: a thread)
            w.call("warm_metrics", work.vocab)
        load = load or w.call("load")
        started = Started(w, calls={w.ready: Call(Kind.READY, cell.cell_id), load: Call(Kind.LOAD, cell.cell_id)})
        queue_calls(started, cell, work, lambda host, method, *args: host.call(method, *args))
        self._pump()
        return started

    def reuse(self, started: Started, cell: Cell, desc: StackDesc, work: Work) -> Started:
        w = started.actor
        w.cell_id = cell.cell_id  # what its WorkerDied says from now on
        return reuse_host(started, cell, desc, work, lambda host, method, *args: host.call(method, *args))

    def _pump(self) -> None:
        """Start waiting hosts, first come first served, while their CPUs and GPUs are free."""
        while not self.closing and self.line and self.line[0].cpus <= self.free_cpus:
            w = self.line[0]
            if w.gone:  # loaded ahead and died while it waited: its calls have failed already
                self.line.pop(0)
                continue
            gpu_ids = self._gpus_for(w)
            if gpu_ids is None:
                return
            self.line.pop(0)
            for g in gpu_ids:
                self.gpu_free[g] -= w.gpu_part
            self.free_cpus -= w.cpus
            w.cpus_held = w.cpus
            if w.proc is not None:  # loaded ahead (load_ahead): running already, its calls held till now
                w.release()
                continue
            self.running.append(w)
            self.started += 1
            w.spawn(gpu_ids, self.log_dir, self.started)

    def _gpus_for(self, w: Worker) -> list[str] | None:
        """The GPUs w's host gets now (the freest first, so shared hosts spread over the GPUs), or
        None while too few have its share free."""
        fits = sorted((g for g, free in self.gpu_free.items() if free >= w.gpu_part), key=lambda g: -self.gpu_free[g])
        return fits[: w.gpus] if len(fits) >= w.gpus else None

    def _release(self, w: Worker) -> None:
        if w in self.running:
            self.running.remove(w)
            self.free_cpus += w.cpus_held
            w.cpus_held = 0
            for g in w.gpu_ids:
                self.gpu_free[g] += w.gpu_part

    def stop(self, started: Started) -> None:
        for w in started.actors:
            if w in self.line:
                self.line.remove(w)
            w.ended("its worker process was stopped")
            self._release(w)
        self._pump()

    def close(self, started: Started) -> None:
        for f in [w.call("close") for w in started.actors]:
            self.get(f)

    def wait(self, futures: list, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            ready = [f for f in futures if f.done]
            left = deadline - time.monotonic()
            if ready or left <= 0:
                return ready
            for w in [w for w in self.running if w.proc.poll() is not None]:
                self._drain(w)  # exited: what it answered first, then WorkerDied for the rest
            conns = {w.conn: w for w in self.running if not w.gone}
            if not conns:  # nothing can answer (callers never wait on a host that is not running)
                time.sleep(min(left, 1.0))
                continue
            # at most a second at a time: a worker whose socket an engine's child keeps open
            # sends no EOF when it dies, so its exit is seen by poll() above
            for c in wait_conns(list(conns), timeout=min(left, 1.0)):
                if not conns[c].receive():
                    self._release(conns[c])

    def _drain(self, w: Worker) -> None:
        while not w.gone and w.conn.poll(0):
            w.receive()
        w.ended(None)
        self._release(w)

    def get(self, future: Future) -> Any:
        while not future.done:
            self.wait([future], 3600.0)
        if future.error is not None:
            raise future.error
        return future.value

    def wait_gone(self, hosts: list, timeout_s: float = 15.0) -> None:
        for w in hosts:
            if w.proc is not None:
                w.proc.wait(timeout_s)

    def shutdown(self) -> None:
        self.closing = True
        for w in self.line + self.running:
            w.ended("the run ended")
            self._release(w)
        self.line = []

    def node_build(self, opts: dict, env: dict | None, libraries: tuple[str, ...]) -> Future:
        """The engine build a host would see, in the interpreter it would run under (no engine import)."""
        f = Future(None)
        code = (
            "import json, sys; from common.builds import engine_build; "
            "print(json.dumps(engine_build(tuple(sys.argv[1:]))))"
        )
        python, penv = interpreter(env)
        r = subprocess.run([python, "-c", code, *libraries], capture_output=True, text=True, env=penv)
        if r.returncode != 0:
            f.settle(
                False, RuntimeError(f"{python}: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}")
            )
        else:
            import json

            f.settle(True, {"node_id": NODE_ID, "host": socket.gethostname(), **json.loads(r.stdout)})
        return f
