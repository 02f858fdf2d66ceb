"""MLX backend (mlx + mlx-lm; `mlx[cpu]` on Linux, Metal on Apple Silicon).

The model is called directly on the whole id sequence (mlx-lm's generate keeps
only the last position), then the sampled rows are taken:

    logits = model(ids[None])   # (1, T, vocab), in the activations' dtype
    rows   = logits[0, positions]  # (rows, vocab); row p predicts t(p+1)

A quantised model's activations are bf16 (its scales, biases and norms are). mlx's CPU quantised
matmul (`_qmm_t`, mlx/backend/cpu/quantized.cpp; Linux has no Accelerate path) sums in the
activation dtype: in bf16 its relative error is ~3e-2 against the same product summed in fp32,
so a q8 stack measures that kernel more than its quantisation (KL 0.1 where llama.cpp Q8_0 gives
3e-3). `activations: fp32` keeps the quantised weights and casts everything else to fp32; every
quantised cell records what the kernel does on its device (settings.quantized_matmul).
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Backend, check_layers
from common.errors import OracleError, UserError

# dtype -> (weights dtype for mlx_lm.convert, quantisation bits or None). Group size 64, affine.
MLX_DTYPES = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "f16": ("float16", None),
    "q8_g64": ("bfloat16", 8),
    "q4_g64": ("bfloat16", 4),
}
GROUP_SIZE = 64
QMM_TOLERANCE = 1e-2  # above this, the quantised matmul is not summing in fp32 (fp32 gives 0, bf16 ~3e-2)


def qmm_probe(mx, dtype, bits: int) -> dict[str, Any]:
    """What the device's quantised matmul does with `dtype` activations: its relative error against
    the same quantised weights dequantised and multiplied in fp32 (K = 576, SmolLM2's width)."""
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((256, 576)).astype(np.float32) * 0.05)
    x = mx.array(rng.standard_normal((4, 576)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
    s, b = s.astype(dtype), b.astype(dtype)
    got = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP_SIZE, bits=bits).astype(mx.float32)
    want = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=GROUP_SIZE, bits=bits).astype(mx.float32).T
    err = float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))
    return {
        "activation_dtype": str(dtype).split(".")[-1],
        "device": str(mx.default_device()),
        "rel_err": err,
        "sums_in": "float32" if err <= QMM_TOLERANCE else "the activation dtype",
    }


