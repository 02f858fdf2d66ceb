"""Importance matrices for llama.cpp quantisation, collected the way llama-imatrix does.

llama-imatrix is not in the llama-cpp-python wheel, and building it from the sdist is slow
(docs/benchmark-notes.md). llama.cpp's own graph runs here instead, through the binding, with the
tool's eval callback (tools/imatrix/imatrix.cpp collect_imatrix) reimplemented on top:

    for every MUL_MAT whose weight is blk.* and whose activations have >= 16 rows (f32):
        in_sum2[weight] += x * x      # (cols,), summed row by row in float32, as the tool does
        counts[weight]  += rows

Chunks are cut as the tool cuts them (n_ctx tokens, BOS put first where the model wants one,
every position an output so the last layer sees every row). The result is written in the
tool's GGUF imatrix format, so llama-quantize --imatrix reads it too, and
benchmarks/vs_llama_imatrix.py compares it with the tool's own file.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from backends.artifacts import ensure
from backends.base import SkipCell
from backends.llama_binding import GgmlTensor, extra_bufts, ggml_base, tensor_f32
from common.errors import UserError

TOKENS_KEY = "logit_matrix.calibration_tokens"
MIN_ROWS = 16  # the tool ignores smaller batches ("why are small batches ignored (<16 tokens)?")
COLLECTOR = "llama.cpp imatrix accumulation (tools/imatrix/imatrix.cpp) via llama-cpp-python cb_eval"


def _op_ids(lib) -> dict[str, int]:
    """MUL_MAT's and MUL_MAT_ID's enum values, read from the library (the enum moves between
    versions). Both sit early in the enum; the scan stops there, since ggml_op_name past
    GGML_OP_COUNT would read beyond its table."""
    out = {}
    for i in range(128):
        name = lib.ggml_op_name(i)
        if name is None:
            break
        out[name.decode()] = i
        if "MUL_MAT" in out and "MUL_MAT_ID" in out:
            break
    if "MUL_MAT" not in out:
        raise RuntimeError("libggml-base names no MUL_MAT op: this ggml is not the one the collector was written for")
    return out


def _weight_name(raw: bytes) -> str:
    """filter_tensor_name: a name like 'a#blk.0.attn_q.weight#b' means the middle part."""
    name = raw.decode(errors="replace")
    if "#" in name:
        name = name.split("#", 2)[1]
    return name


class Collector:
    """The eval callback and its sums: {weight name: [in_sum2 (n_mat, cols) float32, count]}."""

    def __init__(self):
        self.lib = ggml_base()
        ops = _op_ids(self.lib)
        self.mul_mat, self.mul_mat_id = ops["MUL_MAT"], ops.get("MUL_MAT_ID", -1)
        self.stats: dict[str, list] = {}
        self.error: BaseException | None = None
        import llama_cpp

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)  # kept alive here

    def _cb(self, ptr, ask, _user) -> bool:
        try:
            t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
            if t.op == self.mul_mat_id:
                raise SkipCell("the model has expert matmuls (MUL_MAT_ID); collecting their imatrix is not built")
            if t.op != self.mul_mat:
                return False
            src0, src1 = t.src[0].contents, t.src[1].contents
            if ask:
                return src1.ne[1] >= MIN_ROWS and src1.type == 0 and _weight_name(src0.name).startswith("blk.")
            self._collect(_weight_name(src0.name), src0, src1)
            return True
        except BaseException as e:  # noqa: BLE001 - a ctypes callback cannot raise; re-raised after decode
            self.error = self.error or e
            return False

    def _collect(self, name: str, src0: GgmlTensor, src1: GgmlTensor) -> None:
        n_mat = src0.ne[2] * src0.ne[3]
        x = tensor_f32(self.lib, src1)  # (i3, i2, rows, cols)
        ne = list(src1.ne)
        entry = self.stats.setdefault(name, [np.zeros((n_mat, ne[0]), dtype=np.float32), 0])
        if entry[0].shape != (n_mat, ne[0]):
            raise RuntimeError(f"{name}: activations of {ne[0]} columns, earlier {entry[0].shape[1]}")
        for i3 in range(ne[3]):
            for i2 in range(ne[2]):
                mat = (i3 % src0.ne[3]) * src0.ne[2] + (i2 % src0.ne[2])
                acc = entry[0][mat]
                sq = x[i3, i2] * x[i3, i2]  # (rows, cols), rounded to float32 as the tool's x[j] * x[j]
                # acc += each row in turn: the tool's float32 sum order, so its file is matched bit for bit
                acc[:] = np.cumsum(np.concatenate([acc[None], sq]), axis=0, dtype=np.float32)[-1]
        if not np.isfinite(entry[0]).all():
            raise RuntimeError(f"non-finite activations in {name}")
        entry[1] += ne[1] * ne[2] * ne[3] // n_mat


def chunks_of(ids: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    """compute_imatrix's chunks: whole n_ctx windows (at least two), BOS first where wanted."""
    if len(ids) < 2 * ctx:
        raise UserError(f"the calibration text has {len(ids)} tokens; an imatrix needs at least 2 x ctx = {2 * ctx}")
    n = len(ids) // ctx if not chunks else min(chunks, len(ids) // ctx)
    out = []
    for i in range(n):
        c = list(ids[i * ctx : (i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def _run_chunks(lc, model, chunks: list[list[int]], ctx: int, threads: int, col: Collector) -> None:
    cp = lc.llama_context_default_params()
    cp.n_ctx = cp.n_batch = ctx
    cp.n_ubatch = min(512, ctx)  # the tool's default ubatch
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = threads
    cp.cb_eval = col.callback
    cp.cb_eval_user_data = None
    cp.no_perf = True
    for c in chunks:
        lctx = lc.llama_init_from_model(model, cp)  # a fresh context per chunk: the tool clears its KV cache
        if not lctx:
            raise RuntimeError("llama.cpp could not create a context for the imatrix")
        batch = lc.llama_batch_init(ctx, 0, 1)
        try:
            batch.n_tokens = len(c)
            for j, tok in enumerate(c):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, j, 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = True  # every row an output, so the last layer's FFN sees every row
            rc = lc.llama_decode(lctx, batch)
            if col.error is not None:
                raise col.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} while collecting the imatrix")
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(lctx)


def _load_cpu(lc, path: str):
    """The GGUF at path loaded by llama.cpp on the CPU, with the kernels a capture uses."""
    from backends.llama_binding import quiet_logs

    quiet_logs()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = extra_bufts()  # the kernels the capture uses
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise UserError(f"{path}: llama.cpp could not load this GGUF")
    return model


def collect(
    gguf: dict[str, Any], text: str, label: str, text_sha256: str, chunks: int | None, ctx: int, threads: int
) -> dict[str, Any]:
    """The imatrix of `gguf` (the F32 file quantisation starts from) on a calibration text, as an
    artifact in llama.cpp's GGUF imatrix format; its recipe says what it was computed on."""
    import llama_cpp as lc

    from backends.llama_binding import tokenize_with

    recipe = {
        "tool": COLLECTOR,
        "llama_cpp_python": lc.__version__,
        "source_sha256": gguf["sha256"],
        "calibration": label,
        "calibration_sha256": text_sha256,
        "chunks_asked": chunks,
        "ctx": ctx,
    }

    def build(tmp: Path) -> None:
        model = _load_cpu(lc, gguf["path"])
        try:
            vocab = lc.llama_model_get_vocab(model)
            ids = tokenize_with(vocab, text, True, False)  # common_tokenize(ctx, prompt, true, parse_special=false)
            bos = int(lc.llama_vocab_bos(vocab)) if lc.llama_vocab_get_add_bos(vocab) else None
            cut = chunks_of(ids, ctx, chunks, bos)
            col = Collector()
            _run_chunks(lc, model, cut, ctx, threads, col)
        finally:
            lc.llama_model_free(model)
        if not col.stats:
            raise RuntimeError("the imatrix collector saw no blk.* matmul: nothing to weight the quantisation with")
        write(tmp, col.stats, [label], len(cut), ctx, tokens=len(ids))

    art = ensure("imatrix", "imatrix.gguf", recipe, build)
    meta = read(art["path"])
    art["recipe"] = {
        **recipe,
        "chunks": meta["chunk_count"],
        "entries": len(meta["entries"]),
        "tokens": meta["tokens"],
        "tokens_used": meta["chunk_count"] * ctx,
    }
    return art


def write(
    path: Path,
    stats: dict[str, list],
    datasets: list[str],
    chunk_count: int,
    chunk_size: int,
    tokens: int | None = None,
) -> None:
    """save_imatrix's GGUF layout: <w>.in_sum2 (cols, n_mat) and <w>.counts (1, n_mat), f32, sorted by name
    (plus the calibration text's token count, a key llama.cpp's loader ignores)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", datasets)
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    if tokens is not None:
        w.add_uint32(TOKENS_KEY, tokens)
    for name in sorted(stats):
        sums, count = stats[name]
        w.add_tensor(f"{name}.in_sum2", sums)  # numpy (n_mat, cols) -> GGUF ne (cols, n_mat)
        w.add_tensor(f"{name}.counts", np.full((sums.shape[0], 1), float(count), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read(path: str) -> dict[str, Any]:
    """An imatrix GGUF (ours or llama-imatrix's): {datasets, chunk_count, chunk_size, entries:
    {weight: (in_sum2 (n_mat, cols), counts (n_mat,))}}."""
    from gguf import GGUFReader

    r = GGUFReader(path)

    def val(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    if val("general.type") != "imatrix":
        raise UserError(f"{path}: not an imatrix GGUF (general.type is {val('general.type')!r})")
    sums, counts = {}, {}
    for t in r.tensors:
        arr = np.asarray(t.data, dtype=np.float32).reshape(-1, int(t.shape[0]))  # (n_mat, cols)
        if t.name.endswith(".in_sum2"):
            sums[t.name[: -len(".in_sum2")]] = arr
        elif t.name.endswith(".counts"):
            counts[t.name[: -len(".counts")]] = arr.reshape(-1)
    if set(sums) != set(counts):
        raise UserError(f"{path}: sums and counts name different tensors")
    return {
        "datasets": list(val("imatrix.datasets", [])),
        "chunk_count": int(val("imatrix.chunk_count", 0)),
        "chunk_size": int(val("imatrix.chunk_size", 0)),
        "tokens": val(TOKENS_KEY),
        "entries": {k: (sums[k], counts[k]) for k in sums},
    }


def quantize_inputs(path: str, label: str) -> tuple[Any, Any, list]:
    """What llama-quantize --imatrix hands llama_model_quantize: per weight in_sum2 / count (1 where
    nothing was counted), and the quantize.imatrix.* header keys. -> (imatrix array, kv array, keep-alive)."""
    import llama_cpp as lc

    im = read(path)
    keep = []
    arr = (lc.llama_model_imatrix_data * (len(im["entries"]) + 1))()
    for i, (name, (sums, counts)) in enumerate(sorted(im["entries"].items())):
        vals = np.where(counts[:, None] > 0, sums / np.where(counts > 0, counts, 1)[:, None], 1.0)
        vals = np.ascontiguousarray(vals, dtype=np.float32).reshape(-1)
        bname = name.encode()
        keep += [vals, bname]
        arr[i].name, arr[i].size = bname, vals.size
        arr[i].data = vals.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    kv = (lc.llama_model_kv_override * 5)()
    items = [
        ("quantize.imatrix.file", Path(path).name),
        ("quantize.imatrix.dataset", label),
        ("quantize.imatrix.entries_count", len(im["entries"])),
        ("quantize.imatrix.chunks_count", im["chunk_count"]),
    ]
    for o, (key, v) in zip(kv, items):
        o.key = key.encode()
        if isinstance(v, int):
            o.tag, o.value.val_i64 = lc.LLAMA_KV_OVERRIDE_TYPE_INT, v
        else:
            o.tag, o.value.val_str = lc.LLAMA_KV_OVERRIDE_TYPE_STR, v.encode()[:127]
    return arr, kv, keep
