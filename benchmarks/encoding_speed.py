"""How fast and how small a shard's logits encode: zstd level x byte-stream-split, for fp32 rows and
for the same rows stored as bf16 (`store: bf16`), on real rows (SmolLM2 by llama.cpp f16, whose
logits are float32). One core, best of 3, written to memory.

    .venv/bin/python benchmarks/encoding_speed.py [--rows 512]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import cpu, save_result

LEAF = "logits.list.element"


def rows_of(n: int) -> np.ndarray:
    from backends.gguf_build import build_for
    from backends.llamacpp_backend import LlamaCppBackend
    from common.stack import StackDesc
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    m = fetch(ModelRef("smollm2-135m", "catalog", "smollm2-135m"), log=lambda s: None)
    build_for("f16", m.hf_dir, m.weights_sha256, 2)
    be = LlamaCppBackend(
        StackDesc.of(LlamaCppBackend.engine, "f16", "default", weights_sha256=m.weights_sha256), m.hf_dir, 2
    )
    be.load()
    ids = [int(i) for i in np.random.default_rng(0).integers(200, 40000, n + 1)]  # any ids: real weights, real rows
    return be.forward(ids, list(range(n)))  # (rows, vocab) float32


def encode(values: np.ndarray, level: int, bss: bool) -> tuple[int, float]:
    n, vocab = values.shape
    t = pa.table(
        {
            "logits": pa.ListArray.from_arrays(
                pa.array(np.arange(0, (n + 1) * vocab, vocab, dtype=np.int32)), pa.array(values.reshape(-1))
            )
        }
    )
    best = float("inf")
    for _ in range(3):
        sink = pa.BufferOutputStream()
        t0 = time.perf_counter()
        w = pq.ParquetWriter(
            sink,
            t.schema,
            compression="zstd",
            compression_level=level,
            use_dictionary=False,
            use_byte_stream_split=[LEAF] if bss else False,
            write_page_checksum=True,
        )
        w.write_table(t)
        w.close()
        best = min(best, time.perf_counter() - t0)
    return sink.getvalue().size, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    a = ap.parse_args()
    from store.warehouse import ZSTD_LEVEL, round_bf16, widen

    pa.set_cpu_count(1)
    x = rows_of(a.rows)
    kinds = {"fp32": x, "bf16 (store: bf16)": widen(round_bf16(x))}
    print(f"CPU: {cpu()}; {x.shape[0]} rows x {x.shape[1]} vocab; one core; the writer uses zstd {ZSTD_LEVEL} + BSS")
    print(f"{'rows':<20} {'zstd':>4} {'BSS':>4} {'B/logit':>8} {'MB/s in':>8}")
    rows = []
    for name, v in kinds.items():
        for level in (1, 3, 6):
            for bss in (True, False):
                size, s = encode(v, level, bss)
                print(
                    f"{name:<20} {level:>4} {'yes' if bss else 'no':>4} {size / v.size:>8.3f} "
                    f"{v.nbytes / s / 1e6:>8.0f}"
                )
                rows.append(
                    {
                        "rows": name.split()[0],
                        "zstd": level,
                        "bss": bss,
                        "writer": level == ZSTD_LEVEL and bss,
                        "bytes_per_logit": size / v.size,
                        "mb_s": v.nbytes / s / 1e6,
                    }
                )
    record(rows)


def record(rows: list[dict]) -> None:
    """Each setting's size against the smallest of its kind of rows in this run. The target is the
    verdict docs/benchmark-notes.md gives this benchmark: the writer's setting (zstd ZSTD_LEVEL + BSS)
    is the smallest, or within 1% of it (its "at the same speed" has no number, so met leaves it out)."""
    for r in rows:
        r["vs_smallest"] = r["bytes_per_logit"] / min(x["bytes_per_logit"] for x in rows if x["rows"] == r["rows"])
    met = all(r["vs_smallest"] <= 1.01 for r in rows if r["writer"])
    target = "the writer's zstd level + byte-stream-split within 1% of the smallest setting, for fp32 and bf16 rows"
    print(f"recorded: {save_result('encoding_speed', rows, target, met)}")


if __name__ == "__main__":
    main()
