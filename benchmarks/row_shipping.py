"""Rows shipped through the driver's depot vs. written where they are made, and the depot's memory.

1. The same capture (real SmolLM2-135M weights, cut to --layers; the first --prompts prompts of
   the built-in corpus) inside one Ray actor, into a local ShardWriter (a) and through a
   RemoteShard to a DriverDepot (b), rounds alternating a, b, a, b so drift hits both sides.
   Target: median(b) / median(a) <= 1.15, and both shards hold the same rows.
2. The depot's peak RSS while 4 actors stream synthetic fp32 rows (vocab 49152) for N prompts
   each, per N in --sizes, sampled every 0.2 s from the driver. Target: flat (largest N over
   smallest ~ 1.0x, recorded as met up to 1.25x): the depot holds one row group per capture, not the sweep.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/row_shipping.py [--rounds 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import ray
from _common import cpu, model_and_prompts, save_result

TARGET_RATIO = 1.15
# "flat" read as a number: a depot that held the sweep would grow with the bytes (16x over the
# default sizes), one that holds a row group per capture stays within allocator noise of this
FLAT = 1.25
VOCAB = 49152  # SmolLM2's vocabulary
STREAMERS = 4


@ray.remote(num_cpus=1)
class Capturer:
    """One loaded HF stack; captures into a local shard or through the depot, timed in here."""

    def __init__(self, model_dir: str, dtype: str, attention: str, threads: int):
        from backends.hf_backend import HFBackend
        from common.stack import StackDesc

        self.be = HFBackend(StackDesc.of(HFBackend.engine, dtype, attention), model_dir, threads)
        self.be.load()

    def capture(self, prompts, stride: int, cell_id: str, repeat: int, root: str | None = None, depot=None) -> float:
        from actors.capture import capture_shard
        from actors.depot import RemoteShard
        from store.warehouse import ShardWriter

        t0 = time.perf_counter()
        writer = (
            ShardWriter(root, "bench", cell_id, repeat)
            if depot is None
            else RemoteShard(depot, "bench", cell_id, repeat)
        )
        capture_shard(self.be, writer, prompts, stride)
        return time.perf_counter() - t0


class SyntheticBackend:
    """forward() -> (rows, VOCAB) fp32 normal logits from a fixed seed: memory, not numerics."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def forward(self, ids, positions) -> np.ndarray:
        return self.rng.standard_normal((len(positions), VOCAB), dtype=np.float32) * 3.0


@ray.remote(num_cpus=1)
class Streamer:
    def stream(self, depot, seed: int, cell_id: str, repeat: int, prompts: int, rows: int) -> dict:
        from actors.capture import capture_shard
        from actors.depot import RemoteShard

        writer = RemoteShard(depot, "bench", cell_id, repeat)
        fake = [(f"p{i}", list(range((rows - 1) * 8 + 1))) for i in range(prompts)]  # stride 8: `rows` rows
        m = capture_shard(SyntheticBackend(seed), writer, fake, 8)
        return {"rows": m["rows"], "bytes": writer.bytes}


def proc_kib(pid: int | str, key: str) -> int:
    """VmRSS / VmHWM of a process in KiB (0 once it is gone)."""
    try:
        for ln in open(f"/proc/{pid}/status"):
            if ln.startswith(key + ":"):
                return int(ln.split()[1])
    except OSError:
        pass
    return 0


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def shipping_rounds(args, model_dir: str, prompts, root: str) -> tuple[list[float], list[float]]:
    from actors.depot import DriverDepot, depot_options

    depot = DriverDepot.options(**depot_options(ray.get_runtime_context().get_node_id())).remote(root)
    cap = Capturer.remote(model_dir, "fp32", "sdpa", 1)
    ray.get(depot.stats.remote())
    # warm-up round, not counted: first-call allocations and imports on both sides
    ray.get(cap.capture.remote(prompts, args.stride, "warm-local", 0, root=root))
    ray.get(cap.capture.remote(prompts, args.stride, "warm-remote", 0, depot=depot))
    local, remote = [], []
    for r in range(args.rounds):
        local.append(ray.get(cap.capture.remote(prompts, args.stride, "local", r, root=root)))
        remote.append(ray.get(cap.capture.remote(prompts, args.stride, "remote", r, depot=depot)))
        print(
            f"  round {r + 1}/{args.rounds}: (a) local ShardWriter {local[-1]:.2f}s, "
            f"(b) RemoteShard -> depot {remote[-1]:.2f}s",
            flush=True,
        )
    ray.kill(cap)
    ray.kill(depot)
    return local, remote


