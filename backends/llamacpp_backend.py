"""llama.cpp backend (llama-cpp-python, low-level API).

One teacher-forced evaluation of the canonical ids per prompt, in a fresh
context (no prompt-cache reuse: reusing a cached prefix changes the
arithmetic, ggml-org/llama.cpp#2838). Only the sampled positions ask for logits, so the LM
head runs on those rows alone:

    ids       t0  t1 ... t31 | t32 ... (chunks of n_batch; llama.cpp splits each into n_ubatch)
    logits[]   1   0 ...  0  |  1  ...  1 at the last position
    row p  -> distribution over t(p+1), float32 (llama.cpp's output type for every weight type)
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Any

import numpy as np

from backends import llamacpp_cpu_path
from backends.base import GGUF, Backend, OutputRing, block_rows, check_layers
from backends.gguf_build import FLOAT_TYPES, QUANT_TYPES
from backends.llama_binding import extra_bufts, gguf_tokenize, load_vocab, quiet_logs, tokenize_with  # noqa: F401 (re-exported)
from backends.llamacpp_contexts import Lanes, LlamaContexts
from common import kv_cache

# sequences one context holds at most: LLAMA_MAX_SEQ of the llama.cpp llama-cpp-python 0.3 vendors
MAX_SEQ = 256
DEFAULTS = {"n_batch": 2048, "n_ubatch": 512, "kv_cache": kv_cache.DEFAULT}  # llama.cpp's own defaults
# prompts a CPU capture runs at once, the threads split between them (backends/llamacpp_contexts.py
# Lanes): at most 2, the number measured (on 2 threads). LANES_ENV sets fewer (a benchmark's
# comparison: 1 runs one prompt after the other on every thread).
LANES = 2
LANES_ENV = "LOGIT_MATRIX_LANES"


def _lanes(threads: int, device: str) -> int:
    """How many lanes a loaded model gets: LANES (or LANES_ENV's fewer), never more than threads;
    1 off the CPU, where what the lanes save (threads waiting at every graph node) was not measured."""
    raw = os.environ.get(LANES_ENV)
    if raw is not None and not (raw.strip().isdigit() and int(raw) >= 1):
        from common.errors import UserError

        raise UserError(f"{LANES_ENV}={raw!r}: a whole number of lanes, 1 or more")
    if device != "cpu":
        return 1
    return min(LANES, threads, int(raw) if raw is not None else LANES)


def _wait_policy() -> str:
    """What llama.cpp's OpenMP threads do while they wait, made passive where the user has not
    chosen and it still can be: a capture writes rows on a thread of its own beside each forward,
    and a thread spinning at a barrier holds the core that writing needs (docs/benchmark-notes.md).
    libgomp reads OMP_WAIT_POLICY once, when llama_cpp first loads it: a process that loaded it
    before keeps libgomp's default."""
    import sys

    if os.environ.get("OMP_WAIT_POLICY"):
        return os.environ["OMP_WAIT_POLICY"].lower()
    if "llama_cpp" in sys.modules:
        return "libgomp default"
    os.environ["OMP_WAIT_POLICY"] = "passive"
    return "passive"


def _kv_refused(attention: str, kv: kv_cache.KVCache) -> str | None:
    """Why llama.cpp cannot run this KV cache under this attention (None: it can)."""
    v = kv.quantised_v
    if v and attention == "eager":  # src/llama-context.cpp: "quantized V cache requires flash_attn"
        return f"a quantised V cache ({v}) requires flash attention in llama.cpp, and attention eager turns it off"
    return None


class LlamaCppBackend(LlamaContexts, Backend):
    engine = "llamacpp"
    dtypes = frozenset(FLOAT_TYPES) | frozenset(QUANT_TYPES)
    attention = frozenset({"default", "flash_attn", "eager"})  # eager = flash attention off
    devices = frozenset(
        {
            "cpu",
            "cuda",
            "h100",
            "h200",
            "b200",
            "sm120",
            "mi300x",
            "rocm",
            "apple-m1",
            "apple-m2",
            "apple-m3",
            "apple-m4",
            "mps",
        }
    )
    options = frozenset({"kv_cache", "n_batch", "n_ubatch", "imatrix", "cpu_path"})
    option_docs = {
        "n_batch": ({"type": "integer", "minimum": 1}, "llama.cpp's logical batch size"),
        "n_ubatch": ({"type": "integer", "minimum": 1}, "llama.cpp's physical batch size"),
    }
    libraries = ("llama_cpp_python", "gguf")  # gguf-py writes the converted and quantised files
    requires = "llama_cpp"
    runs_files = frozenset({GGUF})
    default_for = frozenset({GGUF})
    wait_policy: str | None = None  # what its OpenMP threads do while they wait (_wait_policy), from load()

    @classmethod
    def max_batch(cls, device: str) -> tuple[int, str]:
        return MAX_SEQ, "LLAMA_MAX_SEQ in llama.cpp's src/llama-cparams.h"

    @classmethod
    def state_bytes(cls, cell) -> int:
        return 4  # its graph's hidden states are float32 whatever the weights' type

    @classmethod
    def unsupported(cls, cell) -> str | None:
        if "imatrix" in cell.opts and (cell.dtype not in QUANT_TYPES or getattr(cell, "artifact", None)):
            return f"an imatrix weights llama.cpp's quantiser, and this cell quantises nothing ({cell.dtype})"
        return _kv_refused(cell.attention, kv_cache.KVCache.of(cell.opts.get("kv_cache"))) or super().unsupported(cell)

    def load(self) -> None:
        self.wait_policy = _wait_policy()
        self._cpu_module = self._cpu_path_build()
        import llama_cpp

        from backends import gguf_build

        if self._cpu_module:  # the path's CPU backend runs this CPU, checked before any backend initialises
            llamacpp_cpu_path.check_score(os.environ[llamacpp_cpu_path.ENV_LIB], self.stack.opts["cpu_path"])

        self._lc = lc = llama_cpp
        opts = {**DEFAULTS, **(self.stack.opts)}
        self.n_batch, self.n_ubatch = opts["n_batch"], opts["n_ubatch"]
        self.kv_cache = kv_cache.KVCache.of(opts["kv_cache"])
        st = self.stack
        if st.artifact:  # a candidate: the published file as it is
            self.artifact = gguf_build.published(st.artifact, st.artifact_sha256, st.artifact_source)
        else:
            self.artifact = gguf_build.build_for(
                st.dtype,
                self.model_dir,
                st.weights_sha256,
                self.threads,
                original=st.source_gguf,
                original_quant=st.source_quant,
                imatrix=self._imatrix(),
            )
        quiet_logs()
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0 if self.stack.device == "cpu" else 999
        self.extra_bufts = extra_bufts()  # repack yes, AMX no
        if "OPENMP = 1" not in lc.llama_print_system_info().decode(errors="replace"):
            self.wait_policy = "none: this build has no OpenMP"
        mp.use_extra_bufts = self.extra_bufts
        self.model = lc.llama_model_load_from_file(self.artifact["path"].encode(), mp)
        if not self.model:
            from common.errors import UserError

            raise UserError(f"{self.artifact['path']}: llama.cpp could not load this GGUF")
        self._lanes = Lanes(self.threads, _lanes(self.threads, self.stack.device))
        self._check_kv_cache()
        self.vocab = lc.llama_model_get_vocab(self.model)
        self._n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        # the size for the KL-against-size frontier (analysis/frontier.py), from the same header read
        self.tensor_types, self.size = gguf_build.tensor_layout(self.artifact["path"])

    def _check_kv_cache(self) -> None:
        """A KV cache other than llama.cpp's default, tried on a small context: llama.cpp refuses a
        quantised type whose block does not divide the head size, and K and V types that differ on
        an MLA model (src/llama-context.cpp llama_init_from_model), a property of the model: a skip."""
        if self.kv_cache.is_default:
            return
        from backends.base import SkipCell

        try:
            ctx, _ = self._context(8)
        except RuntimeError:
            kv = self.kv_cache
            raise SkipCell(
                _kv_refused(self.stack.attention, kv)
                or f"llama.cpp creates no context with a KV cache of K {kv.k}, V {kv.v} for this model (a block "
                "size that does not divide its head size, or K and V types that differ on an MLA model)"
            ) from None
        self._lc.llama_free(ctx)

    def keep_outputs(self, n: int) -> None:
        for lane in self._lanes.every():
            lane.outputs = OutputRing(n)

    def lanes(self) -> int:
        return max(1, len(self._lanes.split))

    def bind_lane(self, i: int) -> None:
        self._lanes.bind(i)

    def rows_beside_forward(self) -> bool:
        # beside passive threads the rows' work is faster than between forwards; beside spinning ones
        # it is slower (docs/benchmark-notes.md)
        return super().rows_beside_forward() or self.wait_policy == "passive"

    def _imatrix(self) -> dict[str, Any] | None:
        im = self.stack.opts.get("imatrix")
        if not im:
            return None
        import hashlib

        text = self.stack.calibration_text
        if text is None or hashlib.sha256(text.encode()).hexdigest() != im["sha256"]:
            raise RuntimeError(
                f"the calibration text for {im['corpus']} did not arrive intact (want sha256 {im['sha256']})"
            )
        return {**im, "text": text}

    def vocab_size(self) -> int:
        return self._n_vocab

    @classmethod
    def cpu_path_refusal(cls, value: str) -> str | None:
        """Why llama.cpp runs no CPU code path `value` (the cpu_path plug-in skips the cell with it)."""
        return llamacpp_cpu_path.refusal(value)

    def _cpu_path_build(self) -> str | None:
        """A cell on a CPU code path: its llama.cpp libraries made (or found) in the tools cache and set
        for llama_cpp's import in this host; -> the path's CPU backend module (None: the package's own)."""
        import sys

        value = self.stack.opts.get("cpu_path")
        if not value:
            return None
        if "llama_cpp" in sys.modules:
            raise RuntimeError(f"cpu_path {value}: this host loaded llama.cpp before the path's build could be set")
        lib, module = llamacpp_cpu_path.build(value, lambda line: print(line, flush=True))
        os.environ[llamacpp_cpu_path.ENV_LIB] = str(lib)
        return str(module)

    def cpu_path_ran(self) -> dict[str, Any]:
        """The cpu_path hook: the variant this host's llama.cpp runs, checked against the path asked for."""
        return llamacpp_cpu_path.ran(self._lc, self.stack.opts["cpu_path"], self._cpu_module)

    def settings(self) -> dict[str, Any]:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        return {
            "dtype": self.stack.dtype,
            "gguf_tensor_types": self.tensor_types,
            "gguf_size": self.size,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            **self.kv_cache.settings(),
            # a prompt of more kept rows than STREAM_BYTES holds: decoded in calls of at most this
            # many kept rows, each call's rows stored before the next (llama_contexts.forward_blocks)
            "stream_rows": block_rows(self._n_vocab),
            "n_ctx": "prompt length" if self.stack.extra("batch") is None else "the batch's tokens",
            **_batching(self.stack),
            "flash_attn": self._flash_ran(),
            "threads": self.threads,
            "lanes": {"at_most": self.lanes(), "threads_each": [lane.threads for lane in self._lanes.split]}
            if self._lanes.split
            else None,
            "context_per_prompt": "kept per prompt length, KV cache cleared before each prompt",
            "omp_wait_policy": self.wait_policy,
            "use_extra_bufts": self.extra_bufts,
            "n_gpu_layers": 0 if self.stack.device == "cpu" else 999,
            "system_info": info,
            "machine": platform.machine(),
            "artifact": self.artifact,
            "model_facts": self._facts(),
            "versions": {"llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__},
        }

    def _flash_ran(self) -> str:
        """The attention the contexts were made with, in the stack's words: flash_attn where a
        quantised V cache turned llama.cpp's auto on (LlamaContexts._flash)."""
        lc = self._lc
        return "flash_attn" if self._flash() == lc.LLAMA_FLASH_ATTN_TYPE_ENABLED else self.stack.attention

    def _facts(self) -> dict[str, Any]:
        """The GGUF's architecture and attention window, as the loaded model reports them."""
        lc = self._lc

        def meta(key: str) -> str | None:
            buf = ctypes.create_string_buffer(256)
            return buf.value.decode() if lc.llama_model_meta_val_str(self.model, key.encode(), buf, 256) >= 0 else None

        arch = meta("general.architecture")
        return {
            "architecture": arch,
            "n_swa": int(lc.llama_model_n_swa(self.model)),
            "sliding_window": meta(f"{arch}.attention.sliding_window"),
            # llama.cpp's Gemma graphs scale the embeddings by sqrt(n_embd) in fp32
            "embed_scale": float(np.float32(lc.llama_model_n_embd(self.model)) ** np.float32(0.5))
            if arch and arch.startswith("gemma")
            else None,
        }

    layer_sources = {"layer": "l_out-{i}", "final_norm": "result_norm"}  # the graph's tensor names

    def n_layers(self) -> int:
        return int(self._lc.llama_model_n_layer(self.model))

    def layer_states(self, token_ids: list[int], positions: list[int], layers: list[int]) -> dict[str, np.ndarray]:
        """The graph's own l_out-N (after decoder layer N) and result_norm tensors, read through the
        eval callback in the same prefill forward() runs (same batch and ubatch split)."""
        return self.forward_and_layers(token_ids, positions, layers)[1]

    def forward_and_layers(
        self, token_ids: list[int], positions: list[int], layers: list[int]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One prefill: reading the taps leaves the logits bit for bit (tests/test_layer_states.py)."""
        from backends.llama_binding import LayerTaps

        n_layer = self._lc.llama_model_n_layer(self.model)
        check_layers(layers, n_layer)
        taps = LayerTaps(layers, n_layer, positions)
        logits = self.forward(token_ids, positions, taps)
        return logits, taps.result()

    @classmethod
    def file_tokenize(cls, path: str, text: str) -> tuple[list[int], int | None]:
        return gguf_tokenize(path, text)  # as llama-perplexity: add_special on, parse_special off

    @classmethod
    def file_tokenize_ahead(cls, path: str, text: str) -> None:
        from backends.llama_binding import tokenize_ahead

        tokenize_ahead(path, text)

    @classmethod
    def keep_file_vocabulary(cls, source: str, hf_dir: str) -> bool:
        from pathlib import Path

        from backends.gguf_vocab import keep_vocabulary

        return keep_vocabulary(Path(source), Path(hf_dir))

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenizer as llama-cpp-python calls it by default (add_bos per the GGUF)."""
        return tokenize_with(self.vocab, text, True, True)

    def special_tokens(self) -> dict[str, Any]:
        lc = self._lc
        return {
            "bos": lc.llama_vocab_bos(self.vocab),
            "eos": lc.llama_vocab_eos(self.vocab),
            "add_bos": bool(lc.llama_vocab_get_add_bos(self.vocab)),
        }

    def close(self) -> None:
        for lane in self._lanes.every() if getattr(self, "_lanes", None) else ():
            self._drop_kept(lane)
        if getattr(self, "model", None):
            self._lc.llama_model_free(self.model)
            self.model = None


def _batching(stack) -> dict[str, Any]:
    """How a prompt shares its llama_decode calls (backends/llamacpp_contexts.py forward_batch)."""
    batch = stack.extra("batch")
    if batch is None:
        return {"n_seq_max": 1}
    return {"n_seq_max": batch.size, "kv_unified": True, "batch_order": "sequence by sequence, measured first"}
