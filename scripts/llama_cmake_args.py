"""CMake arguments that build llama.cpp (llama-cpp-python, and the llama.cpp tools the benchmarks
compare with) for the CPU of this machine: every x86 instruction set it has, AMX excepted.

    python3 scripts/llama_cmake_args.py      # prints one line for CMAKE_ARGS

AMX stays off: with AMX compiled in, llama.cpp repacks quantised weights into its AMX buffer type,
and `ggml_backend_amx_mul_mat` segfaults on some AMX Xeons (ggml-org/llama.cpp#20824; the same
crash made stanfordnlp/dspy#10079 drop its AMX build). The ISA is spelled out flag by flag rather
than with -march=native (GGML_NATIVE), which would turn AMX on wherever the CPU has it.
Off x86-64 Linux, llama.cpp's own default (GGML_NATIVE) applies. Standard library only: the
Makefile runs it before the venv exists.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

COMMON = ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
# GGML option -> the /proc/cpuinfo flags it needs (ggml/src/ggml-cpu/CMakeLists.txt maps each
# option to its -m flags; GGML_AVX512 means -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw)
X86 = {
    "GGML_SSE42": ["sse4_2"],
    "GGML_AVX": ["avx"],
    "GGML_AVX2": ["avx2"],
    "GGML_FMA": ["fma"],
    "GGML_F16C": ["f16c"],
    "GGML_BMI2": ["bmi2"],
    "GGML_AVX_VNNI": ["avx_vnni"],
    "GGML_AVX512": ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
    "GGML_AVX512_VBMI": ["avx512vbmi"],
    "GGML_AVX512_VNNI": ["avx512_vnni"],
    "GGML_AVX512_BF16": ["avx512_bf16"],
}
NEVER = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(machine: str, cpuinfo: str | None) -> list[str]:
    if machine not in ("x86_64", "AMD64") or cpuinfo is None:
        return ["-DGGML_NATIVE=ON", *COMMON]
    have = cpu_flags(cpuinfo)
    isa = [f"-D{opt}={'ON' if all(f in have for f in need) else 'OFF'}" for opt, need in X86.items()]
    return ["-DGGML_NATIVE=OFF", *isa, *[f"-D{opt}=OFF" for opt in NEVER], *COMMON]


def main() -> int:
    info = Path("/proc/cpuinfo")
    print(" ".join(cmake_args(platform.machine(), info.read_text() if info.is_file() else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
