"""A worker process of the local executor (matrix/run/local_worker.py): one StackHost, its calls in order.

Started as `python .../actors/local_host.py FD LOG` (by path, so the driver's working directory
never lands on sys.path: a `ray/` session directory there would shadow a package):
FD is this end of a socket pair the driver made
(no address, nothing another process could reach), LOG the file that takes this process's
stdout and stderr (engines print there; the driver's terminal stays one line per event). A
reader thread takes every queued call off the socket at once, so the driver never blocks
sending while a forward runs; the main thread runs them in order, as a Ray actor would.
Messages: ("init", args) then (seq, method, args); each answered (seq, {"ok", "blob", ...}): the
value or the exception pickled apart, so one the driver cannot unpickle fails only its call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this file's own directory: its modules are imported as actors.*, never bare

import pickle
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection

INIT = 0  # the seq of the constructor's answer (the host is ready)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the driver dies, even in the middle of a forward."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _answer(conn: Connection, seq: int, fn, args: tuple) -> None:
    try:
        out = {"ok": True, "blob": pickle.dumps(fn(*args))}
    except BaseException as e:  # sent back whole: the driver's retry policy judges it
        out = failure(e)
    conn.send((seq, out))


def failure(e: BaseException) -> dict:
    """An exception as the driver can always read it: its class and first line, its traceback
    (for --debug), and the exception itself pickled when it pickles. The driver's interpreter
    may lack this one's modules (a vLLM worker runs under vLLM's own environment), so it unpickles
    the blob itself and falls back to the class and line."""
    text = str(e)
    out = {
        "ok": False,
        "class": type(e).__name__,
        "line": text.splitlines()[0] if text else "",
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "blob": None,
    }
    try:
        out["blob"] = pickle.dumps(e)
    except Exception:  # an exception holding an unpicklable object: its class and line stand for it
        pass
    return out


def main(fd: int, log_path: str) -> None:
    _die_with_parent()
    _redirect(log_path)
    os.set_inheritable(fd, False)  # an engine's own processes must not hold the driver's socket open
    conn = Connection(fd)
    calls: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                calls.put(conn.recv())
        except (EOFError, OSError):
            calls.put(None)  # the driver closed its end: finish

    kind, args = conn.recv()
    assert kind == "init", kind
    from actors.stack_actor import StackHost

    host: list = []  # the StackHost, or the exception its constructor raised

    def make(*a):
        try:
            host.append(StackHost(*a))
        except BaseException as e:
            host.append(e)
            raise

    _answer(conn, INIT, make, args)
    threading.Thread(target=read, daemon=True).start()
    while (msg := calls.get()) is not None:
        seq, method, margs = msg
        if isinstance(host[0], BaseException):  # as on Ray: every call of a host that was never made fails
            _answer(conn, seq, _reraise, (host[0],))
            continue
        _answer(conn, seq, getattr(host[0], method), margs)


def _reraise(e: BaseException):
    raise e


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