def fix_rope_theta(config_path: Path) -> float | None:
    """mlx-lm reads a top-level rope_theta; transformers 5 writes rope_parameters.rope_theta.

    Without the key mlx-lm silently uses 10000 and every logit is wrong. Returns the value set.
    """
    cfg = json.loads(config_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in cfg and theta is not None:
        cfg["rope_theta"] = theta
        config_path.write_text(json.dumps(cfg, indent=1))
        return theta
    return None


def convert(hf_dir: str, weights_sha256: str | None, dtype: str) -> dict[str, Any]:
    import mlx_lm

    from backends.artifacts import content_key, ensure

    wdtype, bits = MLX_DTYPES[dtype]
    recipe = {
        "tool": "mlx_lm.convert",
        "mlx_lm": mlx_lm.__version__,
        "source": hf_dir,
        "source_weights_sha256": weights_sha256,
        "dtype": wdtype,
        "q_bits": bits,
        "q_group_size": GROUP_SIZE if bits else None,
        "q_mode": "affine" if bits else None,
        "rope_theta_fix": True,
    }

    def build(tmp: Path) -> None:
        from mlx_lm import convert as mlx_convert

        try:
            mlx_convert(
                hf_dir,
                str(tmp),
                quantize=bits is not None,
                q_bits=bits,
                q_group_size=GROUP_SIZE if bits else None,
                dtype=wdtype,
            )
        except (ValueError, KeyError, ImportError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"{hf_dir}: mlx_lm cannot convert this model: {str(e).splitlines()[0]}") from None
        fix_rope_theta(tmp / "config.json")

    return ensure("mlx", f"mlx-{dtype}", recipe, build, content_key(hf_dir, weights_sha256))


class MLXBackend(Backend):
    engine = "mlx"
    dtypes = frozenset(MLX_DTYPES)
    attention = frozenset({"default"})
    libraries = ("mlx", "mlx-metal", "mlx-cpu", "mlx-lm")  # mlx-metal on a Mac, mlx-cpu on Linux
    devices = frozenset({"cpu", "apple-m1", "apple-m2", "apple-m3", "apple-m4", "mps"})
    options = frozenset({"activations"})
    option_docs = {"activations": ({"enum": ["native", "fp32"]}, "MLX: compute in float32 around quantised weights")}
    requires = "mlx_lm"

    @classmethod
    def state_bytes(cls, cell) -> int:
        return 4 if cell.opts.get("activations") == "fp32" else super().state_bytes(cell)

    def load(self) -> None:
        import mlx.core as mx
        from mlx_lm import load

        self._mx = mx
        if self.stack.device == "cpu":
            mx.set_default_device(mx.cpu)
        self.artifact = convert(self.model_dir, self.stack.weights_sha256, self.stack.dtype)
        self.model, self.tokenizer = load(self.artifact["path"])
        self.activations = self.stack.opts.get("activations", "native")
        if self.activations == "fp32":  # floating parameters only: the packed quantised weights stay as they are
            self.model.set_dtype(mx.float32)
        self._check_rope()
        cfg = json.loads((Path(self.artifact["path"]) / "config.json").read_text())
        self._vocab = int(cfg["vocab_size"])

    def _check_rope(self) -> None:
        """The loaded model must use the checkpoint's rope base (see fix_rope_theta)."""
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        want = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        got = getattr(getattr(self.model, "args", None), "rope_theta", None)
        if want is not None and got is not None and float(got) != float(want):
            raise OracleError(
                f"{self.artifact['path']}: mlx-lm loaded rope_theta={got}, the checkpoint "
                f"says {want}; refusing to run (logits would be silently wrong)"
            )

    def vocab_size(self) -> int:
        return self._vocab

    def settings(self) -> dict[str, Any]:
        import mlx.core as mx
        import mlx_lm

        batch = self.stack.extra("batch")
        return {
            "dtype": self.stack.dtype,
            "weights_dtype": MLX_DTYPES[self.stack.dtype][0],
            "q_bits": MLX_DTYPES[self.stack.dtype][1],
            "q_group_size": GROUP_SIZE,
            "device": str(mx.default_device()),
            "rope_theta": getattr(self.model.args, "rope_theta", None),
            "threads": self.threads,
            "machine": platform.machine(),
            "artifact": self.artifact,
            "activations": self.activations,
            "quantized_matmul": self._qmm(),
            "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__},
            "embed_scale": self._embed_scale(),
            "batch_size": 1 if batch is None else batch.size,
            **({} if batch is None else {"padding_side": "right", "mask": "causal (mlx-lm's own)"}),
        }

    def _embed_scale(self) -> float | None:
        """mlx-lm's Gemma models scale the embeddings by sqrt(hidden) rounded to bf16 in every dtype
        (mlx_lm/models/gemma3_text.py): 25.25 for Gemma 3 270M, where HF fp32 and llama.cpp use 25.2982."""
        args = self.model.args
        if not str(getattr(args, "model_type", "")).startswith("gemma"):
            return None
        mx = self._mx
        return float(mx.array(args.hidden_size**0.5, mx.bfloat16).astype(mx.float32).item())

    def _qmm(self) -> dict[str, Any] | None:
        bits = MLX_DTYPES[self.stack.dtype][1]
        if bits is None:
            return None
        mx = self._mx
        dtype = mx.float32 if self.activations == "fp32" else getattr(mx, MLX_DTYPES[self.stack.dtype][0])
        return qmm_probe(mx, dtype, bits)

    layer_sources = {"layer": "model.layers[{i}] output (tap)", "final_norm": "model.norm output (tap)"}

    def n_layers(self) -> int:
        return len(self.model.model.layers)

    def layer_states(self, token_ids: list[int], positions: list[int], layers: list[int]) -> dict[str, np.ndarray]:
        """The model's own forward with its decoder layers and final norm wrapped in taps (mlx-lm
        models run model.model.layers in order, then model.model.norm)."""
        mx = self._mx
        inner = getattr(self.model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
            from backends.base import SkipCell

            raise SkipCell(f"mlx-lm's {type(self.model).__module__} has no model.layers / model.norm to tap")
        check_layers(layers, len(inner.layers))
        got: dict[str, Any] = {}
        saved_layers, saved_norm = list(inner.layers), inner.norm
        for i in layers:
            inner.layers[i] = _Tap(saved_layers[i], got, f"layer.{i}")
        inner.norm = _Tap(saved_norm, got, "final_norm")
        try:
            self.model(mx.array([token_ids]))
        finally:
            inner.layers[:] = saved_layers
            inner.norm = saved_norm
        keep = mx.array(positions)
        out = {}
        for name, h in got.items():
            rows = h[0, keep]  # (rows, hidden)
            mx.eval(rows)
            out[name] = np.array(rows.view(mx.uint16)) if rows.dtype == mx.bfloat16 else np.array(rows)
        return out

    def decode(self, token_ids: list[int], at: int, steps: int) -> np.ndarray:
        """mlx-lm's own prompt cache (the cache generate() uses), one token per call after the prefill."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = self._mx
        cache = make_prompt_cache(self.model)
        mx.eval(self.model(mx.array([token_ids[: at + 1]]), cache=cache))
        rows = []
        for s in range(1, steps + 1):
            logits = self.model(mx.array([[token_ids[at + s]]]), cache=cache)  # (1, 1, vocab)
            mx.eval(logits)
            rows.append(logits[0, -1])
        return self._native(mx.stack(rows))  # (steps, vocab)

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        mx = self._mx
        logits = self.model(mx.array([token_ids]))  # (1, T, vocab)
        rows = logits[0, mx.array(positions)]  # (rows, vocab)
        mx.eval(rows)
        return self._native(rows)

    def forward_batch(self, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
        """A right-padded batch through mlx-lm's own model call: without a cache it applies its causal
        mask (models/base.py create_attention_mask), under which a real token never sees the padding
        after it, so no padding mask is needed; token_ids is sequence 0."""
        mx = self._mx
        seqs = [token_ids, *others]
        width = max(map(len, seqs))
        ids = mx.array([s + [0] * (width - len(s)) for s in seqs])  # (batch, T); pad id 0, never attended
        logits = self.model(ids)  # (batch, T, vocab)
        rows = logits[0, mx.array(positions)]  # (rows, vocab)
        mx.eval(rows)
        return self._native(rows)

    def _native(self, rows) -> np.ndarray:
        mx = self._mx
        if rows.dtype == mx.bfloat16:
            return np.array(rows.view(mx.uint16))  # raw bf16 bits
        if rows.dtype == mx.float16:
            return np.array(rows).astype(np.float16, copy=False)
        return np.array(rows.astype(mx.float32))

    def tokenize(self, text: str) -> list[int]:
        """mlx-lm's tokenizer wrapper, default call (special tokens as its HF tokenizer adds them)."""
        return list(self.tokenizer.encode(text))

    def special_tokens(self) -> dict[str, Any]:
        t = self.tokenizer
        return {
            "bos": t.bos_token_id,
            "eos": t.eos_token_id,
            "add_bos": bool(getattr(t._tokenizer, "add_bos_token", False)),
        }


class _Tap:
    """A module stand-in that runs the module and keeps its output (attributes read through)."""

    def __init__(self, inner, sink: dict, name: str):
        self.inner, self.sink, self.name = inner, sink, name

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def __call__(self, *args, **kw):
        out = self.inner(*args, **kw)
        self.sink[self.name] = out[0] if isinstance(out, tuple) else out  # (1, T, hidden)
        return out
