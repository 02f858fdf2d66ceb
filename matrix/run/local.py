"""The local executor: each cell's host is a worker process of this machine, without Ray.

For a machine that cannot join a cluster (a locked-down GPU box, a laptop, a CI runner) or a job
too small to pay for one. The run loop, the order rules, the retry policy and every row are the
same as on Ray (matrix/run/launch.py): only where a host runs differs. A host asks for what its
Ray actor would (threads, or threads x tp; one GPU, or tp), waits in line until this machine has
them free, and gets its GPUs through CUDA_VISIBLE_DEVICES. A host that dies takes only its own
calls down (WorkerDied: retried like a dead actor). Cells whose ranks must be Ray actors (tp
ranks over torch.distributed, vLLM's Ray executor) need a cluster: check() says so before anything runs.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait as wait_conns
from pathlib import Path
from typing import Any

from backends import backend_class
from common.errors import UserError
from common.files import cache_root
from common.stack import Cell, ModelCopy, StackDesc
from matrix.run import placement
from matrix.run.failures import CallError, WorkerDied
from matrix.run.launch import Call, Kind, Started, Work, measures_in_host, queue_calls

NODE_ID = "local:" + socket.gethostname()  # what actors/stack_actor.py StackHost.node_id says
ROOT = Path(__file__).resolve().parents[2]  # the project's import root, for a worker's other interpreter


class Future:
    __slots__ = ("worker", "done", "value", "error")

    def __init__(self, worker: "Worker"):
        self.worker, self.done, self.value, self.error = worker, False, None, None

    def settle(self, ok: bool, value: Any) -> None:
        self.done, self.value, self.error = True, value if ok else None, None if ok else value


class Worker:
    """One host process: what it needs, its calls (queued until it starts), its futures."""

    def __init__(self, cell_id: str, init: tuple, cpus: int, gpus: int, env: dict | None):
        self.cell_id, self.init, self.cpus, self.gpus, self.env = cell_id, init, cpus, gpus, env or {}
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.log: Path | None = None
        self.gpu_ids: list[int] = []
        self.outbox: list[tuple] = []  # (seq, method, args) sent once the process starts
        self.futures: dict[int, Future] = {}
        self.ready = self._future(0)
        self.gone = False

    def _future(self, seq: int) -> Future:
        self.futures[seq] = f = Future(self)
        return f

    def call(self, method: str, *args) -> Future:
        seq = len(self.futures)
        f = self._future(seq)
        if self.gone:
            f.settle(False, WorkerDied(f"{self.cell_id}: its worker process was stopped"))
        elif self.conn is None:
            self.outbox.append((seq, method, args))
        else:
            self.conn.send((seq, method, args))
        return f

    def spawn(self, gpu_ids: list[int], log_dir: Path) -> None:
        python = self.env.get("py_executable") or sys.executable
        env = {**os.environ, **(self.env.get("env_vars") or {})}
        env.setdefault("OMP_NUM_THREADS", str(self.cpus))  # as Ray sets it for an actor's num_cpus
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if gpu_ids or "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        ours, theirs = socket.socketpair()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{self.cell_id.replace('/', '_')}-{time.strftime('%Y%m%dT%H%M%S')}.log"
        host = ROOT / "actors" / "local_host.py"
        self.proc = subprocess.Popen([python, str(host), str(theirs.fileno()), str(self.log)],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # Ctrl-C reaches the driver, which stops it
        theirs.close()
        self.conn, self.gpu_ids = Connection(ours.detach()), gpu_ids
        self.conn.send(("init", self.init))
        for msg in self.outbox:
            self.conn.send(msg)
        self.outbox = []

    def receive(self) -> bool:
        """Take one answer off the socket; False when the process is gone."""
        try:
            seq, ok, value = self.conn.recv()
        except (EOFError, OSError):
            self.ended(None)
            return False
        self.futures[seq].settle(ok, value if ok else CallError(value))
        return True

    def ended(self, why: str | None) -> None:
        """The process is gone (killed, or it died): every call still out raises WorkerDied."""
        if self.gone:
            return
        self.gone = True
        if self.proc is not None:
            if why is None:
                self.proc.wait()
                why = f"its worker process (pid {self.proc.pid}) died with {_exit(self.proc.returncode)}" + _tail(self.log)
            else:
                self.proc.kill()
                self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        for f in self.futures.values():
            if not f.done:
                f.settle(False, WorkerDied(f"{self.cell_id}: {why or 'its worker process was stopped'}"))


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            import signal

            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _tail(log: Path | None) -> str:
    """The last line its engine printed (a crash says why there)."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log else []
    except OSError:
        return ""
    return f" (last output: {lines[-1].strip()[:300]})" if lines else ""


