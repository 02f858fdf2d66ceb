"""The metric kernel (analysis/metrics_kernel.c) built for this machine on first use and loaded
through ctypes: no torch and no JIT in the process that measures, a ~0.1 s build cached per
source, compiler and CPU. None where there is no C compiler or the build fails; the caller then
runs the same arithmetic in numpy (analysis/metrics.py) and says so once.

    reduce(x, y, block) -> (out (rows, 12) float64, block maxima of x and of y (rows, vocab // block))
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common.files import cache_root

SOURCE = Path(__file__).with_name("metrics_kernel.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
LIBS = ["-lmvec", "-lm"]  # glibc's vector exp/log (the kernel's simd declarations)
ROWS_PER_TASK = 16  # rows one thread takes at a time: a prompt's rows spread over the threads

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """Threads a call spreads its rows over: the CPUs this process may use, capped by
    LOGIT_MATRIX_KERNEL_THREADS or else OMP_NUM_THREADS (what a Ray task or a benchmark sets)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cap = os.environ.get("LOGIT_MATRIX_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS") or ""
    return max(1, min(n, int(cap))) if cap.isdigit() else n


def _cpu_key() -> str:
    """What -march=native builds for: the CPU's model and flags (a cache shared by machines of
    other CPUs then holds one build each)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join(lines) or platform.processor() or platform.machine()


def _compiler() -> tuple[str, str] | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return cc, out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"


def _build() -> ctypes.CDLL:
    found = _compiler()
    if found is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    cc, version = found
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, *FLAGS, *LIBS, _cpu_key()]).encode()).hexdigest()[:16]
    so = cache_root() / "kernels" / f"metrics-{key}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, *LIBS], capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise OSError(f"{cc} failed: {(res.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
            os.replace(tmp, so)  # whole or not at all: another process may be building the same key
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    for name in ("reduce_f32", "reduce_f64"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
    lib.outputs.restype = ctypes.c_int64
    return lib


def load() -> ctypes.CDLL | None:
    """The built kernel, or None (why: failure())."""
    global _lib, _failed
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                _failed = f"{type(e).__name__}: {str(e).strip()[:200]}"
                print(f"logit-matrix: the native metric kernel could not be built ({_failed}); metrics run in "
                      "numpy (same float64 arithmetic, ~10x slower)", file=sys.stderr)
    return _lib


def failure() -> str | None:
    return _failed


def _pool_of(n: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers != n:
            _pool = ThreadPoolExecutor(n, thread_name_prefix="metric-kernel")
        return _pool


def reduce(x: np.ndarray, y: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y: (rows, vocab) float32 or float64 (the same), C-contiguous -> (rows, 12) float64 sums,
    (rows, vocab // block) block maxima of each in their dtype. The built kernel must be loaded."""
    lib = _lib
    rows, vocab = x.shape
    fn = lib.reduce_f32 if x.dtype == np.float32 else lib.reduce_f64
    out = np.empty((rows, lib.outputs()))
    bx, by = (np.empty((rows, vocab // block), x.dtype) for _ in range(2))
    ptrs = [a.ctypes.data for a in (x, y)], [a.ctypes.data for a in (out, bx, by)]

    def run(first: int) -> None:
        fn(*ptrs[0], first, min(first + ROWS_PER_TASK, rows), vocab, block, *ptrs[1])

    starts = range(0, rows, ROWS_PER_TASK)
    n = threads()
    if n == 1 or rows <= ROWS_PER_TASK:
        for s in starts:
            run(s)
    else:
        list(_pool_of(n).map(run, starts))  # ctypes drops the GIL for the call: the rows run side by side
    return out, bx, by
