"""Small C kernels of this project (analysis/metrics_kernel.c, store/floors_kernel.c) built for
this machine on first use and loaded through ctypes, which drops the GIL for each call.

A build takes ~0.4 s and is cached per source, compiler, flags and CPU under the cache root
(kernels/). No compiler, or a failed build: load() returns None, says why once on stderr, and
the caller runs the same arithmetic in numpy. LOGIT_MATRIX_COMPILE=0 forces that everywhere.
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
from typing import Callable

from common.files import cache_root

# -ffp-contract=off: no fused multiply-adds, so each kernel computes the expressions its numpy
# twin does, rounding for rounding; -fno-math-errno (not -ffast-math) keeps IEEE inf and NaN.
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
# glibc's vector exp/log (the kernels' simd declarations); where there is no libmvec (macOS,
# musl) the same source builds with scalar exp/log, still far faster than numpy's passes
VARIANTS = (["-lmvec", "-lm"], ["-DNO_LIBMVEC", "-lm"])

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_failed: dict[str, str] = {}
_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """Threads a kernel call spreads its rows over: the CPUs this process may use, capped by
    LOGIT_MATRIX_KERNEL_THREADS or else OMP_NUM_THREADS (what a Ray task or a benchmark sets)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cap = os.environ.get("LOGIT_MATRIX_KERNEL_THREADS") or os.environ.get("OMP_NUM_THREADS") or ""
    return max(1, min(n, int(cap))) if cap.isdigit() else n


def _cpu_key() -> str:
    """What -march=native builds for: the CPU's model and flags (a cache shared by machines of
    other CPUs then holds one build each)."""
    try:
        lines = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("model name", "flags"))]
    except OSError:
        lines = []
    return "\n".join(lines[:2]) or platform.processor() or platform.machine()


def _build(source: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    errors = []
    for extra in VARIANTS:
        key = hashlib.sha256("\n".join([source.read_text(), ver, *FLAGS, *extra, _cpu_key()]).encode()).hexdigest()[:16]
        so = cache_root() / "kernels" / f"{source.stem}-{key}.so"
        if so.exists():
            return ctypes.CDLL(str(so))
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            res = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, *extra], capture_output=True, text=True, timeout=120)
            if res.returncode == 0:
                os.replace(tmp, so)  # whole or not at all: another process may be building the same key
                return ctypes.CDLL(str(so))
            errors.append((res.stderr.strip().splitlines() or ["no output"])[-1][:200])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError(f"{cc} failed: {'; '.join(errors)}")


def load(source: Path, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The kernel built from source with its functions' signatures declared, or None (why: failure())."""
    name = str(source)
    with _lock:
        if name not in _loaded:
            lib = None
            if os.environ.get("LOGIT_MATRIX_COMPILE", "1") == "0":
                _failed[name] = "LOGIT_MATRIX_COMPILE=0"
            else:
                try:
                    lib = _build(source)
                    declare(lib)
                except (OSError, subprocess.SubprocessError, AttributeError) as e:
                    _failed[name] = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    print(f"logit-matrix: {source.name} could not be built ({_failed[name]}); the same arithmetic "
                          "runs in numpy (~10x slower)", file=sys.stderr)
            _loaded[name] = lib
        return _loaded[name]


def failure(source: Path) -> str | None:
    return _failed.get(str(source))


def spread(fn: Callable[[int, int], None], rows: int, per_task: int) -> None:
    """fn(first, last) over [0, rows) in tasks of per_task rows, on threads() threads."""
    global _pool
    starts = range(0, rows, per_task)
    n = threads()
    if n == 1 or rows <= per_task:
        for s in starts:
            fn(s, min(s + per_task, rows))
        return
    with _lock:
        if _pool is None or _pool._max_workers != n:
            _pool = ThreadPoolExecutor(n, thread_name_prefix="native-kernel")
        pool = _pool
    list(pool.map(lambda s: fn(s, min(s + per_task, rows)), starts))  # ctypes drops the GIL: tasks run side by side
