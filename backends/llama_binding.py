"""llama-cpp-python helpers below the llama.cpp backend, for it and for the tools that build its
weights (backends/gguf_imatrix.py): quiet logs, a vocabulary-only load, llama.cpp's tokenizer."""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_LOG_CB = None  # keep the ctypes callback alive for the life of the process
_LOG_LOCK = threading.Lock()  # a thread tokenising ahead and the caller may both ask for quiet logs
_SINK = threading.local()  # .parts: the list a thread collects its calls' log lines in
_AHEAD: dict[tuple, Future] = {}  # gguf_tokenize results started early (tokenize_ahead), taken once
_AHEAD_LOCK = threading.Lock()


def quiet_logs() -> None:
    """llama.cpp prints every tensor and graph node at load; keep only errors (to stderr)."""
    global _LOG_CB
    import sys

    import llama_cpp

    with _LOG_LOCK:
        if _LOG_CB is None:

            def cb(level, text, _user):
                parts = getattr(_SINK, "parts", None)
                if parts is not None:  # this thread asked for its calls' lines (logs_of_this_thread)
                    parts.append(text.decode(errors="replace"))
                if level == 4:  # GGML_LOG_LEVEL_ERROR
                    sys.stderr.write(text.decode(errors="replace"))

            _LOG_CB = llama_cpp.llama_log_callback(cb)
            llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


@contextmanager
def logs_of_this_thread():
    """-> a list that collects what llama.cpp logs from this thread's calls, at every level, until
    the block ends (llama_model_quantize logs each tensor from its caller's thread)."""
    quiet_logs()
    outer = getattr(_SINK, "parts", None)
    _SINK.parts = parts = []
    try:
        yield parts
    finally:
        _SINK.parts = outer


def extra_bufts() -> bool:
    """Whether a model load may use llama.cpp's extra buffer types: its CPU repack (weights re-laid
    for its AVX2/AVX-512 GEMMs, the default of llama-perplexity and llama-cli) and AMX where compiled
    in. AMX segfaults in ggml_backend_amx_mul_mat on some Xeons (ggml-org/llama.cpp#20824), so a
    build with it keeps the plain CPU path; the Makefile's build leaves AMX out (scripts/llama_cmake_args.py)."""
    import llama_cpp

    return "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode(errors="replace")


def load_vocab(path: str, failed: str = "could not load this GGUF"):
    """A vocab-only llama.cpp model (e.g. models/ggml-vocab-*.gguf): (model, vocab)."""
    import llama_cpp as lc

    quiet_logs()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        from common.errors import UserError

        raise UserError(f"{path}: llama.cpp {failed}")
    return model, lc.llama_model_get_vocab(model)


def tokenize_with(vocab, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama_tokenize; add_special adds BOS/EOS only where the GGUF says the model wants them."""
    import llama_cpp as lc

    raw = text.encode()
    buf = (lc.llama_token * (len(raw) + 8))()
    n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
    if n < 0:
        buf = (lc.llama_token * (-n))()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
    return list(buf[:n])


def _ahead_key(path: str, text: str) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, hashlib.sha256(text.encode()).digest()


def tokenize_ahead(path: str, text: str) -> None:
    """Start gguf_tokenize(path, text) on a thread; the next gguf_tokenize of the same file (same
    size and mtime) and text takes its result, or its exception. llama.cpp's vocabulary load
    (docs/benchmark-notes.md) then overlaps the caller's own work: ctypes drops the GIL for each llama.cpp call."""
    key, done = _ahead_key(path, text), Future()

    def run() -> None:
        try:
            done.set_result(_tokenize(path, text))
        except BaseException as e:  # noqa: BLE001 - handed to the caller that takes it, raised there
            done.set_exception(e)

    with _AHEAD_LOCK:
        _AHEAD[key] = done
    # not a daemon: a process that exits early waits for it, never unloads llama.cpp under it
    threading.Thread(target=run, name="tokenize-ahead").start()


def gguf_tokenize(path: str, text: str) -> tuple[list[int], int | None]:
    """A text as llama-perplexity tokenises it (common_tokenize(ctx, text, true): add_special on,
    parse_special off), with only the GGUF's vocabulary loaded; -> (ids, the BOS it puts at the
    start of each chunk, or None where the GGUF says the model takes no BOS)."""
    ahead = _take_ahead(path, text)
    return ahead.result() if ahead is not None else _tokenize(path, text)


def _take_ahead(path: str, text: str) -> Future | None:
    with _AHEAD_LOCK:
        if not _AHEAD:
            return None
        try:
            return _AHEAD.pop(_ahead_key(path, text), None)
        except OSError:  # no such file: the load below says so, as it would have
            return None


def _tokenize(path: str, text: str) -> tuple[list[int], int | None]:
    import llama_cpp as lc

    model, vocab = load_vocab(path, "could not read this GGUF's vocabulary")
    try:
        ids = tokenize_with(vocab, text, True, False)
        return ids, int(lc.llama_vocab_bos(vocab)) if lc.llama_vocab_get_add_bos(vocab) else None
    finally:
        lc.llama_model_free(model)


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h of the vendored llama.cpp): read-only use."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * 10),
    ("view_src", ctypes.c_void_p),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def ggml_base():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    return lib


