"""A command's wall time and peak memory, as the benchmarks that race another tool measure them:
the process's own (wait4), and the largest cell host's while it runs (ActorPeak)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path


def watched(cmd: list[str], env: dict, log_to: Path, peak: ActorPeak | None = None) -> tuple[float, float, str, int]:
    """-> (wall seconds, peak RSS in GB of the process and its waited-for children, its output, its
    exit code: negative for the signal that ended it, as -9 where the OOM killer took it). peak:
    an ActorPeak that watches this process's cell hosts."""
    with open(log_to, "w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        if peak is not None:
            peak.root = str(p.pid)
        _, status, usage = os.wait4(p.pid, 0)  # the child's own rusage, not every child's so far
        wall = time.perf_counter() - t0
    # ru_maxrss: KiB on Linux; a killed process's rusage still holds the peak it reached
    return wall, usage.ru_maxrss / 1e6, Path(log_to).read_text(), os.waitstatus_to_exitcode(status)


def exit_text(code: int) -> str:
    """How a command ended, in words: 'exit 0', 'exit 1', 'killed by SIGKILL'."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def timed(cmd: list[str], env: dict, log_to: Path, peak: ActorPeak | None = None) -> tuple[float, float, str]:
    """-> (wall seconds, peak RSS in GB, its output); a command that fails ends the benchmark."""
    wall, peak_gb, text, code = watched(cmd, env, log_to, peak)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({exit_text(code)}):\n{text[-3000:]}")
    return wall, peak_gb, text


def _parent(pid: str) -> str | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
        return (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def _descends(pid: str, root: str) -> bool:
    for _ in range(64):  # a process tree is never this deep; a cycle read mid-change ends here
        if pid == root:
            return True
        if pid in (None, "0", "1"):
            return False
        pid = _parent(pid)
    return False


class ActorPeak:
    """The largest peak RSS (VmHWM) of any cell host of the watched command while it runs: a Ray
    actor is raylet's child, a local worker runs in its own session, so wait4 on the driver sees
    neither. Only the command's descendants count (watched() names it, as root): the cell hosts of
    another run on a shared machine are not this one's. A Ray cluster the command starts itself
    (ray.init) is its descendant; one it joins (--address) is not, and counts nothing."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak_kb, self.stop, self.root = every, 0, threading.Event(), None

    def _poll(self) -> None:
        while not self.stop.wait(self.every):
            for proc in Path("/proc").iterdir() if self.root else ():
                try:
                    cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
                    host = b"StackActor" in cmdline or b"local_host.py" in cmdline
                    if host and _descends(proc.name, self.root):
                        hwm = re.search(r"VmHWM:\s+(\d+) kB", (proc / "status").read_text())
                        self.peak_kb = max(self.peak_kb, int(hwm.group(1)) if hwm else 0)
                except OSError:  # the process ended between listing and reading
                    continue

    def __enter__(self):
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
