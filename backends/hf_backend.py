"""HF transformers backend: the oracle every other engine is compared against.

torch / transformers are imported in load(), so `matrix cells` can read the
capability flags without them.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

from backends import hf_batch, hf_checkpoint, hf_cpu_path, hf_quant, hf_sdpa, hf_stream, torch_rows
from backends.base import CHECKPOINT, GPU_DEVICES, Backend, OutputRing, block_rows, check_layers, stream_bytes

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "f16": "float16"}


def shared_devices(own: list[str], group: list[list[str]]) -> tuple[str, int]:
    """CUDA_VISIBLE_DEVICES for one rank that sees every rank's GPU, and its own index in it.

    own: the GPU ids Ray gave this rank (one); group: every rank's ids, in rank order."""
    ids = sorted({g for ranks in group for g in ranks}, key=int)  # (n_gpus,) physical ids
    if len(own) != 1:
        raise RuntimeError(f"a tensor-parallel rank holds one GPU; Ray gave this one {own}")
    return ",".join(ids), ids.index(own[0])


def _accelerate() -> dict[str, str]:
    """accelerate's version where it is installed (a bare CUDA image may not have it; nothing here needs it)."""
    try:
        import accelerate
    except ImportError:
        return {}
    return {"accelerate": accelerate.__version__}