def same_rows(root: str, rounds: int) -> bool:
    from store.warehouse import Warehouse

    wh = Warehouse(root)
    cols = ["prompt_id", "position", "row_hash"]
    want = wh.read_shard("local", 0, cols).to_pydict()
    return all(wh.read_shard(c, r, cols).to_pydict() == want for c in ("local", "remote") for r in range(rounds))


def part_shipping(args) -> dict:
    from common.positions import Positions
    from matrix.spec.models import cut_layers

    resolved, prompts = model_and_prompts()
    prompts = prompts[: args.prompts]
    rows = sum(len(Positions.every(args.stride).of(len(ids))) for _, ids in prompts)
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(cut_layers(Path(resolved.hf_dir), Path(d) / "model", args.layers))
        print(
            f"\n1. capture into a local shard (a) vs. rows shipped to the driver's depot (b)\n"
            f"  SmolLM2-135M cut to {args.layers} layers, hf fp32 sdpa, 1 thread; {len(prompts)} "
            f"prompts ({sum(len(i) for _, i in prompts)} tokens), stride {args.stride}: "
            f"{rows} rows x {VOCAB} per capture",
            flush=True,
        )
        local, remote = shipping_rounds(args, model_dir, prompts, str(Path(d) / "wh"))
        ratio = statistics.median(remote) / statistics.median(local)
        same = same_rows(str(Path(d) / "wh"), args.rounds)
        print(
            f"  median (a) {statistics.median(local):.2f}s, median (b) {statistics.median(remote):.2f}s"
            f"\n  (b) / (a) = {ratio:.3f}x  (target <= {TARGET_RATIO}x: "
            f"{'meets' if ratio <= TARGET_RATIO else 'MISSES'} it)"
            f"\n  identical rows: {'yes' if same else 'NO'}"
        )
    return {
        "part": "shipping",
        "ratio": ratio,
        "rows": rows,
        "local_s": statistics.median(local),
        "remote_s": statistics.median(remote),
        "identical": same,
        "layers": args.layers,
        "rounds": args.rounds,
    }


def sample_peaks(pids: dict[str, int], stop: threading.Event, peaks: dict[str, int]) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            for key in ("VmRSS", "RssAnon"):
                peaks[name, key] = max(peaks.get((name, key), 0), proc_kib(pid, key))
        stop.wait(0.2)


def stream_size(streamers, n: int, rows: int) -> dict:
    """A fresh depot; every streamer sends n prompts of `rows` rows; the peaks seen meanwhile."""
    from actors.depot import DriverDepot, depot_options

    with tempfile.TemporaryDirectory() as d:
        depot = DriverDepot.options(**depot_options(ray.get_runtime_context().get_node_id())).remote(d)
        pid = ray.get(depot.stats.remote())["pid"]
        idle = proc_kib(pid, "VmRSS")
        peaks: dict[str, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_peaks, args=({"depot": pid, "driver": os.getpid()}, stop, peaks))
        sampler.start()
        t0 = time.perf_counter()
        try:
            done = ray.get(
                [s.stream.remote(depot, 1000 + i, f"cell{i}", i % 2, n, rows) for i, s in enumerate(streamers)]
            )
        finally:
            stop.set()
            sampler.join()
        seconds = time.perf_counter() - t0
        hwm = proc_kib(pid, "VmHWM")
        ray.kill(depot)
    return {
        "rows": sum(x["rows"] for x in done),
        "bytes": sum(x["bytes"] for x in done),
        "idle": idle,
        "peak": max(peaks.get(("depot", "VmRSS"), 0), hwm),
        "sampled": peaks.get(("depot", "VmRSS"), 0),
        "anon": peaks.get(("depot", "RssAnon"), 0),
        "driver": peaks.get(("driver", "VmRSS"), 0),
        "seconds": seconds,
    }


