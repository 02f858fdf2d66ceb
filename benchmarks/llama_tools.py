"""llama.cpp's own command-line tools, built once into the cache from the vendor/llama.cpp of the
installed llama-cpp-python's sdist with the CMake flags that binding was built with (the Makefile
records them in the venv; scripts/llama_cmake_args.py otherwise), for the benchmarks that compare
logit-matrix with them. A later tool reuses the same build tree, so only its own sources compile
(seconds); the first one costs ~12-35 min on 2 cores."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def binding_flags() -> list[str]:
    """The CMake flags the installed llama-cpp-python was built with (the Makefile writes them to
    VENV/.llama-cmake-args), else the ones the Makefile would use on this machine."""
    recorded = Path(sys.prefix) / ".llama-cmake-args"
    if recorded.is_file():  # the flags, then the version pin the Makefile built
        return [f for f in shlex.split(recorded.read_text()) if f.startswith("-")]
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "llama_cmake_args.py")], check=True, capture_output=True, text=True
    ).stdout
    return shlex.split(out)


def source_tree() -> Path:
    """The installed llama-cpp-python's vendor/llama.cpp in the tools cache (the engine's own)."""
    from backends.llamacpp_cpu_path import source

    return source()


def build_tool(target: str, log) -> Path:
    """bin/<target> (llama-perplexity, llama-imatrix, llama-quantize), built if missing."""
    root = source_tree()
    # the package's own CMake include turns llama.cpp's common library off, which every tool links;
    # its LLAVA_BUILD (the package's multimodal library) is no tool's
    skip = ("-DLLAMA_BUILD_TESTS", "-DLLAMA_BUILD_EXAMPLES", "-DCMAKE_PROJECT_llama.cpp_INCLUDE", "-DLLAVA_BUILD")
    flags = [f for f in binding_flags() if not f.startswith(skip)]
    build = root / f"build-{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:10]}"  # a tree per flag set
    binary = build / "bin" / target
    if binary.is_file():
        return binary
    if not (build / "CMakeCache.txt").is_file():
        log(
            f"configuring llama.cpp from {root.name} with {' '.join(flags)} (the first tool build takes ~12-35 min "
            "on 2 cores)"
        )
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            [
                "cmake",
                "-S",
                str(root),
                "-B",
                str(build),
                *gen,
                *flags,
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DCMAKE_BUILD_TYPE=Release",
            ],
            check=True,
            capture_output=True,
        )
    log(f"building {target}")
    subprocess.run(
        ["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)],
        check=True,
        capture_output=True,
    )
    return binary


def tool_env(binary: Path) -> dict:
    """The environment a tool runs in: its own build's shared libraries first, where it has them."""
    return {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}
