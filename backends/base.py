"""The one interface every engine implements.

How ids line up with captured rows (teacher forcing, one forward)::

    ids        t0   t1   t2  ...  t32  t33  ...  t(T-1)
    position    0    1    2  ...   32   33  ...   T-1
    logits[p] is the distribution over t(p+1) after reading t0..tp
    captured    ^                  ^               ^
               p=0              p=stride      p=T-1 (always; no next token)

A backend never sees text: it receives the canonical token ids, already
tokenised once by the reference tokenizer, and returns raw logits in the
engine's native dtype. It never imports ray.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator

import numpy as np

from common.buffers import room
from common.stack import StackDesc

# A forward whose kept rows hold more float32 bytes than this is handed over in blocks (streams()):
# a prompt of 16,384 tokens at a 262,144 vocabulary would otherwise hold 8.6 GB of scored rows.
STREAM_BYTES = 256 << 20
# A streamed forward's block: its float32 rows at most this (at least one row). The engine's own
# output buffer holds one block, and the capture rounds and encodes it before the next.
BLOCK_BYTES = 256 << 20


def stream_bytes() -> int:
    """STREAM_BYTES as it is now (read at each call, so a test can set it lower)."""
    return STREAM_BYTES


def block_rows(vocab: int) -> int:
    """Rows of one streamed block at this vocabulary (float32): BLOCK_BYTES as it is now."""
    return max(1, BLOCK_BYTES // (4 * vocab))


class SkipCell(Exception):
    """This cell cannot be built as asked (e.g. a quant type the tensor shapes do not allow).
    The run records it as skipped with the message as the reason and goes on."""


class LengthRefused(SkipCell):
    """A forward the engine refuses for the number of tokens it was fed, not for the cell's dtype
    or device (a kernel that runs some sequence lengths only). A capture, which knows the whole
    prompt, feeds a longer prefix or leaves that prompt's rows out (actors/capture.py); any other
    caller skips the cell, as for any SkipCell. tokens: how many were fed."""

    def __init__(self, reason: str, tokens: int):
        super().__init__(reason)
        self.tokens = tokens

    def __reduce__(self):  # both arguments through pickle (a Ray actor's exception reaches the driver)
        return type(self), (str(self), self.tokens)


# Device classes that are GPUs (CUDA or ROCm), for the backends that run on them.
GPU_DEVICES = frozenset({"cuda", "h100", "h200", "b200", "sm120", "mi300x", "rocm"})

# The kinds of published file an engine can run as it is (a `candidates:` entry, a GGUF model):
# a GGUF file; a Hugging Face checkpoint, a directory or a hub id.
GGUF = "gguf"
CHECKPOINT = "checkpoint"
FILE_KINDS = (GGUF, CHECKPOINT)


class Backend:
    # What the engine declares, read by the registry (backends/__init__.py), the spec's validation
    # and schema and `matrix cells` without importing the engine library.
    engine: ClassVar[str] = ""  # its name in specs and cell ids; the registry's key for it
    # The Python package its load() imports: without it the cell is skipped, with the reason.
    requires: ClassVar[str | None] = None
    dtypes: ClassVar[frozenset[str]] = frozenset()
    attention: ClassVar[frozenset[str]] = frozenset()
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    max_tp: ClassVar[int] = 1
    # Spec options (matrix.spec.OPTION_KEYS) this engine takes, e.g. kv_cache.
    options: ClassVar[frozenset[str]] = frozenset()
    # The options it defines itself, {option: (JSON Schema, what it does)}, for the spec's schema and
    # reference (an option a plug-in declares, such as kv_cache, and imatrix are declared where they live)
    option_docs: ClassVar[dict[str, tuple[dict, str]]] = {}
    # How a tp > 1 cell is started (matrix/run/launch.py): "ranks", one actor per rank that joins a
    # torch.distributed group; "engine", one actor holding all the cell's devices, whose engine
    # starts its own tp workers.
    tp_workers: ClassVar[str] = "ranks"
    # The installed distributions whose build changes the rows (common/builds.py): their
    # versions and file hashes name the cell's build, part of what decides "already captured".
    libraries: ClassVar[tuple[str, ...]] = ()
    # Published files it runs as they are (FILE_KINDS), and those it is the default engine for (a
    # candidate that names no engine, `matrix kld`'s reference); one engine is the default of a kind.
    runs_files: ClassVar[frozenset[str]] = frozenset()
    default_for: ClassVar[frozenset[str]] = frozenset()
    # The attention a cell of a given file takes when the entry names none.
    default_attention: ClassVar[str] = "default"
    # The dtype at which it captures a checkpoint's own reference (`matrix kld --reference DIR`).
    reference_dtype: ClassVar[str | None] = None
    # A cell whose weights have no recipe (no conversion, no quantisation) computes with the
    # reference checkpoint's own weights at the cell's dtype (the model card says so).
    checkpoint_as_is: ClassVar[bool] = False
    # A per-cell extra (extras/) is supported by implementing its hook method (Extra.hook): the
    # base class declares none, so a cell asking an engine without it is skipped with the reason.

    def __init__(self, stack: StackDesc, model_dir: str, threads: int):
        self.stack = stack
        self.model_dir = model_dir
        self.threads = threads
        # Tensor parallel: {rank, world_size, master_addr, master_port} when this process is one
        # rank of a tp > 1 cell (set before load()); None for a single-process stack.
        self.dist: dict[str, Any] | None = None

    @classmethod
    def state_bytes(cls, cell) -> int:
        """Bytes per value of the hidden states it hands back for this cell (`layers:`): float32
        where the cell computes in float32, else the 16-bit activations' width."""
        return 4 if cell.dtype in ("fp32", "f32") else 2

    @classmethod
    def weights_key(cls, stack: StackDesc) -> str | None:
        """What of a stack its loaded weights depend on. Cells of one run with the same key (and the
        same model, engine build, device, threads and node) run in turn on one host, each taking
        the loaded model over with switch() instead of loading it again. None: each cell loads its own."""
        return None

    def switch(self, stack: StackDesc) -> bool:
        """Take over this loaded engine for another stack of the same weights_key (another
        attention, other per-cell extras or max_tokens); False where it cannot, and the host
        loads the stack afresh. An exception here is the new stack's own (a SkipCell skips it)."""
        return False

    @classmethod
    def workers_in_group(cls, cell) -> bool:
        """True: the engine starts its own Ray workers, into the placement group the runner makes
        for the cell (its actor sits in bundle 0 and captures child tasks)."""
        return False

    @classmethod
    def runtime_env(cls, stack: StackDesc, threads: int) -> dict[str, Any] | None:
        """A Ray runtime_env for the cell's actor (e.g. another interpreter), or None for the driver's."""
        return None

    @classmethod
    def unsupported(cls, cell) -> str | None:
        artifact = getattr(cell, "artifact", None)
        if artifact and not cls.runs_files:
            return f"engine {cls.engine} does not run a given artifact"
        if (
            not artifact or GGUF not in cls.runs_files
        ) and cell.dtype not in cls.dtypes:  # a GGUF runs what it declares
            return f"engine {cls.engine} does not run dtype {cell.dtype} (runs: {', '.join(sorted(cls.dtypes))})"
        if cell.attention not in cls.attention:
            return f"engine {cls.engine} has no attention '{cell.attention}' (has: {', '.join(sorted(cls.attention))})"
        if cell.device not in cls.devices:
            return (
                f"engine {cls.engine} does not run on device {cell.device} (runs on: {', '.join(sorted(cls.devices))})"
            )
        if cell.tp > cls.max_tp:
            return f"engine {cls.engine} supports tp up to {cls.max_tp} in this version (asked tp={cell.tp})"
        return None

    @classmethod
    def batch_unsupported(cls, cell) -> str | None:
        """Why a `batch:` cell cannot run on this engine (None: it can); extras/batch.py asks."""
        if cls.forward_batch is Backend.forward_batch:
            return f"engine {cls.engine} does not evaluate a batch of sequences here"
        if cell.tp > 1 and cls.tp_workers == "ranks":
            return f"engine {cls.engine} batches at tp 1 only (its ranks would each have to feed the batch)"
        return None

    @classmethod
    def max_batch(cls, device: str) -> tuple[int, str] | None:
        """The most sequences one batch may hold on this device, and where that limit comes from
        (None: no fixed limit). A spec asking more is an error, not a skip."""
        return None

    # What the spec asks, before any engine loads, of the engine a kind of file defaults to
    # (backends.for_files): GGUF's tokenizer and vocabulary, the dtype a checkpoint declares.
    @classmethod
    def file_tokenize(cls, path: str, text: str) -> tuple[list[int], int | None]:
        """A text as the engine tokenises it with the file's own vocabulary; -> (ids, the BOS it
        starts a chunk with, or None where the file says the model takes none)."""
        raise NotImplementedError(f"engine {cls.engine} does not tokenise with a file's vocabulary")

    @classmethod
    def file_tokenize_ahead(cls, path: str, text: str) -> None:
        """Start file_tokenize(path, text) beside the caller's work (default: nothing; it runs when asked)."""

    @classmethod
    def keep_file_vocabulary(cls, source: str, hf_dir: str) -> bool:
        """Write the file's vocabulary beside a checkpoint dequantised from it where the checkpoint's
        tokenizer does not carry it whole; -> whether it is there (default: nothing to keep)."""
        return False

    @classmethod
    def checkpoint_dtype(cls, torch_dtype: str) -> str | None:
        """The spec's dtype name of a checkpoint's torch_dtype ("bfloat16" -> "bf16"), None: unknown."""
        return None

    def checkpoint_candidate(self) -> dict[str, Any]:
        """An HF checkpoint given as a candidate replaces the reference weights: this node's copy
        of the directory, its digest checked here where it is read; a hub id is loaded from the
        hub. Sets model_dir and artifact; -> the revision kwarg for from_pretrained / vllm.LLM."""
        from pathlib import Path

        from common.files import weights_digest_cached

        st = self.stack
        recipe = {"tool": "published artifact", "kind": "hf checkpoint", "source": st.artifact_source or st.artifact}
        if st.artifact.startswith("hub:"):
            from common.ids import split_hub_artifact

            repo, rev = split_hub_artifact(st.artifact)
            self.model_dir = repo
            self.artifact = {"path": st.artifact, "sha256": None, "recipe": recipe}
            return {"revision": rev}
        got = weights_digest_cached(Path(st.artifact))
        if st.artifact_sha256 and got != st.artifact_sha256:
            raise RuntimeError(f"{st.artifact}: weights sha256 {got}, but the driver recorded {st.artifact_sha256}")
        self.model_dir = st.artifact
        self.artifact = {"path": st.artifact, "sha256": got, "recipe": recipe}
        return {}

    def load(self) -> None:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """Everything that changes the arithmetic: dtype, attention, threads, versions..."""
        raise NotImplementedError

    def vocab_size(self) -> int:
        raise NotImplementedError

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        """Teacher-forced logits at `positions`: (len(positions), vocab) in the native dtype.

        bf16 comes back as its raw bits (uint16); fp32 as float32.
        """
        raise NotImplementedError

    def forward_batch(self, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
        """forward() of token_ids evaluated in one batch with the `others` sequences (common/batching.py),
        the way the engine's users batch: its rows at `positions` only, (rows, vocab), native dtype."""
        raise NotImplementedError

    def streams(self, rows: int) -> bool:
        """Whether forward_blocks() hands a forward of `rows` kept rows over in more than one block
        (the capture then writes each block as it comes): only where the rows held whole would
        cost more memory than the engine's own pieces (STREAM_BYTES)."""
        return False

    def forward_blocks(self, token_ids: list[int], positions: list[int]) -> Iterator[np.ndarray]:
        """forward()'s rows in blocks of consecutive kept positions, in order: each (block rows,
        vocab), valid only until the next block is asked for (it may be the engine's own output
        memory). Peak memory then follows the block, not the prompt. Default: one block."""
        yield self.forward(token_ids, positions)

    def keep_outputs(self, n: int) -> None:
        """Let forward() hand back, in turn, one of n (rows, vocab) buffers it keeps (0: a new array
        each call), for a caller done with each result before the n-th next forward() (a capture
        that makes no other call): a prompt's fresh memory costs its page faults. An engine that
        has no such buffers ignores it."""

    def lanes(self) -> int:
        """How many forward() calls a capture may run at once, each from a thread of its own that
        called bind_lane(i) first (0 <= i < lanes). An engine whose forwards share one state says 1."""
        return 1

    def bind_lane(self, i: int) -> None:
        """Bind the calling thread to lane i: its forward() calls use that lane's own state."""
        if i != 0:
            raise ValueError(f"lane {i}: this engine runs one forward at a time")

    def rows_beside_forward(self) -> bool:
        """Whether a capture that measures its rows against its reference does that row work (and
        the writing) beside the next forward rather than between forwards: yes where the forward
        runs on an accelerator; on the CPU only where the engine's threads leave their cores while
        they wait (llama.cpp's passive OpenMP threads), else the two take turns with its threads."""
        return self.stack.device != "cpu"

    def tokenize(self, text: str) -> list[int] | None:
        """The engine's own tokenizer, called the way the engine calls it by default
        (text in, special tokens as the engine adds them). None: the engine has none."""
        return None

    def special_tokens(self) -> dict[str, Any]:
        """{"bos": id, "eos": id, "add_bos": bool} as the engine sees them."""
        return {}

    def close(self) -> None:
        pass


class OutputRing:
    """n buffers handed out in turn as (rows, vocab) views; one grows only when a call asks more
    values than it holds (or another dtype). OutputRing(0): a new array every call. empty(size,
    dtype) makes a (size,) buffer: np.empty, or numpy over other host memory (backends/torch_rows.py
    pins it for copies from a GPU)."""

    def __init__(self, n: int, empty=np.empty):
        self.bufs: list[np.ndarray | None] = [None] * n
        self.at = 0
        self.empty = empty

    def take(self, shape: tuple[int, int], dtype) -> np.ndarray:
        size = shape[0] * shape[1]
        if not self.bufs:
            return self.empty(size, dtype).reshape(shape)
        i, self.at = self.at, (self.at + 1) % len(self.bufs)
        self.bufs[i] = room(self.bufs[i], size, dtype, self.empty)
        return self.bufs[i][:size].reshape(shape)


def check_layers(layers: list[int], n_layers: int) -> None:
    """The layer indices a layer_states() call asks for exist in a model of n_layers."""
    if any(i < 0 or i >= n_layers for i in layers):
        raise ValueError(f"layers {layers}: the model has {n_layers} (0..{n_layers - 1})")