def tensor_f32(lib, t: GgmlTensor) -> np.ndarray:
    """An f32 ggml tensor as (ne3, ne2, ne1, ne0), read where it lies (a copy for a GPU tensor, as
    llama-imatrix copies one to the host); valid while the callback that got it runs."""
    if t.type != 0 or t.nb[0] != 4:  # GGML_TYPE_F32, contiguous rows
        raise RuntimeError(f"{t.name.decode(errors='replace')}: not contiguous f32 rows (type {t.type})")
    ne, nb = list(t.ne), list(t.nb)
    if not lib.ggml_backend_buffer_is_host(t.buffer):
        keep = np.empty(lib.ggml_nbytes(ctypes.addressof(t)), dtype=np.uint8)
        lib.ggml_backend_tensor_get(ctypes.addressof(t), keep.ctypes.data, 0, keep.nbytes)
        base = keep.ctypes.data
    else:
        keep, base = None, t.data
    size = (ne[3] - 1) * nb[3] + (ne[2] - 1) * nb[2] + (ne[1] - 1) * nb[1] + ne[0] * 4
    buf = keep if keep is not None else (ctypes.c_char * size).from_address(base)
    return np.ndarray((ne[3], ne[2], ne[1], ne[0]), dtype=np.float32, buffer=buf, strides=(nb[3], nb[2], nb[1], 4))


class LayerTaps:
    """An eval callback that keeps l_out-N (N in layers) and result_norm at the sampled positions.

    llama.cpp evaluates a batch in ubatches of n_ubatch tokens. Every layer but the last holds all
    of a ubatch's tokens; the last layer and the final norm hold only its output rows (the
    positions asked for), in order: those are counted in outputs over the whole prefill, the others
    by ubatch of the current decode."""

    def __init__(self, layers: list[int], n_layer: int, positions: list[int]):
        import llama_cpp

        self.lib = ggml_base()
        self.want = {f"l_out-{i}": f"layer.{i}" for i in layers}
        self.want["result_norm"] = "final_norm"
        self.outputs_only = {f"l_out-{n_layer - 1}", "result_norm"}
        self.positions = positions
        self._wanted = set(positions)
        self.rows: dict[str, dict[int, np.ndarray]] = {v: {} for v in self.want.values()}
        self.error: BaseException | None = None
        self._ub: list[tuple[int, int]] = []  # (first token, tokens) of each ubatch of the next decode
        self._seen: dict[str, int] = {}
        self._outputs: dict[str, int] = {}  # output rows taken so far, over the whole prefill
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def at(self, start: int, n_ubatch: int, n_tokens: int) -> None:
        """The next llama_decode covers tokens start..start+n_tokens, split into ubatches."""
        self._ub = [(start + o, min(n_ubatch, n_tokens - o)) for o in range(0, n_tokens, n_ubatch)]
        self._seen = {}

    def _cb(self, ptr, ask, _user) -> bool:
        try:
            t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
            name = t.name.decode(errors="replace")
            if name not in self.want:
                return False
            if ask:
                return True
            self._take(name, tensor_f32(self.lib, t)[0, 0])  # (rows, hidden)
            return True
        except BaseException as e:  # noqa: BLE001 - a ctypes callback cannot raise; re-raised after decode
            self.error = self.error or e
            return False

    def _take(self, name: str, x: np.ndarray) -> None:
        if name in self.outputs_only:  # output rows: the next x.shape[0] sampled positions, in order
            done = self._outputs.get(name, 0)
            pos = self.positions[done : done + x.shape[0]]
            self._outputs[name] = done + x.shape[0]
        else:  # every token of the decode's next ubatch
            k = self._seen.get(name, 0)
            self._seen[name] = k + 1
            first, n = self._ub[k]
            pos = list(range(first, first + n))
        if len(pos) != x.shape[0]:
            raise RuntimeError(f"{name}: {x.shape[0]} rows where {len(pos)} were expected")
        for j, p in enumerate(pos):
            if p in self._wanted:
                self.rows[self.want[name]][p] = x[j].copy()

    def result(self) -> dict[str, np.ndarray]:
        out = {}
        for name, by_pos in self.rows.items():
            missing = [p for p in self.positions if p not in by_pos]
            if missing:
                raise RuntimeError(f"{name}: no state at positions {missing[:5]}")
            out[name] = np.stack([by_pos[p] for p in self.positions])  # (rows, hidden) float32
        return out
