"""Capture + store time over bare forward time, on the same loaded stack.

Rounds alternate (bare, capture, bare, capture, ...) so drift in machine load
hits both sides; the figure is the ratio of the medians. Target: <= 1.10.

    .venv/bin/python benchmarks/capture_overhead.py [--dtype bf16] [--attention sdpa] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import cpu, load_backend, model_and_prompts, save_result

TARGET = 1.10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stride", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m", help="a catalog model (gemma3-270m: a 262,144-token vocabulary)")
    ap.add_argument("--max-tokens", type=int, default=None, help="feed only each prompt's first N tokens")
    args = ap.parse_args()
    from actors.capture import capture_shard
    from common.positions import Positions
    from store.warehouse import ShardWriter

    resolved, prompts = model_and_prompts(args.model)
    prompts = [(pid, ids[: args.max_tokens]) for pid, ids in prompts]
    print(f"{args.model} on {cpu()}")
    be = load_backend(resolved.hf_dir, args.dtype, args.attention)
    plan = [(ids, Positions.every(args.stride).of(len(ids))) for _, ids in prompts]
    be.forward(*plan[0])  # warm-up: first-call allocations are not what we measure
    bare, full = [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for ids, pos in plan:
                be.forward(ids, pos)
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m = capture_shard(be, ShardWriter(d, "bench", "cell", r), prompts, args.stride)
            full.append(time.perf_counter() - t0)
            print(
                f"round {r + 1}/{args.rounds}: bare forward {bare[-1]:.2f}s, "
                f"capture + store {full[-1]:.2f}s ({m['rows']} rows)",
                flush=True,
            )
    ratio = statistics.median(full) / statistics.median(bare)
    ok = "meets" if ratio <= TARGET else "MISSES"
    print(
        f"\nhf {args.dtype} {args.attention}, {be.threads} threads, built-in corpus: "
        f"capture+store / bare forward = {ratio:.3f} -> {ok} the <= {TARGET} target"
    )
    row = {
        "model": args.model,
        "dtype": args.dtype,
        "attention": args.attention,
        "threads": be.threads,
        "rows": m["rows"],
        "rounds": args.rounds,
        "ratio": ratio,
        "bare_s": statistics.median(bare),
        "capture_s": statistics.median(full),
    }
    target = f"capture + store <= {TARGET}x the bare forward on the same loaded stack"
    print(f"recorded: {save_result('capture_overhead', [row], target, ratio <= TARGET)}")


if __name__ == "__main__":
    main()
