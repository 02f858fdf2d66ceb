"""Build a warehouse of N stacks x R rows x V vocab for analysis benchmarks, fast.

    python benchmarks/synthetic_warehouse.py OUT --stacks 24 --rows 1000 --vocab 151936 [--jobs 2]

Rows are realistic, not random: the reference's rows are SmolLM2-135M's own fp32 logits on the
built-in corpus (HF transformers, one forward pass), widened to V by appending the row again,
permuted and 6 nats lower (the extra tokens carry little mass, as in a bigger vocabulary). Stack
k adds Gaussian noise of scale sqrt(2 * kl_k) to every logit, which gives KL(ref || stack) ~ kl_k;
the kl_k are log-spaced over --kl. Every row is rounded to bf16 and written as native bf16 through
the project's own ShardWriter (row hashes, byte-stream-split, zstd), with cells and runs rows like a
sweep's, so `matrix analyze` and `matrix sql` see an ordinary warehouse.

Idempotent: stacks already in OUT are kept, so `--stacks 17` on a 16-stack warehouse adds one.
`--reference-rows synthetic` skips the model (log-normal-ish rows; no download, no torch forward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import ids  # noqa: E402
from store import Warehouse  # noqa: E402
from store import rows as R  # noqa: E402
from store.prompt_rows import PromptRows
from store.warehouse import ShardWriter  # noqa: E402

MODEL = "synthetic"
STRIDE = 32
REAL_ROWS = 64  # real rows; reference row i is real row i % 64 with its token ids rotated


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even: what an engine's bf16 output is."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def real_rows(n: int) -> np.ndarray:
    """(n, 49152) float32: SmolLM2-135M's logits at the first n positions of the built-in corpus."""
    import torch
    import transformers

    from benchmarks._common import model_and_prompts

    resolved, prompts = model_and_prompts()
    model = transformers.AutoModelForCausalLM.from_pretrained(resolved.hf_dir, dtype=torch.float32)
    ids_ = [t for _, p in prompts for t in p][:n]
    with torch.no_grad():
        return model(torch.tensor([ids_])).logits[0].float().numpy()  # (n, vocab)


