"""The llama.cpp engine's CPU code paths (`options: {cpu_path: ...}`, common/cpu_paths.py): llama.cpp
builds its CPU backend once per instruction set when ggml loads its backends at run time
(GGML_BACKEND_DL with GGML_CPU_ALL_VARIANTS: x64, haswell, skylakex, cooperlake, ...), and
ggml_backend_load(path) loads a chosen one, before the first backend initialisation.

The package's own library has its CPU backend built in, so a cell on a path runs a second build of
the same vendor/llama.cpp, made on first use into the tools cache (never by `make venv`): libllama
with ggml's backends loaded at run time (llama-cpp-python loads it from LLAMA_CPP_LIB_PATH), and the
path's CPU backend alone (a build of every variant would compile each one). The host sets both
before llama_cpp is imported, loads the variant, and reads back what runs: the CPU backend's
features, as llama_print_system_info() lists them, must be the variant's (a variant the CPU cannot
run is refused by ggml's own score, and said).

AMX stays off (scripts/llama_cmake_args.py): its matmul crashes on some Xeons
(ggml-org/llama.cpp#20824), so cpu_path amx is refused on llama.cpp with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
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
LIB_ARGS = [*COMMON, "-DGGML_CPU=OFF"]  # libllama's tree: no CPU backend of its own (a variant's is loaded)
VARIANT_ARGS = [*COMMON, "-DGGML_CPU_ALL_VARIANTS=ON"]
ENV_LIB = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's own: the directory it loads libllama from
ENV_VARIANT = "LOGIT_MATRIX_GGML_CPU"  # the CPU backend module this host loads


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
    """(the directory of libllama with its backends loaded at run time, the path's CPU backend
    module), built into the tools cache on first use (one host at a time: a lock on the tree): one
    tree for libllama (without a CPU backend of its own), one for the variants,
    each compiled only when a cell first asks for it (ggml's `ggml` target would compile all)."""
    from common.files import locked

    root, jobs = source(), str(os.cpu_count() or 2)
    variant = VARIANTS[value][0]
    lib_dir, var_dir = root / f"build-dl-{_key(LIB_ARGS)}", root / f"build-variants-{_key(VARIANT_ARGS)}"
    with locked(root):
        if not (lib_dir / "bin" / "libllama.so").is_file():
            log(f"building llama.cpp's libllama with backends loaded at run time into {lib_dir} (once; minutes)")
            _cmake(["-S", str(root), "-B", str(lib_dir), *LIB_ARGS], "libllama", lib_dir)
            _cmake(["--build", str(lib_dir), "--target", "llama", "-j", jobs], "libllama", lib_dir)
        module = var_dir / "bin" / f"libggml-cpu-{variant}.so"
        if not module.is_file():
            log(f"building llama.cpp's {variant} CPU backend into {var_dir} (once a variant; a minute or two)")
            if not (var_dir / "CMakeCache.txt").is_file():
                _cmake(["-S", str(root), "-B", str(var_dir), *VARIANT_ARGS], variant, var_dir)
            _cmake(["--build", str(var_dir), "--target", f"ggml-cpu-{variant}", "-j", jobs], variant, var_dir)
    return lib_dir / "bin", module


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


def load_variant(module: str) -> None:
    """ggml_backend_load(module) in this process's libggml, before any backend is initialised."""
    lib = ctypes.CDLL(str(Path(os.environ[ENV_LIB]) / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    if not lib.ggml_backend_load(module.encode()):
        raise RuntimeError(f"ggml could not load {module}: this CPU cannot run it, or it is no CPU backend")


def _key(parts: list[str]) -> str:
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:10]
