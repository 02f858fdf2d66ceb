"""What a capture costs on real rows, in this process: the forwards alone, one after another (the
floor under any tool that runs them so) and, per stored row beyond its forward, rounding to bf16
with its KL floor, encoding (row hash, Parquet pages and the shard's file, as a capture writes
them) and the comparison with the reference's row."""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING

from store.prompt_rows import PromptRows

if TYPE_CHECKING:
    import numpy as np


def forwards_alone(model, artifacts: dict[str, dict], ids: list[list[int]], threads: int):
    """The floor under any tool that runs these forwards one after another on every thread (a
    capture's lanes run two at once: actors/lanes.py): each GGUF's prefill of every chunk through
    logit-matrix's own backend, in this process (no rounding, no writes, no comparison);
    -> ({dtype: seconds}, {dtype: the last chunk's rows}, that chunk's next ids)."""
    from backends.llamacpp_backend import LlamaCppBackend
    from common.positions import parse
    from common.stack import StackDesc

    keep, out, last = parse("llama_perplexity", "positions", print), {}, {}
    for dtype, art in artifacts.items():
        be = LlamaCppBackend(
            StackDesc.of(LlamaCppBackend.engine, dtype, "default", weights_sha256=model.weights_sha256),
            model.hf_dir,
            threads,
        )
        be.load()
        if be.artifact["path"] != art["path"]:  # the cells' own file, or the figure means nothing
            raise SystemExit(f"forwards alone: {dtype} loaded {be.artifact['path']}, not {art['path']}")
        t0 = time.perf_counter()
        for chunk in ids:
            last[dtype] = be.forward(*keep.fed(chunk))  # what a cell feeds and keeps: (rows, vocab)
        out[dtype] = time.perf_counter() - t0
        be.close()
    fed, positions = keep.fed(ids[-1])
    return out, last, [ids[-1][p + 1] for p in positions]


def per_row_costs(ref: "np.ndarray", stk: "np.ndarray", next_ids: list[int]) -> dict[str, float]:
    """ms per row of what a capture adds to each forward's rows at this vocabulary, on real rows,
    best of 3: rounding to bf16 with the row's KL floor (Storage.keep: one fused pass), encoding
    (row hash, Parquet pages and the shard's file with its fsync, as a capture writes them, on one
    thread), and the comparison with the reference's row (every metric, float64)."""
    import tempfile

    import numpy as np

    from analysis.metrics import row_metrics
    from store.floors import Storage
    from store.warehouse import ShardWriter, Warehouse

    n = stk.shape[0]
    stored, shift = Storage("bf16").keep(stk)
    nxt = np.asarray(next_ids, np.int64)
    where = tempfile.mkdtemp(prefix="row-costs-")
    Warehouse(where).create()

    def encode() -> None:  # a capture's write of the rows: one thread, as one core's share of it
        w = ShardWriter(where, "r", "c", 0, threads=1)
        w.add(PromptRows("p", list(range(n)), next_ids, stored, shift))
        w.commit()

    steps = {
        "rounding and floor": lambda: Storage("bf16").keep(stk),
        "encoding": encode,
        "comparison": lambda: row_metrics(ref, stk, nxt),
    }
    steps["comparison"]()  # the kernel is built or loaded once per process, as in a cell
    out = {}
    try:
        for k, fn in steps.items():
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[k] = 1000 * best / n
    finally:
        shutil.rmtree(where)
    return out