def local_node() -> placement.Node:
    """This machine as a placement node: its CPUs, NVIDIA GPUs (nvidia-ml-py) and device labels."""
    resources: dict[str, float] = {"CPU": float(os.cpu_count() or 1)}
    labels: dict[str, str] = {}
    names = _nvidia_gpus()
    if names:
        resources["GPU"] = float(len(names))
        # Ray's accelerator type from the name ("NVIDIA H200" -> H200): the same device labels match
        labels[placement.RAY_ACCEL] = names[0].removeprefix("NVIDIA ").strip().replace(" ", "-")
    elif sys.platform == "darwin" and platform.machine() == "arm64":
        resources.update({"GPU": 1.0, "mps": 1.0})
        labels[placement.RAY_ACCEL] = "Apple-Silicon"
    if os.environ.get("LOGIT_MATRIX_DEVICE"):  # the label a cluster.yaml would set (placement.LABEL)
        labels[placement.LABEL] = os.environ["LOGIT_MATRIX_DEVICE"]
    return placement.Node(NODE_ID, socket.gethostname(), resources, labels)


def _nvidia_gpus() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a CPU machine
        return []
    try:
        return [str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


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
        raise UserError(f"{c.cell_id}: {why}; run it with --executor ray")


class LocalExecutor:
    """Hosts in worker processes of this machine, started in the order asked as resources free up."""

    name = "local"

    def __init__(self):
        self.node = local_node()
        self.cpus = int(self.node.resources["CPU"])
        self.free_cpus = self.cpus
        self.free_gpus = list(range(int(self.node.resources.get("GPU", 0))))
        self.line: list[Worker] = []  # not started yet, in the order asked
        self.running: list[Worker] = []
        self.log_dir = cache_root() / "local-workers"

    def nodes(self) -> list:
        return [self.node]

    def here(self) -> str:
        return NODE_ID

    def open(self, where: str, nonce: str):
        from actors.stack_actor import Delivery

        return Delivery(where, nonce, None)  # every host of this machine writes its own shards

    def start(self, cell: Cell, desc: StackDesc, model: ModelCopy, threads: int, nodes: list, work: Work) -> Started:
        cls = backend_class(cell.engine)
        gpus = cell.tp if placement.NEEDS[cell.device].gpu else 0
        w = Worker(cell.cell_id, (desc, model, threads, work.delivery), min(self.cpus, threads * cell.tp),
                   gpus, cls.runtime_env(desc, threads))
        self.line.append(w)
        started = Started(w, calls={w.ready: Call(Kind.READY, cell.cell_id), w.call("load"): Call(Kind.LOAD, cell.cell_id)})
        if measures_in_host(cell, work):  # returns at once (a thread); its failure comes back with the first measurement
            w.call("warm_metrics", work.vocab)
        queue_calls(started, cell, work, lambda host, method, *args: host.call(method, *args))
        self._pump()
        return started

    def _pump(self) -> None:
        """Start waiting hosts, first come first served, while their CPUs and GPUs are free."""
        while self.line and self.line[0].cpus <= self.free_cpus and self.line[0].gpus <= len(self.free_gpus):
            w = self.line.pop(0)
            gpu_ids, self.free_gpus = self.free_gpus[:w.gpus], self.free_gpus[w.gpus:]
            self.free_cpus -= w.cpus
            self.running.append(w)
            w.spawn(gpu_ids, self.log_dir)

    def _release(self, w: Worker) -> None:
        if w in self.running:
            self.running.remove(w)
            self.free_cpus += w.cpus
            self.free_gpus = sorted(self.free_gpus + w.gpu_ids)

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
            conns = {w.conn: w for w in self.running if not w.gone}
            if not conns:  # nothing can answer (callers never wait on a host that is not running)
                time.sleep(left)
                return []
            for c in wait_conns(list(conns), timeout=left):
                if not conns[c].receive():
                    self._release(conns[c])

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
        for w in self.line + self.running:
            w.ended("the run ended")
            self._release(w)
        self.line = []

    def node_build(self, opts: dict, env: dict | None, libraries: tuple[str, ...]) -> Future:
        """The engine build a host would see, in the interpreter it would run under (no engine import)."""
        f = Future(None)
        code = ("import json, sys; from common.builds import engine_build; "
                "print(json.dumps(engine_build(tuple(sys.argv[1:]))))")
        python = (env or {}).get("py_executable") or sys.executable
        penv = {**os.environ, **((env or {}).get("env_vars") or {}),
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        r = subprocess.run([python, "-c", code, *libraries], capture_output=True, text=True, env=penv)
        if r.returncode != 0:
            f.settle(False, RuntimeError(f"{python}: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}"))
        else:
            import json

            f.settle(True, {"node_id": NODE_ID, "host": socket.gethostname(), **json.loads(r.stdout)})
        return f
