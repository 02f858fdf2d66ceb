"""The llama.cpp engine's CPU code paths (`options: {cpu_path: ...}`, common/cpu_paths.py): llama.cpp
builds its CPU backend once per instruction set when ggml loads its backends at run time
(GGML_BACKEND_DL with GGML_CPU_ALL_VARIANTS: x64, haswell, skylakex, cooperlake, ...).

A cell on a path runs the package's own libllama, libggml and libggml-base with the path's variant
in place of the package's libggml-cpu: the variant module defines the same ggml_backend_cpu_reg the
package's libggml registers its CPU backend through, and only ggml-cpu's kernels differ between
instruction sets. The variant alone is built from the installed package's vendor/llama.cpp into the
tools cache when a cell first asks (never by `make venv`; a second libllama would compile minutes more),
then copied with the package's libraries into a directory of their own, which llama-cpp-python loads
from LLAMA_CPP_LIB_PATH. The host reads back what runs: ggml's score of the variant for this CPU
(0 where it lacks an instruction) and the CPU backend's features as llama_print_system_info() lists
them, which must be the variant's.

AMX stays off (scripts/llama_cmake_args.py): its matmul crashes on some Xeons
(ggml-org/llama.cpp#20824), so cpu_path amx is refused on llama.cpp with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

# our path -> ggml's variant (ggml/src/CMakeLists.txt ggml_add_cpu_backend_variant), and the
# features llama_print_system_info() must then list as on (= 1) and must not
VARIANTS = {
    "scalar": ("x64", (), ("AVX2", "AVX512")),
    "avx2": ("haswell", ("AVX2", "FMA"), ("AVX512",)),
    "avx512": ("skylakex", ("AVX2", "AVX512"), ("AVX512_BF16", "AVX512_VNNI")),
    "avx512_bf16": ("cooperlake", ("AVX512", "AVX512_VNNI", "AVX512_BF16"), ("AMX_INT8",)),
}
REFUSED = {"amx": "llama.cpp's AMX matmul crashes on some Xeons (ggml-org/llama.cpp#20824); its AMX stays off"}
COMMON = [
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
]
# the module finds its libggml-base beside it, in a path's directory, never in the tree it was built in
VARIANT_ARGS = [
    *COMMON,
    "-DGGML_CPU_ALL_VARIANTS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
]
ENV_LIB = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's own: the directory it loads libllama from
STALE_S = 86400  # a path's directory of another build of the package or variant, kept this long for another venv
CPU_LIB = "libggml-cpu"  # the package's CPU backend, whose names the variant takes in a path's directory


def refusal(value: str) -> str | None:
    """Why llama.cpp runs no path `value` (None: it runs it)."""
    if value in REFUSED:
        return REFUSED[value]
    return None if value in VARIANTS else f"llama.cpp builds no CPU backend for path {value}"


def _cmake(args: list[str], what: str, tree: Path) -> None:
    """cmake with args (a configure of `tree`, or a build in it); a failed configure leaves no tree
    behind (a later cell configures again), and either says the tree and its first error line."""
    configure = "--build" not in args
    gen = ["-G", "Ninja"] if shutil.which("ninja") and configure else []
    r = subprocess.run(["cmake", *args, *gen], capture_output=True, text=True)
    if r.returncode != 0:
        if configure:
            shutil.rmtree(tree, ignore_errors=True)
        lines = (r.stderr + r.stdout).strip().splitlines()
        first = next(
            (ln.strip() for ln in lines if "error" in ln.lower()), lines[-1] if lines else f"exit {r.returncode}"
        )
        raise RuntimeError(f"building llama.cpp's {what} in {tree} failed: {first}")


def source() -> Path:
    """The installed llama-cpp-python's vendor/llama.cpp, unpacked once into the tools cache. Its
    version read from the package's metadata: importing llama_cpp would load its own library."""
    from importlib.metadata import version

    from backends.gguf_build import vendor_tree
    from common.files import cache_root, locked

    v = version("llama_cpp_python")
    root = cache_root() / "tools" / f"llama.cpp-{v}"
    if not (root / "CMakeLists.txt").is_file():
        with locked(root.parent):  # two hosts asking at once: one unpacks, the other finds it there
            if not (root / "CMakeLists.txt").is_file():
                vendor_tree(v, root)
    return root


