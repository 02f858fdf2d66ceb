"""A host of the local executor (matrix/run/local.py): one worker process of this machine, the
interpreter and environment it starts under, the calls sent to it over a socket and the futures
their answers settle. A process that dies settles its calls still out with WorkerDied, with the
last line its engine printed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from matrix.run.failures import CallError, WorkerDied

ROOT = Path(__file__).resolve().parents[2]  # the project's import root, for a worker's other interpreter


def interpreter(runtime_env: dict | None) -> tuple[str, dict]:
    """(python, environment) a host runs under: a Ray runtime_env's py_executable and env_vars,
    with this project first on PYTHONPATH (another interpreter need not have it installed)."""
    runtime_env = runtime_env or {}
    env = {**os.environ, **(runtime_env.get("env_vars") or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return runtime_env.get("py_executable") or sys.executable, env


class Future:
    __slots__ = ("worker", "done", "value", "error")

    def __init__(self, worker: "Worker"):
        self.worker, self.done, self.value, self.error = worker, False, None, None

    def settle(self, ok: bool, value: Any) -> None:
        self.done, self.value, self.error = True, value if ok else None, None if ok else value


class Worker:
    """One host process: what it needs, its calls (queued until it starts), its futures."""

    def __init__(self, cell_id: str, init: tuple, cpus: int, gpus: int, env: dict | None, gpu_part=1):
        """gpus: how many GPUs the host holds; gpu_part: the share of each it takes (a Fraction:
        1, or 1/N for a tp 1 cell under `cells_per_gpu: N`)."""
        self.cell_id, self.init, self.cpus, self.gpus, self.env = cell_id, init, cpus, gpus, env or {}
        self.gpu_part = gpu_part
        self.cpus_held = 0  # the executor's CPUs this host holds now (none while it loads ahead)
        self.holding = False  # its calls kept in the outbox: a host loaded ahead, waiting for its CPUs
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.log: Path | None = None
        self.gpu_ids: list[str] = []
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
        elif self.conn is None or self.holding:
            self.outbox.append((seq, method, args))
        else:
            self._send((seq, method, args))
        return f

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the process died: its calls raise WorkerDied, with what it printed last
            self.ended(None)

    def environment(self, gpu_ids: list[str]) -> tuple[str, dict]:
        """(python, environment) of this worker's process."""
        python, env = interpreter(self.env)
        env.setdefault("OMP_NUM_THREADS", str(self.cpus))  # as Ray sets it for an actor's num_cpus
        # numpy asks for transparent huge pages for every array over 4 MiB; a capture's per-prompt
        # arrays then fault in zeroed 2 MiB pages, slower than without (docs/benchmark-notes.md)
        env.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
        if gpu_ids or "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        return python, env

    def spawn(self, gpu_ids: list[str], log_dir: Path, n: int) -> None:
        """n: this executor's n-th worker (its log file's name)."""
        python, env = self.environment(gpu_ids)
        ours, theirs = socket.socketpair()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{self.cell_id.replace('/', '_')}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{n}.log"
        host = ROOT / "actors" / "local_host.py"
        self.proc = subprocess.Popen(
            [python, str(host), str(theirs.fileno()), str(self.log)],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # Ctrl-C reaches the driver, which stops it
        theirs.close()
        self.conn, self.gpu_ids = Connection(ours.detach()), gpu_ids
        for msg in [("init", self.init)] + self.outbox:
            self._send(msg)
        self.outbox = []

    def release(self) -> None:
        """Send the calls kept in the outbox while the host waited for its CPUs."""
        self.holding = False
        for msg in self.outbox:
            self._send(msg)
        self.outbox = []

    def receive(self) -> bool:
        """Take one answer off the socket; False when the process is gone."""
        try:
            seq, answer = self.conn.recv()
        except (EOFError, OSError):
            self.ended(None)
            return False
        self.futures[seq].settle(*_unpack(answer))
        return True

    def ended(self, why: str | None) -> None:
        """The process is gone (killed, or it died): every call still out raises WorkerDied."""
        if self.gone:
            return
        self.gone = True
        if self.proc is not None:
            if why is None:
                self.proc.wait()
                why = f"its worker process (pid {self.proc.pid}) died with {_exit(self.proc.returncode)}" + _tail(
                    self.log
                )
            else:  # its whole session: an engine's own processes too (vLLM's engine core, compile workers)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        for f in self.futures.values():
            if not f.done:
                f.settle(False, WorkerDied(f"{self.cell_id}: {why or 'its worker process was stopped'}"))


def _unpack(answer: dict) -> tuple[bool, Any]:
    """(ok, value or CallError) from a worker's answer (actors/local_host.py). What this interpreter
    cannot unpickle fails that call alone, by its class and first line."""
    if answer["ok"]:
        try:
            return True, pickle.loads(answer["blob"])
        except Exception as e:
            return False, CallError(RuntimeError(f"the worker's answer cannot be read here: {type(e).__name__}: {e}"))
    try:
        cause = pickle.loads(answer["blob"]) if answer["blob"] is not None else None
    except Exception:  # e.g. a vLLM exception, raised under vLLM's interpreter: its class and line stand
        cause = None
    if cause is None:
        cause = RuntimeError(f"{answer['class']}: {answer['line']}" if answer["line"] else answer["class"])
    err = CallError(cause)
    err.add_note(answer["traceback"])  # the worker's traceback, shown with --debug
    return False, err


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
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