class HFBackend(Backend):
    engine = "hf"
    dtypes = frozenset(TORCH_DTYPES) | frozenset(hf_quant.DTYPES)
    attention = frozenset({"eager", "sdpa", "flash_attention_2"}) | frozenset(hf_sdpa.KERNELS)
    devices = frozenset({"cpu"}) | GPU_DEVICES
    max_tp = 8  # tensor parallel through torch.distributed: gloo on CPU, NCCL on GPU
    libraries = ("torch", "transformers", "accelerate", "safetensors")
    # quantizer: int8 / int4 only, which library quantises (backends/hf_quant.py); deterministic: torch's
    # deterministic algorithms (and cuBLAS's fixed workspace on CUDA); cpu_path: torch's and oneDNN's
    # kernels for another CPU's instruction set (backends/hf_cpu_path.py)
    options = frozenset({"quantizer", "deterministic", "cpu_path"})
    option_docs = {
        "quantizer": ({"enum": ["torchao", "quanto"]}, "HF int8/int4 cells: the library that quantises at load"),
        "deterministic": ({"type": "boolean"}, "HF: deterministic torch algorithms"),
    }
    requires = "transformers"
    runs_files = frozenset({CHECKPOINT})  # a candidate checkpoint (a directory or a hub id), run as it is
    default_for = frozenset({CHECKPOINT})
    default_attention = "eager"
    reference_dtype = "fp32"  # the checkpoint's own arithmetic, widened
    checkpoint_as_is = True  # a float cell casts the reference weights; int8/int4 record their quantizer

    @classmethod
    def unsupported(cls, cell) -> str | None:
        reason = super().unsupported(cell)
        if reason is None and cell.attention == "flash_attention_2" and cell.device == "cpu":
            reason = "attention flash_attention_2 needs a CUDA device"
        if reason is None:
            reason = hf_sdpa.unsupported(cell.attention, cell.device)
        if reason is None and cell.dtype in hf_quant.DTYPES:
            reason = hf_quant.unsupported(cell.dtype, cell.opts, cell.device)
        return reason

    @classmethod
    def checkpoint_dtype(cls, torch_dtype: str) -> str | None:
        return {v: k for k, v in TORCH_DTYPES.items()}.get(torch_dtype)  # "bfloat16" -> "bf16"

    @classmethod
    def runtime_env(cls, stack, threads: int) -> dict[str, Any] | None:
        """`deterministic: true` on a GPU: cuBLAS's fixed workspace from the actor's start, before any
        cuBLAS handle exists (load() sets it too, for a process that has none yet); a `cpu_path`:
        its switches, which torch and oneDNN read once, when they load."""
        env = hf_cpu_path.env(stack.opts.get("cpu_path"))
        if stack.opts.get("deterministic") and stack.device != "cpu":
            env["CUBLAS_WORKSPACE_CONFIG"] = hf_batch.CUBLAS_WORKSPACE
        return {"env_vars": env} if env else None

    def cpu_path_ran(self) -> dict[str, Any]:
        """The cpu_path hook: what this host's torch runs, checked against the path the cell names."""
        return hf_cpu_path.ran(self._torch, self.stack.opts["cpu_path"])

    @classmethod
    def weights_key(cls, stack) -> str | None:
        """Every field of the stack but those a loaded model changes at run time: the attention
        implementation (PreTrainedModel.set_attn_implementation; an SDPA kernel is pinned per
        forward anyway), the per-cell extras (hooks per forward), max_tokens and the batch. Not for a
        tensor-parallel cell: its ranks load together."""
        if stack.tp > 1:
            return None
        free = {"attention": "", "cell_id": "", "max_tokens": None, "extras": ()}
        return repr(stack.replace(**free))

    def switch(self, stack) -> bool:
        """The loaded model under another stack's attention: transformers looks the attention
        function up by config._attn_implementation at every forward, so the same weights then
        compute what a model loaded with that implementation computes."""
        if getattr(self, "model", None) is None or self.dist:
            return False
        impl = hf_sdpa.implementation(stack.attention)
        if self.model.config._attn_implementation != impl:
            self.model.set_attn_implementation(impl)
        self.stack = stack
        hf_sdpa.check(self._torch, self.model, stack.attention, self.torch_device, self._grad_off())
        return True

    def load(self) -> None:
        import torch
        import transformers

        self._torch = torch
        self._outputs = OutputRing(0)  # a new host array per forward until the caller asks to keep some
        transformers.utils.logging.disable_progress_bar()  # one stack loads in seconds; bars only clutter logs
        torch.set_num_threads(self.threads)
        self.torch_device = "cpu" if self.stack.device == "cpu" else "cuda"
        hf_batch.deterministic(torch, bool(self.stack.opts.get("deterministic")), self.torch_device)
        self.artifact, self._src = None, {}
        if self.stack.artifact:
            self._src = self.checkpoint_candidate()
        quant, self.recipe = {}, None
        if self.stack.dtype in hf_quant.DTYPES:  # quantised at load; activations stay fp32
            qcfg, self.recipe = hf_quant.config(self.stack.dtype, self.stack.opts)
            quant = {"quantization_config": qcfg}
        dtype = getattr(torch, TORCH_DTYPES.get(self.stack.dtype, "float32"))
        tp_kw = self._init_tp(torch, transformers) if self.dist else {}
        # Load with dtype= (not .to()): .to(bf16) would also cast the rotary inv_freq buffer.
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir,
            dtype=dtype,
            attn_implementation=hf_sdpa.implementation(self.stack.attention),
            output_loading_info=True,
            **tp_kw,
            **quant,
            **self._src,
        )
        hf_checkpoint.check_loaded(model, info, self.model_dir, quantised=bool(quant))
        self.model = (model if self.dist else model.to(self.torch_device)).eval()
        self._vocab = int(model.config.vocab_size)
        hf_sdpa.check(torch, self.model, self.stack.attention, self.torch_device, self._grad_off())

    def vocab_size(self) -> int:
        return self._vocab

    def _init_tp(self, torch, transformers) -> dict[str, Any]:
        """Join the cell's process group (one rank per Ray actor) and shard with the model's own TP plan."""
        from backends.base import SkipCell

        d = self.dist
        cfg = transformers.AutoConfig.from_pretrained(self.model_dir, **self._src)
        heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        if heads % d["world_size"] or kv % d["world_size"]:
            raise SkipCell(f"tp {d['world_size']} does not divide the model's {heads} attention / {kv} KV heads")
        local, visible = 0, None
        if self.torch_device == "cuda" and d.get("node_gpus"):
            # Ray shows each rank only its own GPU; NCCL then cannot use P2P / NVLink between
            # ranks and falls back to shared memory, with other all-reduce algorithms (other bits).
            # Every rank sees the group's GPUs instead, and picks its own by index (as Ray Train does).
            visible, local = shared_devices(d["own_gpus"], d["node_gpus"])
            os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before CUDA initialises in this process
        os.environ.update(
            MASTER_ADDR=d["master_addr"],
            MASTER_PORT=str(d["master_port"]),
            RANK=str(d["rank"]),
            WORLD_SIZE=str(d["world_size"]),
            LOCAL_RANK=str(local),
        )
        backend = "gloo" if self.torch_device == "cpu" else "nccl"
        if self.torch_device == "cuda":
            torch.cuda.set_device(local)
        torch.distributed.init_process_group(backend, rank=d["rank"], world_size=d["world_size"])
        self._tp = {
            "world_size": d["world_size"],
            "rank": d["rank"],
            "backend": backend,
            "tp_plan": "auto",
            "cuda_visible_devices": visible,
            "local_device": local,
        }
        return {"tp_plan": "auto"}

    def settings(self) -> dict[str, Any]:
        import safetensors
        import torch
        import transformers

        cfg = self.model.config
        return {
            "dtype": self.stack.dtype,
            "torch_dtype": str(next(self.model.parameters()).dtype),
            "attention": cfg._attn_implementation,
            **hf_sdpa.settings(self.model, self.stack.attention),
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "torch_device": self.torch_device,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            # a CPU code path's switches wherever set (a native cell under a user's exported one is no native one)
            "cpu_switches": hf_cpu_path.switches(),
            "mkldnn": bool(torch.backends.mkldnn.is_available()),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            if self.torch_device == "cuda"
            else None,
            "use_cache": False,
            **hf_batch.settings(self.stack),
            # a prompt of more kept rows: one prefill, the LM head a block of rows at a time (hf_stream)
            "stream_rows": block_rows(self._vocab),
            "tensor_parallel": getattr(self, "_tp", None),
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if self.torch_device == "cuda" else None,
            "machine": platform.machine(),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                **_accelerate(),
                "safetensors": safetensors.__version__,
                "numpy": np.__version__,
                **({self.recipe["tool"]: self.recipe["version"]} if self.recipe else {}),
            },
            **(
                {"quantizer": self.recipe["tool"], "artifact": {"path": None, "sha256": None, "recipe": self.recipe}}
                if self.recipe
                else {}
            ),
            **({"artifact": self.artifact} if self.artifact else {}),
            "model_facts": model_facts(self.model),
        }

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        torch = self._torch
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.torch_device)  # (1, T)
        keep = torch.tensor(positions, dtype=torch.long, device=self.torch_device)  # (rows,)
        with self._grad_off(), hf_sdpa.pinned(torch, self.model, self.stack.attention, len(token_ids)):
            # logits_to_keep: the LM head runs only on the sampled rows of the one prefill.
            out = self.model(input_ids=ids, logits_to_keep=keep, use_cache=False)
        return torch_rows.to_host(torch, out.logits[0].detach(), self._outputs)  # (rows, vocab), native dtype

    def forward_batch(self, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
        return hf_batch.forward(self, token_ids, positions, others)

    stream_head: str | None = None  # how a streamed prompt's later blocks were computed (hf_stream)

    def streams(self, rows: int) -> bool:
        return rows * 4 * self._vocab > stream_bytes()

    def forward_blocks(self, token_ids: list[int], positions: list[int]):
        """Past STREAM_BYTES of rows, the LM head a block at a time over one prefill (backends/hf_stream.py)."""
        if not self.streams(len(positions)):
            yield self.forward(token_ids, positions)
            return
        yield from hf_stream.blocks(self, token_ids, positions)

    def keep_outputs(self, n: int) -> None:
        """Logits copied from a GPU land in n host buffers, page-locked, handed out in turn (0: a
        new pageable array each forward); on the CPU forward() hands back the model's own logits
        tensor (backends/torch_rows.py)."""
        self._outputs = torch_rows.host_ring(self._torch, n, pinned=n > 0 and self.torch_device == "cuda")

    def _grad_off(self):
        # optimum-quanto 0.2.7's int4 weights unpack with in-place ops that inference_mode forbids
        # ("Cannot set version_counter for inference tensor"): no_grad is the same arithmetic
        quanto = (self.recipe or {}).get("tool") == "optimum-quanto"
        return self._torch.no_grad() if quanto else self._torch.inference_mode()

    def decode(self, token_ids: list[int], at: int, steps: int) -> np.ndarray:
        """transformers' own KV cache (DynamicCache): the prefill, then one token per call."""
        torch = self._torch
        dev = self.torch_device
        rows = []
        with torch.inference_mode(), hf_sdpa.pinned(torch, self.model, self.stack.attention, at + 1):
            out = self.model(
                input_ids=torch.tensor([token_ids[: at + 1]], device=dev), use_cache=True, logits_to_keep=1
            )
            cache = out.past_key_values
            for s in range(1, steps + 1):
                out = self.model(
                    input_ids=torch.tensor([[token_ids[at + s]]], device=dev), past_key_values=cache, use_cache=True
                )
                cache = out.past_key_values
                rows.append(out.logits[0, -1].detach().to("cpu"))  # (vocab,), native dtype
        logits = torch.stack(rows)  # (steps, vocab)
        if logits.dtype == torch.bfloat16:
            return logits.view(torch.int16).numpy().view(np.uint16)
        return logits.numpy()

    def chunked_rows(self, token_ids: list[int], positions: list[int], chunk: int) -> np.ndarray:
        """The prompt in forwards of `chunk` tokens, each continuing transformers' own KV cache
        (DynamicCache); the kept rows' final hidden states joined, then one LM head over all of
        them, as forward() runs it (a head per chunk would round otherwise: another matmul shape)."""
        return hf_stream.chunked(self, token_ids, positions, chunk)

    layer_sources = {
        "layer": "model.layers.{i} output (forward hook)",
        "final_norm": "model.norm output (forward hook)",
    }

    def n_layers(self) -> int:
        return len(self.model.model.layers)

    def layer_states(self, token_ids: list[int], positions: list[int], layers: list[int]) -> dict[str, np.ndarray]:
        return self.forward_and_layers(token_ids, positions, layers)[1]

    def forward_and_layers(
        self, token_ids: list[int], positions: list[int], layers: list[int]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """forward() with forward hooks on the decoder layers asked for and on the final norm (HF's
        own output_hidden_states would give the last layer after the norm, not before it); the
        hooks only copy rows out, so the logits are forward()'s."""
        torch = self._torch
        keep = torch.tensor(positions, dtype=torch.long, device=self.torch_device)  # (rows,)
        got: dict[str, Any] = {}

        def hook(name):
            def f(_mod, _args, out):
                h = out[0] if isinstance(out, tuple) else out  # (1, T, hidden)
                got[name] = h[0, keep].detach().to("cpu")  # (rows, hidden), native dtype

            return f

        stack = self.model.model
        check_layers(layers, len(stack.layers))
        handles = [stack.layers[i].register_forward_hook(hook(f"layer.{i}")) for i in layers]
        handles.append(stack.norm.register_forward_hook(hook("final_norm")))
        try:
            logits = self.forward(token_ids, positions)
        finally:
            for h in handles:
                h.remove()
        return logits, {
            k: (v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy())
            for k, v in got.items()
        }

    def _tok(self):
        if getattr(self, "_tokenizer", None) is None:
            import transformers

            self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir, **self._src)
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok()(text).input_ids)  # add_special_tokens=True: the HF default

    def special_tokens(self) -> dict[str, Any]:
        t = self._tok()
        return {"bos": t.bos_token_id, "eos": t.eos_token_id, "add_bos": bool(getattr(t, "add_bos_token", False))}

    def close(self) -> None:
        self.model = None
        if self.dist:
            import torch

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def model_facts(model) -> dict[str, Any]:
    """What of the architecture changes the arithmetic between engines, as this model runs it:
    tied embeddings, the embedding scale in the dtype it is applied in (Gemma multiplies by
    sqrt(hidden)), the attention window and which layers use it, logit soft-capping."""
    cfg = getattr(model.config, "text_config", None) or model.config
    emb = model.get_input_embeddings()
    scale = getattr(emb, "embed_scale", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    return {
        "model_type": cfg.model_type,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "embed_scale": None if scale is None else float(scale.to(emb.weight.dtype)),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": {t: types.count(t) for t in dict.fromkeys(types)} or None,
        "final_logit_softcapping": getattr(cfg, "final_logit_softcapping", None),
    }