def build(value: str, log: Callable[[str], None]) -> tuple[Path, Path]:
    """(the directory llama_cpp loads for path `value`, the variant module built, which that directory
    holds a copy of), made in the tools cache on first use, one host at a time (a lock on the tree).
    Only the path's variant compiles (ggml's `ggml` target would compile all)."""
    from common.files import locked

    root, jobs = source(), str(os.cpu_count() or 2)
    variant = VARIANTS[value][0]
    var_dir = root / f"build-variants-{_key(VARIANT_ARGS)}"
    module = var_dir / "bin" / f"libggml-cpu-{variant}.so"
    with locked(root):
        if not module.is_file():
            log(f"building llama.cpp's {variant} CPU backend into {var_dir} (once a variant; a minute or two)")
            if not (var_dir / "CMakeCache.txt").is_file():
                _cmake(["-S", str(root), "-B", str(var_dir), *VARIANT_ARGS], variant, var_dir)
            _cmake(["--build", str(var_dir), "--target", f"ggml-cpu-{variant}", "-j", jobs], variant, var_dir)
        return _assembled(root, module), module


def _package_libs() -> Path:
    """The installed llama-cpp-python's library directory, found without importing it (an import
    loads its libllama)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python is not installed")
    return Path(spec.origin).parent / "lib"


def _assembled(root: Path, module: Path) -> Path:
    """A directory of the package's libraries with `module` under every name of its libggml-cpu,
    keyed by every file's size and time: a rebuilt package or variant gets a directory of its own."""
    package = _package_libs()
    libs = sorted(p for p in package.iterdir() if p.name.startswith(("libllama.", "libggml")))
    if not any(p.name.startswith(CPU_LIB + ".") for p in libs):
        raise RuntimeError(
            f"llama-cpp-python's libraries in {package} have no {CPU_LIB} of their own (a build with "
            "ggml's CPU backend inside libggml, or loaded at run time): no variant can take its place"
        )
    stamp = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in [*libs, module]]
    out = root / "paths" / f"{module.stem}-{_key(stamp)}"
    if (out / "libllama.so").is_file():
        return out
    for old in out.parent.glob(f"{module.stem}-*"):  # a partial one, or a day-old one of an earlier build
        if not (old / "libllama.so").is_file() or time.time() - old.stat().st_mtime > STALE_S:
            shutil.rmtree(old)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True)
    for p in libs:  # copies: the loader finds each library's NEEDED ones beside it ($ORIGIN)
        shutil.copy2(module if p.name.startswith(CPU_LIB + ".") else p, tmp / p.name)
    tmp.rename(out)
    return out


def ran(lc, value: str, module: str) -> dict[str, Any]:
    """What this host's llama.cpp runs: the variant loaded and the CPU backend's features; raises
    where they are not the path's."""
    variant, on, off = VARIANTS[value]
    info = lc.llama_print_system_info().decode(errors="replace")
    feats = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in info.split("|")) if _}
    missing = [f for f in on if feats.get(f) != "1"] + [f for f in off if feats.get(f) == "1"]
    if missing:
        raise RuntimeError(f"cpu_path {value}: llama.cpp's CPU backend is not {variant} ({info.strip()})")
    info = info.strip()
    return {"cpu_path": value, "ggml_cpu_variant": variant, "ggml_cpu_module": module, "ggml_cpu_features": info}


def check_score(lib: str, value: str) -> None:
    """ggml's own score of the path's variant, loaded with libllama from `lib`, for this CPU: 0 where
    the CPU lacks one of the variant's instructions (its kernels would stop the process)."""
    cpu = ctypes.CDLL(str(Path(lib) / f"{CPU_LIB}.so.0"))
    cpu.ggml_backend_score.restype = ctypes.c_int
    if cpu.ggml_backend_score() == 0:
        variant = VARIANTS[value][0]
        raise RuntimeError(f"cpu_path {value}: this CPU cannot run ggml's {variant} CPU backend (ggml's score is 0)")


def _key(parts: list[str]) -> str:
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:10]