def part_memory(args) -> list[dict]:
    print(
        f"\n2. depot memory while {STREAMERS} actors stream synthetic fp32 rows "
        f"({args.rows} rows x {VOCAB} per prompt) through RemoteShard",
        flush=True,
    )
    streamers = [Streamer.remote() for _ in range(STREAMERS)]
    print("  depot peak = max(sampled VmRSS, VmHWM); anon = sampled RssAnon, without object-store pages")
    print(
        f"  {'N/actor':>7} {'rows':>7} {'bytes sent':>15} {'time':>7} {'depot idle':>11} "
        f"{'depot peak':>11} {'(sampled)':>10} {'(anon)':>9} {'driver peak':>12}"
    )
    results = {}
    for n in args.sizes:
        r = results[n] = stream_size(streamers, n, args.rows)
        print(
            f"  {n:>7} {r['rows']:>7,} {r['bytes']:>15,} {r['seconds']:>6.1f}s {mib(r['idle']):>11} "
            f"{mib(r['peak']):>11} {mib(r['sampled']):>10} {mib(r['anon']):>9} {mib(r['driver']):>12}",
            flush=True,
        )
    for s in streamers:
        ray.kill(s)
    lo, hi = results[min(args.sizes)], results[max(args.sizes)]
    ratio = hi["peak"] / lo["peak"]
    print(
        f"  depot peak RSS at N={max(args.sizes)} / N={min(args.sizes)}: {ratio:.2f}x "
        f"({hi['bytes'] / lo['bytes']:.0f}x the bytes; target: flat, ~1.0x); anonymous (heap) "
        f"peak {hi['anon'] / lo['anon']:.2f}x"
        + "".join(
            f"\n  depot peak RSS at N={max(args.sizes)} / N={n}: {hi['peak'] / results[n]['peak']:.2f}x"
            for n in sorted(args.sizes)[1:-1]
        )
        + " (one run each: the smallest size may end before the allocator's pools are warm)"
        f"\n  driver process: peak RSS while streaming {mib(max(r['driver'] for r in results.values()))}, "
        f"VmHWM over the whole script {mib(proc_kib('self', 'VmHWM'))}"
    )
    return [
        {
            "part": "depot memory",
            "ratio": r["peak"] / lo["peak"],
            "rows": r["rows"],
            "prompts_per_actor": n,
            "bytes": r["bytes"],
            "seconds": r["seconds"],
            "idle_mib": r["idle"] / 1024,
            "peak_mib": r["peak"] / 1024,
            "anon_mib": r["anon"] / 1024,
            "driver_mib": r["driver"] / 1024,
        }
        for n, r in sorted(results.items())
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="first K prompts of the built-in corpus")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64], help="prompts per streaming actor")
    ap.add_argument("--rows", type=int, default=16, help="synthetic rows per prompt")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print(f"CPU: {cpu()}", flush=True)
    t0 = time.perf_counter()
    # logical CPUs: room for the 4 streamers even on a 2-core box (they take turns on the cores)
    ray.init(
        address="local",
        num_cpus=max(STREAMERS, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        rows = [part_shipping(args), *part_memory(args)]
    finally:
        ray.shutdown()
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    # the shipping row's ratio is (b) / (a); a memory row's is its depot peak over the smallest N's
    met = rows[0]["ratio"] <= TARGET_RATIO and rows[0]["identical"] and rows[-1]["ratio"] <= FLAT
    target = (
        f"rows through the driver's depot <= {TARGET_RATIO}x written locally, the same rows; "
        f"depot peak RSS flat in N (largest / smallest <= {FLAT}x)"
    )
    print(f"recorded: {save_result('row_shipping', rows, target, met)}")


if __name__ == "__main__":
    main()
