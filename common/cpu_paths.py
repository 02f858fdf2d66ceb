"""CPU code paths a cell may ask for (`options: {cpu_path: avx2}`): the kernels an AVX2-only, an
AVX-512 or an AMX server would run, chosen on one machine through each library's own switch, so
that drift between kinds of CPU can be measured on whichever CPU is at hand.

    native        what the libraries pick for this CPU (no switch set; the partner of the others)
    scalar        torch's scalar kernels (ATEN_CPU_CAPABILITY=default), oneDNN at SSE4.1
    avx2          torch's AVX2 kernels, oneDNN at AVX2 (it then runs no bf16 primitive: torch's own)
    avx512        torch's AVX-512 kernels, oneDNN at AVX-512 without native bf16 (AVX512_CORE)
    avx512_bf16   the same with AVX-512 bf16 instructions (AVX512_CORE_BF16)
    amx           oneDNN with AMX tiles (AVX512_CORE_AMX)

Each library reads its switch once, when it loads: ATEN_CPU_CAPABILITY (torch's dispatch,
aten/src/ATen/native/DispatchStub.cpp), ONEDNN_MAX_CPU_ISA (oneDNN's dispatcher, its docs'
"CPU dispatcher control"), MKL_ENABLE_INSTRUCTIONS (oneMKL's "Instruction Set Specific Dispatching").
A value a library does not know, or a level above what the CPU has, silently runs its default, so
what ran is read back in the process that ran it (torch.backends.cpu.get_cpu_capability(), oneDNN's
verbose isa line) and compared with the path's `capability` and `isa` before a row is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

NATIVE = "native"
OFFERED = "offered"  # in a spec: every path this CPU can run, native first


@dataclass(frozen=True)
class CpuPath:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags the path executes
    aten: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA
    mkl: str  # MKL_ENABLE_INSTRUCTIONS
    capability: str  # what torch.backends.cpu.get_cpu_capability() then says
    # what oneDNN's verbose isa line must hold for a bf16 linear (None: oneDNN runs no bf16
    # primitive at this level, torch's own kernel does; "AMX" in it is refused unless named here)
    isa: str | None

    def env(self) -> dict[str, str]:
        return {
            "ATEN_CPU_CAPABILITY": self.aten,
            "ONEDNN_MAX_CPU_ISA": self.onednn,
            "MKL_ENABLE_INSTRUCTIONS": self.mkl,
        }


_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
PATHS: dict[str, CpuPath] = {
    p.name: p
    for p in (
        CpuPath("scalar", (), "default", "SSE41", "SSE4_2", "DEFAULT", None),
        CpuPath("avx2", ("avx2", "fma"), "avx2", "AVX2", "AVX2", "AVX2", None),
        CpuPath("avx512", _AVX512, "avx512", "AVX512_CORE", "AVX512", "AVX512", "AVX512BW, AVX512VL, and AVX512DQ"),
        CpuPath(
            "avx512_bf16", (*_AVX512, "avx512_bf16"), "avx512", "AVX512_CORE_BF16", "AVX512_E3", "AVX512", "bfloat16"
        ),
        CpuPath("amx", (*_AVX512, "amx_tile", "amx_bf16"), "avx512", "AVX512_CORE_AMX", "AVX512_E4", "AVX512", "AMX"),
    )
}
NAMES = (NATIVE, *PATHS)
ENV_KEYS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags as /proc/cpuinfo lists them (empty where it has none: not Linux)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("flags", "Features"):
            return frozenset(v.split())
    return frozenset()


def lacks(name: str, flags: frozenset[str]) -> tuple[str, ...]:
    """The flags path `name` needs that `flags` lacks (none for native)."""
    path = PATHS.get(name)
    return tuple(f for f in path.needs if f not in flags) if path else ()


def offered(flags: frozenset[str]) -> list[str]:
    """Every path a CPU of these flags runs, native first."""
    return [NATIVE] + [n for n in PATHS if not lacks(n, flags)]


def mismatch(name: str, capability: str | None, isa: str | None) -> str | None:
    """Why what ran (torch's capability, oneDNN's isa line or None) is not path `name` (None: it is)."""
    path = PATHS.get(name)
    if path is None:
        return None
    if capability != path.capability:
        return f"torch ran its {capability} kernels, not {path.capability}"
    if path.isa is None and isa is not None:
        return f"oneDNN ran a bf16 linear at {isa!r}, where {name} runs none"
    if path.isa is not None and (isa is None or path.isa not in isa or ("AMX" in isa and "AMX" not in path.isa)):
        return f"oneDNN ran a bf16 linear at {isa!r}, not {path.onednn}"
    return None
