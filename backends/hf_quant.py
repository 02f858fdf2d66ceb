"""Weights quantised at load by a library with CPU kernels here: HF cells of dtype int8 / int4.

    int8  torchao Int8WeightOnlyConfig (per-channel symmetric)      the default for int8
          optimum-quanto qint8 weights (per-channel)                `quantizer: quanto`
    int4  optimum-quanto qint4 weights (group 64)                   the default for int4
          torchao Int4WeightOnlyConfig                              `quantizer: torchao`: GPU only

torchao 0.18 keeps int4 weight-only packings for CUDA / XPU kernels only (plain, plain_int32 and
tile_packed_to_4d all fail to convert on CPU here), so a CPU int4 cell defaults to quanto and a
torchao int4 cell on CPU is skipped with that reason. Activations stay fp32: the rows measure
the weights' quantisation, not a bf16 kernel. Both are round-to-nearest from the reference
weights, with no calibration data.
"""

from __future__ import annotations

from typing import Any

DTYPES = ("int8", "int4")
QUANTIZERS = ("torchao", "quanto")
DEFAULT = {"int8": "torchao", "int4": "quanto"}
REQUIRES = {"torchao": "torchao", "quanto": "optimum.quanto"}


def quantizer(dtype: str, opts: dict) -> str:
    return opts.get("quantizer") or DEFAULT[dtype]


def unsupported(dtype: str, opts: dict, device: str) -> str | None:
    import importlib.util

    q = quantizer(dtype, opts)
    try:
        found = importlib.util.find_spec(REQUIRES[q]) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        found = False
    if not found:
        return f"dtype {dtype} with quantizer {q} needs the Python package {REQUIRES[q].split('.')[-1]}, not installed"
    if q == "torchao" and dtype == "int4" and device == "cpu":
        return (
            "torchao has no CPU kernel for int4 weight-only (its packings are for CUDA / XPU); "
            "use quantizer: quanto on CPU"
        )
    return None


def config(dtype: str, opts: dict) -> tuple[Any, dict[str, Any]]:
    """(transformers quantization_config, the recipe recorded in cells.artifact_recipe)."""
    q = quantizer(dtype, opts)
    if q == "torchao":
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        cfg = Int8WeightOnlyConfig() if dtype == "int8" else Int4WeightOnlyConfig(group_size=128)
        return TorchAoConfig(cfg), {
            "tool": "torchao",
            "version": torchao.__version__,
            "config": repr(cfg),
            "weights": dtype,
            "activations": "fp32",
            "calibration": None,
        }
    import importlib.metadata

    from transformers import QuantoConfig

    return QuantoConfig(weights=dtype), {
        "tool": "optimum-quanto",
        "version": importlib.metadata.version("optimum-quanto"),
        "config": f"QuantoConfig(weights={dtype!r})",
        "weights": dtype,
        "activations": "fp32",
        "calibration": None,
    }
