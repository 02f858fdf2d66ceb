"""How `matrix analyze` scales with the warehouse: peak memory, wall time, Ray workers, increments.

    python benchmarks/analysis_scale.py [--dir /tmp/analysis-scale] [--stacks 4,8,16,24] [--rows 1000]
                                        [--vocab 151936] [--workers-at 8] [--incremental-at 16]

One synthetic warehouse of max(--stacks) stacks is built (benchmarks/synthetic_warehouse.py: real
SmolLM2 rows widened to the vocabulary, bf16); every size is a hard-linked subset of it, so the
shards are the same bytes. Each analyze is a fresh `matrix analyze` process; its peak RSS comes
from wait4 (the process's own high-water mark). Printed side by side:

  - peak RSS and wall time per size (target: peak RSS <= 2 GB and flat in stacks and rows);
  - --force at --workers-at stacks with 1 and with 2 Ray workers on one running cluster (target:
    >= 1.7x), and beside them one core in-process without Ray and 2 workers on a cluster analyze
    starts itself (Ray's start and each worker's kernel load included);
  - a second analyze after adding one stack to --incremental-at stacks, as a fraction of the
    first (target <= 0.2).
A Ray worker's memory is its own process's, not the driver's: the RSS column is the in-process runs'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cpu, save_result  # noqa: E402
from benchmarks.synthetic_warehouse import build  # noqa: E402
from store import Warehouse  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("metrics", "centroid_metrics", "pairwise", "metrics_ranges")
TARGET_RSS_GB, TARGET_SPEEDUP, TARGET_INCREMENT = 2, 1.7, 0.2


def subset(base: Path, dst: Path, n: int) -> None:
    """dst: the first n stacks of base (the reference is stack 0), hard links, no analysis outputs."""
    shutil.rmtree(dst, ignore_errors=True)
    cells = sorted(Warehouse(base).read_all("cells"), key=lambda c: c["attention"])[:n]
    keep = {c["cell_id"] for c in cells}
    for f in base.rglob("*"):
        rel = f.relative_to(base)
        top = rel.parts[0]
        if f.is_dir() or top in OUTPUTS or top == ".lock" or (top in ("cells", "logits") and _cell_of(rel) not in keep):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(f, dst / rel)
    for t in OUTPUTS:
        (dst / t).mkdir(parents=True, exist_ok=True)


def add_stack(base: Path, dst: Path, k: int) -> None:
    """Link stack k of base into dst (as a later sweep would add one cell)."""
    cell = sorted(Warehouse(base).read_all("cells"), key=lambda c: c["attention"])[k]["cell_id"]
    for f in [base / "cells" / f"{cell}.parquet", *(base / "logits" / cell).iterdir()]:
        rel = f.relative_to(base)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(f, dst / rel)


def group_floor(wh: Path, k: int, sample: int = 2) -> tuple[float, int]:
    """The floor under the increment: the group's own work after stack k joined it (every member's
    rows read, the centroid with its float64 arithmetic, the new member's pairs), in this
    process on its default threads like `--workers 1`, timed over the first `sample` prompts and
    scaled to all of them. No imports, planning or writes. -> (seconds, positions)."""
    from analysis.centroid import group_rows
    from store.stream import shard_index

    w = Warehouse(wh)
    ids = [c["cell_id"] for c in sorted(w.read_all("cells"), key=lambda c: c["attention"])[: k + 1]]
    idx = shard_index(w, ids[0], 0)
    counts = {p: len(v.positions) for p, v in idx.prompts.items()}
    some, pairs = list(counts)[:sample], [sorted([ids[k], o]) for o in ids[:k]]
    group_rows(w, ids, "mean_prob", "floor", some[:1], pairs[:1])  # the kernel's first call is not the floor
    t0 = time.perf_counter()
    group_rows(w, ids, "mean_prob", "floor", some, pairs)
    return (time.perf_counter() - t0) * sum(counts.values()) / sum(counts[p] for p in some), sum(counts.values())


def incremental(base: Path, where: Path, k: int) -> tuple[dict, dict, float, float]:
    """A second analyze after one stack joins k analysed ones, and beside it its floor (group_floor);
    -> (first, second, second / first, the floor's seconds)."""
    inc = where / f"inc{k}"
    subset(base, inc, k)
    first = analyze(inc, "--workers", "1")
    add_stack(base, inc, k)
    second = analyze(inc, "--workers", "1")
    frac = second["seconds"] / first["seconds"]
    print(
        f"  one stack added to {k}: first analyze {first['seconds']} s (peak RSS {first['peak_rss_gb']:.2f} GB), "
        f"second {second['seconds']} s = {frac:.2f} of the first (target <= {TARGET_INCREMENT}); computed "
        f"{second['summary']['computed']}",
        flush=True,
    )
    floor, positions = group_floor(inc, k)
    print(
        f"  beside it, the group's own work alone (its {k + 1} members' rows read, the float64 centroid, the "
        f"{k} new pairs; in this process, sampled): {floor:.1f} s for {positions} positions = "
        f"{floor / first['seconds']:.2f} of the first analyze: the floor under the increment while the "
        f"centroid is computed over every member again",
        flush=True,
    )
    return first, second, frac, floor


def _cell_of(rel: Path) -> str:
    return rel.parts[1] if rel.parts[0] == "logits" else rel.stem


def analyze(wh: Path, *extra: str, threads: int | None = None) -> dict:
    """One `matrix analyze` process: wall seconds, its peak RSS in GB, and its JSON summary.
    threads: torch's threads in that process (a Ray task always has one)."""
    t0 = time.perf_counter()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    p = subprocess.Popen(
        [sys.executable, "-m", "matrix", "analyze", "--warehouse", str(wh), "--json", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        env=env,
    )
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"matrix analyze --warehouse {wh} {' '.join(extra)} failed")
    return {"seconds": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "summary": json.loads(out)}


@contextlib.contextmanager
def ray_head(tmp: Path):
    """A one-node Ray cluster with this machine's CPUs, on loopback only (so without auth)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # nothing listens beyond 127.0.0.1
    tmp.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={os.cpu_count() or 1}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=open(tmp / "ray-head.log", "w"),
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while subprocess.run([ray, "status", f"--address={address}"], env=env, capture_output=True).returncode:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"ray start --head did not come up (see {tmp / 'ray-head.log'})")
            time.sleep(1)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def workers(base: Path, where: Path, k: int) -> dict:
    """--force at k stacks: one core in-process without Ray, 2 workers on a cluster analyze starts
    itself, then 1 against 2 workers on one running cluster (the same fixed costs on both sides)."""
    w = where / f"n{k}"
    if not (w / "cells").exists():
        subset(base, w, k)
    core = analyze(w, "--force", "--workers", "1", threads=1)  # one core in this process, no Ray
    local = analyze(w, "--force", "--workers", "2")  # a Ray cluster of its own, started and stopped
    with ray_head(where) as address:
        one = analyze(w, "--force", "--address", address, "--workers", "1")
        two = analyze(w, "--force", "--address", address, "--workers", "2")
    print(
        f"  --force at {k} stacks on a running Ray cluster: 1 worker {one['seconds']} s, 2 workers "
        f"{two['seconds']} s (speed-up {one['seconds'] / two['seconds']:.2f}x; target >= {TARGET_SPEEDUP}x); one "
        f"core in this process without Ray {core['seconds']} s, 2 workers on a cluster analyze starts itself "
        f"{local['seconds']} s ({core['seconds'] / local['seconds']:.2f}x: Ray's start and each worker's "
        f"kernel load included)",
        flush=True,
    )
    return {"one": one, "two": two, "core": core, "local": local}


def record(a, sizes: list[dict], wk: dict | None, inc: tuple | None) -> None:
    """One row per measured configuration; met over the parts this run measured."""
    common, rows, targets, checks = {"rows": a.rows, "vocab": a.vocab}, [], [], []
    for r in sizes:
        rows.append(
            {
                "config": "analyze",
                "stacks": r["stacks"],
                "seconds": r["seconds"],
                "peak_rss_gb": r["peak_rss_gb"],
                "metric_rows": r["summary"]["metric_rows"],
                **common,
            }
        )
    if sizes:
        targets.append(f"peak RSS <= {TARGET_RSS_GB} GB at every size")
        checks.append(max(r["peak_rss_gb"] for r in sizes) <= TARGET_RSS_GB)
    if wk:
        sec = {k: v["seconds"] for k, v in wk.items()}
        rows.append(
            {
                "config": "2 vs 1 Ray workers",
                "stacks": a.workers_at,
                "seconds": sec["two"],
                "ratio": sec["one"] / sec["two"],
                "one_worker_s": sec["one"],
                "one_core_in_process_s": sec["core"],
                "two_own_cluster_s": sec["local"],
                "own_cluster_ratio": sec["core"] / sec["local"],
                **common,
            }
        )
        targets.append(f"2 Ray workers >= {TARGET_SPEEDUP}x 1 worker")
        checks.append(rows[-1]["ratio"] >= TARGET_SPEEDUP)
    if inc:
        first, second, frac, floor = inc
        rows.append(
            {
                "config": "one stack added",
                "stacks": a.incremental_at,
                "seconds": second["seconds"],
                "peak_rss_gb": second["peak_rss_gb"],
                "ratio": frac,
                "first_s": first["seconds"],
                "floor_ratio": floor / first["seconds"],
                **common,
            }
        )
        targets.append(f"the second analyze <= {TARGET_INCREMENT} of the first")
        checks.append(frac <= TARGET_INCREMENT)
    met = all(checks) if checks else None
    print(f"recorded: {save_result('analysis_scale', rows, '; '.join(targets) or 'no part measured', met)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/analysis-scale"))
    ap.add_argument("--stacks", default="4,8,16,24")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--workers-at", type=int, default=8, help="stacks of the 1-vs-2-workers comparison (0: skip it)")
    ap.add_argument("--incremental-at", type=int, default=16, help="stacks before one is added (0: skip it)")
    ap.add_argument("--reference-rows", choices=("real", "synthetic"), default="real")
    a = ap.parse_args()
    sizes = sorted({int(s) for s in a.stacks.split(",") if s.strip()})
    top = max(sizes + [a.incremental_at + 1, a.workers_at])
    err = lambda m: print(m, file=sys.stderr)  # noqa: E731
    base = a.dir / f"base-{top}x{a.rows}x{a.vocab}"
    made = build(base, top, a.rows, a.vocab, 8, (1e-4, 1e-1), os.cpu_count() or 1, a.reference_rows, log=err)
    print(f"CPU: {cpu()}\nwarehouse: {top} stacks x {a.rows} rows x {a.vocab} vocab, bf16 ({made})")
    rows = []
    for n in sizes:
        subset(base, a.dir / f"n{n}", n)
        r = analyze(a.dir / f"n{n}", "--workers", "1")
        rows.append({"stacks": n, **r})
        print(
            f"  {n:3d} stacks: {r['seconds']:7.1f} s, peak RSS {r['peak_rss_gb']:.2f} GB, "
            f"{r['summary']['metric_rows']} metric rows",
            flush=True,
        )
    wk = workers(base, a.dir, a.workers_at) if a.workers_at else None
    one, two, core, local = (wk[k] if wk else {"seconds": None} for k in ("one", "two", "core", "local"))
    inc = incremental(base, a.dir, a.incremental_at) if a.incremental_at else None
    first, second, frac = inc[:3] if inc else ({"seconds": None}, {"seconds": None}, None)
    if rows:
        print(f"peak RSS over every size: {max(r['peak_rss_gb'] for r in rows):.2f} GB (target <= {TARGET_RSS_GB} GB)")
    print(
        json.dumps(
            {
                "cpu": cpu(),
                "rows": a.rows,
                "vocab": a.vocab,
                "sizes": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
                "workers": {
                    "stacks": a.workers_at,
                    "one": one["seconds"],
                    "two": two["seconds"],
                    "one_core_in_process": core["seconds"],
                    "two_own_cluster": local["seconds"],
                },
                "incremental": {
                    "stacks": a.incremental_at,
                    "first": first["seconds"],
                    "second": second["seconds"],
                    "fraction": frac and round(frac, 3),
                },
            }
        )
    )
    record(a, rows, wk, inc)


if __name__ == "__main__":
    main()