def synthetic_rows(n: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """(n, vocab) float32 with a peaked head and a long tail, when no model is at hand."""
    x = rng.standard_normal((n, vocab), np.float32) * 2.0
    x[np.arange(n), rng.integers(0, vocab, n)] += 14.0  # one likely token per row
    return x


def widen_vocab(rows: np.ndarray, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """(n, v) -> (n, vocab): cut, or append the rows again, permuted and 6 nats lower."""
    out = rows
    while out.shape[1] < vocab:
        out = np.concatenate([out, rows[:, rng.permutation(rows.shape[1])] - 6.0], axis=1)
    return np.ascontiguousarray(out[:, :vocab])


def kl_targets(stacks: int, lo: float, hi: float) -> list[float]:
    """Stack 0 is the reference (0); the others log-spaced from lo to hi."""
    if stacks <= 1:
        return [0.0][:stacks]
    return [0.0] + [float(v) for v in np.geomspace(lo, hi, stacks - 1)]


def cell_id(k: int, kl: float, rows: int, vocab: int) -> str:
    coords = {
        "model": MODEL,
        "engine": "synthetic",
        "dtype": "bf16",
        "attention": f"s{k:03d}",
        "tp": 1,
        "device": "cpu",
    }
    return ids.cell_id(ids.stack_id(coords, {"k": k, "kl": kl, "rows": rows, "vocab": vocab}), "0" * 8)


def write_stack(
    out: str, run_id: str, cid: str, k: int, kl: float, base: np.ndarray, rows: int, prompts: int, seed: int
) -> tuple[int, float]:
    """One stack's repeat-0 shard. base: (REAL_ROWS, vocab) float32. Returns (rows, seconds)."""
    t0 = time.perf_counter()
    vocab = base.shape[1]
    rng_ref = np.random.default_rng(seed)  # the same jitter in every stack: the reference's rows
    rng = np.random.default_rng(seed + 1 + k)
    writer = ShardWriter(out, run_id, cid, 0)
    per = [rows // prompts + (p < rows % prompts) for p in range(prompts)]
    start = 0
    try:
        for p, n in enumerate(per):
            shifts = rng_ref.integers(0, vocab, n)  # every row its own: a real row, its tokens rotated
            x = np.stack([np.roll(base[(start + i) % len(base)], int(shifts[i])) for i in range(n)])  # (n, vocab)
            if kl:
                x += rng.standard_normal((n, vocab), np.float32) * np.float32(math.sqrt(2 * kl))
            positions = [STRIDE * (i + 1) for i in range(n)]
            nxt = rng_ref.integers(0, vocab, n).tolist()
            writer.add(PromptRows(f"p{p:03d}", positions, nxt, to_bf16(x)))
            start += n
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return rows, time.perf_counter() - t0


def base_rows(reference_rows: str, vocab: int, seed: int) -> np.ndarray:
    """(REAL_ROWS, vocab) float32 the stacks' rows are cut from: the model's own, or synthetic."""
    rng = np.random.default_rng(seed)
    base = real_rows(REAL_ROWS) if reference_rows == "real" else synthetic_rows(REAL_ROWS, min(vocab, 49152), rng)
    return widen_vocab(base, vocab, rng)


def stack_cell_row(
    cid: str, run_id: str, k: int, kl: float, ref_cid: str, rows: int, vocab: int, prompts: int, reference_rows: str
) -> dict:
    """Stack k's cells row, as a sweep writes one; stack 0 is the reference of all."""
    return R.cell_row(
        cid,
        run_id,
        "done",
        model=MODEL,
        engine="synthetic",
        dtype="bf16",
        attention=f"s{k:03d}",
        tp=1,
        device="cpu",
        repeats=1,
        rows_per_repeat=rows,
        n_prompts=prompts,
        stride=STRIDE,
        is_reference=k == 0,
        reference_cell_id=ref_cid,
        vocab_size=vocab,
        logits_dtype="bf16",
        bit_reproducible=True,
        settings=json.dumps({"synthetic": True, "target_kl": kl, "reference_rows": reference_rows}),
        versions=json.dumps({"numpy": np.__version__}),
    )


def build(
    out: Path,
    stacks: int,
    rows: int,
    vocab: int,
    prompts: int,
    kl: tuple[float, float],
    jobs: int,
    reference_rows: str,
    seed: int = 0,
    log=print,
) -> dict:
    wh = Warehouse(out)
    wh.create()
    have = {c["cell_id"] for c in wh.read_all("cells")} if wh.check() else set()
    kls = kl_targets(stacks, *kl)
    cids = [cell_id(k, kls[k], rows, vocab) for k in range(stacks)]
    todo = [k for k in range(stacks) if cids[k] not in have]
    if not todo:
        log(f"{out}: all {stacks} stack(s) already there")
        return {"stacks": stacks, "written": 0}
    base = base_rows(reference_rows, vocab, seed)
    run_id = ids.run_id()
    t0, done, futures = time.perf_counter(), 0, {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for k in todo:
            futures[pool.submit(write_stack, str(out), run_id, cids[k], k, kls[k], base, rows, prompts, seed)] = k
        for f in as_completed(futures):
            k = futures[f]
            f.result()
            row = stack_cell_row(cids[k], run_id, k, kls[k], cids[0], rows, vocab, prompts, reference_rows)
            wh.write_rows("cells", cids[k], [row])
            done += 1
            el = time.perf_counter() - t0
            gb = done * rows * vocab * 2 / 1e9
            log(
                f"[synthetic {done}/{len(todo)}] stack {k} (target KL {kls[k]:.1e}) | {gb / el * 1e3:.0f} MB/s bf16 "
                f"| ETA {(len(todo) - done) * el / done:.0f}s"
            )
    el = time.perf_counter() - t0
    name = f"synthetic {stacks}x{rows}x{vocab}"
    wh.write_rows("runs", run_id, [synthetic_run_row(run_id, name, len(todo), len(todo) * rows)])
    return {
        "stacks": stacks,
        "written": len(todo),
        "seconds": round(el, 1),
        "bf16_gb": round(len(todo) * rows * vocab * 2 / 1e9, 2),
        "disk_gb": round(_du(out / "logits") / 1e9, 2),
    }


def synthetic_run_row(run_id: str, name: str, cells: int, rows: int) -> dict:
    return R.run_row(
        run_id,
        "done",
        started_at=R.now(),
        finished_at=R.now(),
        spec_name=name,
        cells_total=cells,
        cells_done=cells,
        rows_written=rows,
    )


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--stacks", type=int, default=4, help="stacks, the reference included (default 4)")
    ap.add_argument("--rows", type=int, default=1000, help="rows per stack (default 1000)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompts", type=int, default=8, help="prompts the rows are spread over (row groups)")
    ap.add_argument("--kl", default="1e-4,1e-1", help="lo,hi of the stacks' target KL (log-spaced)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reference-rows", choices=("real", "synthetic"), default="real")
    a = ap.parse_args()
    lo, hi = (float(v) for v in a.kl.split(","))
    print(
        json.dumps(
            build(
                a.out,
                a.stacks,
                a.rows,
                a.vocab,
                a.prompts,
                (lo, hi),
                a.jobs,
                a.reference_rows,
                log=lambda m: print(m, file=sys.stderr),
            )
        )
    )


if __name__ == "__main__":
    main()
