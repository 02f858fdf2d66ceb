"""How a shard's store spreads over the host's cores: ShardWriter.add + commit of a few prompts'
rows at a 49,152 vocabulary, bf16 (a backend's bits) and fp32, at 1, 2, 4, ... threads up to the
CPU count; rows/s, MB/s written (the shard's compressed bytes), and each against one thread
measured in the same run (the thread counts alternate, best of --repeat each). Random normal
logits: a real model's rows compress a little better, they encode at the same speed.

    .venv/bin/python benchmarks/store_scaling.py [--prompts 5] [--rows 300] [--vocab 49152] [--repeat 5]

store_scaling() is the measurement, for other benchmarks to call (benchmarks/gpu_capture.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from _common import cpu, save_result

from store.prompt_rows import PromptRows

TARGET_2 = 1.7  # 2 threads against 1: the target on a 2-core machine


def logits_rows(prompts: int, rows: int, vocab: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """prompts x (rows, vocab) logits as a backend returns them: bf16 as uint16 bits, else float32."""
    from store.values import to_bf16

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        x = rng.standard_normal((rows, vocab), dtype=np.float32)  # (rows, vocab)
        x *= 2.5
        x += 4.0
        out.append(to_bf16(x) if dtype == "bf16" else x)
    return out


def _one_store(where: str, dtype: str, prompts: list[np.ndarray], threads: int) -> tuple[float, int]:
    """(seconds, file bytes) of one shard: every prompt added, then committed."""
    from store.warehouse import ShardWriter

    t0 = time.perf_counter()
    w = ShardWriter(where, "bench", f"bench.{dtype}", 0, threads=threads)
    for i, x in enumerate(prompts):
        w.add(PromptRows(f"p{i}", list(range(len(x))), list(range(1, len(x) + 1)), x))
    key = w.commit()
    seconds = time.perf_counter() - t0
    path = os.path.join(where, key)
    size = os.path.getsize(path)
    os.unlink(path)
    return seconds, size


def store_scaling(
    rows_by_dtype: dict[str, list[np.ndarray]], threads_list: list[int], repeat: int = 3, where: str | None = None
) -> list[dict]:
    """{dtype: [(rows, vocab) native per prompt]} -> a dict per (dtype, threads): rows, rows/s,
    MB/s written, and ratio (rows/s against threads=1's in the same run; None without it). The
    thread counts take turns, the best of `repeat` each; shards go to a temp dir under `where`."""
    tmp = tempfile.mkdtemp(prefix="store-scaling-", dir=where)
    out = []
    try:
        for dtype, prompts in rows_by_dtype.items():
            rows = sum(len(x) for x in prompts)
            best: dict[int, tuple[float, int]] = {}
            _one_store(tmp, dtype, prompts[:1], max(threads_list))  # the first shard's imports and pages
            for _ in range(repeat):
                for t in threads_list:
                    s, size = _one_store(tmp, dtype, prompts, t)
                    if t not in best or s < best[t][0]:
                        best[t] = (s, size)
            for t in threads_list:
                s, size = best[t]
                one = rows / best[1][0] if 1 in best else None
                out.append(
                    {
                        "dtype": dtype,
                        "threads": t,
                        "rows": rows,
                        "rows_s": rows / s,
                        "mb_s": size / s / 1e6,
                        "ratio": rows / s / one if one else None,
                    }
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... below cpus, and cpus."""
    out = [1]
    while out[-1] * 2 < cpus:
        out.append(out[-1] * 2)
    return out + [cpus] if cpus > 1 else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--rows", type=int, default=300, help="rows a prompt")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the shards are written (default: the temp dir)")
    a = ap.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    data = {d: logits_rows(a.prompts, a.rows, a.vocab, d) for d in ("bf16", "fp32")}
    rows = store_scaling(data, thread_counts(cpus), a.repeat, a.dir)
    print(f"CPU: {cpu()}; {a.prompts} prompts x {a.rows} rows x {a.vocab} vocab; ShardWriter add + commit")
    print(f"{'rows':<6} {'threads':>7} {'rows/s':>8} {'MB/s':>7} {'vs 1':>6}")
    for r in rows:
        print(f"{r['dtype']:<6} {r['threads']:>7} {r['rows_s']:>8.0f} {r['mb_s']:>7.1f} {r['ratio']:>6.2f}")
    two = [r["ratio"] for r in rows if r["threads"] == 2]
    met = all(x >= TARGET_2 for x in two) if two else None
    target = f"2 threads >= {TARGET_2}x the rows/s of 1, for bf16 and fp32 rows"
    print(f"recorded: {save_result('store_scaling', rows, target, met)}")


if __name__ == "__main__":
    main()
