"""TensorRT-LLM backend (LLM API): context logits for the teacher-forced ids. CUDA only.

    ids        t0   t1   t2 ... t(n-1)      one request, max_tokens=1
    context    row 0 .. row n-1             return_context_logits=True -> (n, vocab)
    kept       rows at the sampled positions (row p scores t(p+1))

KV-cache block reuse is off for captures: with reuse on, a request sharing a prefix with an
earlier one gets context logits only for the recomputed suffix. The TensorRT engine path
(backend="tensorrt") also needs gather_context_logits in its build config; both the LLM
arguments and the build parameters are recorded in cells.settings.

The pure parts (arguments, slicing, recording) are module functions tested on CPU; load() and
forward() need tensorrt_llm and a GPU (tests marked gpu).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.base import Backend
from common.stack import StackDesc

TRT_DTYPES = {"bf16": "bfloat16", "f16": "float16", "fp32": "float32", "fp8": "bfloat16", "nvfp4": "bfloat16"}
QUANT_ALGOS = {"fp8": "FP8", "nvfp4": "NVFP4"}  # tensorrt_llm.llmapi.QuantAlgo members
ATTN_BACKENDS = {"default": "TRTLLM", "flashinfer": "FLASHINFER", "eager": "VANILLA"}  # PyTorch-backend attn_backend


def llm_kwargs(stack: StackDesc, model_dir: str, max_seq_len: int) -> dict[str, Any]:
    """Arguments for tensorrt_llm.LLM, as plain data (recorded verbatim in the cell's settings)."""
    engine_backend = stack.opts.get("trt_backend", "pytorch")
    kw: dict[str, Any] = {
        "model": model_dir,
        "backend": engine_backend,
        "dtype": TRT_DTYPES[stack.dtype],
        "tensor_parallel_size": stack.tp,
        "max_batch_size": 1,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_seq_len,
        "kv_cache_config": {"enable_block_reuse": False},  # reuse would drop the shared prefix's logits
        "enable_chunked_prefill": False,  # one prefill per prompt: chunking changes the arithmetic
    }
    if stack.dtype in QUANT_ALGOS:
        kw["quant_config"] = {"quant_algo": QUANT_ALGOS[stack.dtype]}
    if engine_backend == "tensorrt":
        kw["build_config"] = {
            "gather_context_logits": True,
            "max_seq_len": max_seq_len,
            "max_batch_size": 1,
            "max_num_tokens": max_seq_len,
        }
    else:
        kw["attn_backend"] = ATTN_BACKENDS[stack.attention]
    return kw


def sampling_kwargs() -> dict[str, Any]:
    """One generated token is the minimum; only the context logits are kept."""
    return {"max_tokens": 1, "return_context_logits": True, "temperature": 0.0, "detokenize": False}


def slice_context(context: np.ndarray, n_tokens: int, positions: list[int]) -> np.ndarray:
    """(n_tokens, vocab) context logits -> (len(positions), vocab) rows at the sampled positions."""
    if context.ndim != 2 or context.shape[0] != n_tokens:
        raise ValueError(
            f"context logits of shape {context.shape} for {n_tokens} prompt tokens: "
            "was KV-cache block reuse on, or gather_context_logits off?"
        )
    return np.ascontiguousarray(context[positions])


def native_rows(rows_torch) -> np.ndarray:
    """A torch tensor of logits -> numpy in the native dtype the warehouse stores (bf16 as uint16 bits)."""
    import torch

    t = rows_torch.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.float().numpy() if t.dtype != torch.float32 else t.numpy()


class TrtllmBackend(Backend):
    engine = "trtllm"
    dtypes = frozenset(TRT_DTYPES)
    attention = frozenset(ATTN_BACKENDS)
    devices = frozenset({"cuda", "h100", "h200", "b200", "sm120"})
    max_tp = 8
    options = frozenset({"trt_backend"})  # pytorch (default) | tensorrt (engine build)
    option_docs = {"trt_backend": ({"enum": ["pytorch", "tensorrt"]}, "TensorRT-LLM's backend")}
    libraries = ("tensorrt_llm", "torch")
    requires = "tensorrt_llm"

    MAX_SEQ_LEN = 8192

    def load(self) -> None:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import BuildConfig, KvCacheConfig, QuantAlgo, QuantConfig

        self._kw = llm_kwargs(self.stack, self.model_dir, self.MAX_SEQ_LEN)
        kw = dict(self._kw)
        kw["kv_cache_config"] = KvCacheConfig(**kw["kv_cache_config"])
        if "build_config" in kw:
            kw["build_config"] = BuildConfig(**kw["build_config"])
        if "quant_config" in kw:
            kw["quant_config"] = QuantConfig(quant_algo=getattr(QuantAlgo, kw["quant_config"]["quant_algo"]))
        self._llm = LLM(**kw)
        self._sp = SamplingParams(**sampling_kwargs())
        self._version = tensorrt_llm.__version__
        self._vocab = int(self._llm.tokenizer.vocab_size) if self._llm.tokenizer else None

    def vocab_size(self) -> int:
        return self._vocab

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        out = self._llm.generate([token_ids], self._sp)[0]
        ctx = native_rows(out.context_logits)  # (n_tokens, vocab)
        return slice_context(ctx, len(token_ids), positions)

    def settings(self) -> dict[str, Any]:
        import torch

        return {
            "dtype": self.stack.dtype,
            "attention": self.stack.attention,
            "llm_args": self._kw,
            "sampling": sampling_kwargs(),
            "gpu": torch.cuda.get_device_name(0),
            "versions": {"tensorrt_llm": self._version, "torch": torch.__version__},
        }

    def close(self) -> None:
        self._llm.shutdown()
