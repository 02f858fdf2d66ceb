"""Analysis throughput: MB of stored logits per second per core, and rows/s, for the full metric set.

Uses real captured rows from a warehouse (default ./warehouse, after `make demo`), tiled to
the larger vocabulary (151,936, Qwen-sized) by resampling columns. Single thread (per core).
Target (issue 4): >= 500 MB/s per core. Baselines measured on the dev VM: naive numpy
float64 KL ~35 MB/s, torch float32 ~160 MB/s.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/analysis_throughput.py [--warehouse DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

TARGET = 500.0


def real_rows(warehouse: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    files = sorted(Path(warehouse, "logits").glob("*/r0.parquet"))
    if len(files) < 2:
        sys.exit(f"{warehouse}: needs at least two captured cells (run `make demo` first)")
    a = np.asarray(pq.read_table(files[0], columns=["logits"])["logits"].to_pylist()[:n], dtype=np.float32)
    b = np.asarray(pq.read_table(files[1], columns=["logits"])["logits"].to_pylist()[:n], dtype=np.float32)
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warehouse", default="warehouse")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    from analysis.metrics import row_metrics

    a, b = real_rows(args.warehouse, args.rows)
    rng = np.random.default_rng(0)
    for vocab in (a.shape[1], 151936):
        if vocab != a.shape[1]:
            cols = rng.integers(0, a.shape[1], vocab)  # resample real columns to the larger vocab
            x, y = a[:, cols], b[:, cols]
        else:
            x, y = a, b
        nxt = np.full(len(x), 1)
        row_metrics(x[:2], y[:2], nxt[:2])  # warm-up
        t0 = time.perf_counter()
        row_metrics(x, y, nxt)
        dt = time.perf_counter() - t0
        mb = 2 * x.nbytes / 1e6  # both sides' stored float32 logits
        print(f"vocab {vocab:>7}: {len(x)} row pairs in {dt:.2f}s -> {len(x) / dt:8.1f} rows/s, "
              f"{mb / dt:7.1f} MB/s per core ({'meets' if mb / dt >= TARGET else 'MISSES'} the {TARGET:.0f} MB/s target)")


if __name__ == "__main__":
    main()
