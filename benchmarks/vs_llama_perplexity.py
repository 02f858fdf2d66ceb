"""logit-matrix against llama-perplexity on llama-perplexity's own job: KL(F16 || Q4_K_M) over its
scored half of each 512-token chunk of one text, the same two GGUFs, side by side in one run.

    llama-perplexity  -m F16 -f TEXT -c 512 --kl-divergence-base BASE     (the base pass)
                      -m Q4_K_M -c 512 --kl-divergence-base BASE --kl-divergence
    logit-matrix      matrix run (llamacpp f16 + q4_k_m, positions: llama_perplexity, store: bf16,
                      the text cut by `chunks: 512` with llama.cpp's tokenizer) [+ matrix analyze]

llama-perplexity is built from the vendor/llama.cpp of the installed llama-cpp-python's sdist
(CMake, -DGGML_NATIVE=OFF, like the Makefile's llama-cpp-python build), once, into the cache.

    .venv/bin/python benchmarks/vs_llama_perplexity.py [--text FILE] [--threads 2] [--llama-perplexity BIN]
                                                       [--modes analyze,in_actor] [--executors ray,local]

logit-matrix runs the job both ways in the same run: its two cells side by side then `matrix
analyze`, and `reference_metrics: in_actor` (the reference, then Q4_K_M measured against the
stored reference rows as it captures, as llama-perplexity's second pass does); each on every
executor asked for: a local Ray cluster started for the run, and the local executor (worker
processes, no Ray). The forwards alone, in one process, are the floor under any of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # 35 KB of license text: ~9k SmolLM2 tokens, 17 chunks


def build_llama_perplexity(log) -> Path:
    from benchmarks.llama_tools import build_tool

    return build_tool("llama-perplexity", log)


def timed(cmd: list[str], env: dict, log_to: Path) -> tuple[float, float, str]:
    """-> (wall seconds, peak RSS in GB of the process and its waited-for children, its output)."""
    with open(log_to, "w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # the child's own rusage, not every child's so far
        wall = time.perf_counter() - t0
    code, text = os.waitstatus_to_exitcode(status), Path(log_to).read_text()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {code}):\n{text[-3000:]}")
    return wall, usage.ru_maxrss / 1e6, text  # ru_maxrss: KiB on Linux


def ggufs(threads: int) -> tuple[dict, dict, object]:
    from backends.gguf_build import build_for
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    m = fetch(ModelRef("smollm2-135m", "catalog", "smollm2-135m"), log=lambda s: print(s, file=sys.stderr))
    return build_for("f16", m.hf_dir, m.weights_sha256, threads), build_for("q4_k_m", m.hf_dir, m.weights_sha256,
                                                                             threads), m


def run_llama(binary: Path, f16: str, q4: str, text: str, d: Path, threads: int) -> dict:
    base = d / "base.kld"
    common = ["-c", "512", "-t", str(threads), "--kl-divergence-base", str(base)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}  # a shared-library build keeps its .so beside it
    w1, m1, _ = timed([str(binary), "-m", f16, "-f", text, *common], env, d / "lp-base.log")
    w2, m2, out = timed([str(binary), "-m", q4, *common, "--kl-divergence"], env, d / "lp-kld.log")
    hit = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)\s+±\s+([0-9.eE+-]+)", out)
    if not hit:
        raise SystemExit(f"llama-perplexity printed no 'Mean KLD' line:\n{out[-2000:]}")
    return {"kl": float(hit[1]), "se": float(hit[2]), "wall": w1 + w2, "walls": (w1, w2), "peak_gb": max(m1, m2),
            "disk": base.stat().st_size, "base": base}


class ActorPeak:
    """The largest peak RSS (VmHWM) of any cell host while the run goes: a Ray actor is raylet's
    child, a local worker runs in its own session, so wait4 on the driver sees neither."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak_kb, self.stop = every, 0, threading.Event()

    def _poll(self) -> None:
        while not self.stop.wait(self.every):
            for proc in Path("/proc").iterdir():
                try:
                    cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
                    if b"StackActor" in cmdline or b"local_host.py" in cmdline:
                        hwm = re.search(r"VmHWM:\s+(\d+) kB", (proc / "status").read_text())
                        self.peak_kb = max(self.peak_kb, int(hwm.group(1)) if hwm else 0)
                except OSError:  # the process ended between listing and reading
                    continue

    @property
    def peak_gb(self) -> float:
        return self.peak_kb * 1024 / 1e9

    def __enter__(self):
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def run_matrix(f16: dict, text: str, d: Path, threads: int, via_analyze: bool, executor: str) -> dict:
    corpus = d / "corpus.yaml"
    corpus.write_text(json.dumps({"name": "vs-llama-perplexity", "prompts": [
        {"id": "text", "category": "long_context", "source": text, "file": str(Path(text).resolve()),
         "chunks": 512, "vocab": f16["path"]}]}))
    spec = d / "spec.yaml"
    spec.write_text(json.dumps({
        "name": "vs-llama-perplexity", "models": ["smollm2-135m"], "engines": ["llamacpp"],
        "dtypes": ["f16", "q4_k_m"], "attention": ["default"], "repeats": 1,
        "reference": {"engine": "llamacpp", "dtype": "f16", "attention": "default"},
        "positions": "llama_perplexity", "store": "bf16", "corpus": str(corpus),
        "centroid": {"definition": "none"},  # the job asks for KL against the reference only
        # in_actor: the reference first on every core, then Q4_K_M measured against its stored rows
        # as it captures (llama-perplexity's order); analyze: both side by side, then `matrix analyze`
        **({"threads": max(1, threads // 2)} if via_analyze else {"threads": threads, "reference_metrics": "in_actor"})}))
    wh = d / "wh"
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    matrix = [sys.executable, "-m", "matrix"]
    with ActorPeak() as actors:
        w1, m1, _ = timed([*matrix, "run", str(spec), "--warehouse", str(wh), "--executor", executor], env, d / "run.log")
    w2, m2 = 0.0, 0.0
    if via_analyze:
        w2, m2, _ = timed([*matrix, "analyze", "--warehouse", str(wh), "--workers", "1"], env, d / "analyze.log")
    from analysis.sql import connect

    con = connect(str(wh))
    row = con.execute("select s.kld_mean, s.kld_stderr, s.rows, s.storage_floor from summary s "
                      "where s.dtype = 'q4_k_m'").fetchone()
    ref = con.execute("select cell_id, storage from cells where is_reference").fetchone()
    names = con.execute("select name, token_ids from prompts").fetchall()
    ids = [t for _, t in sorted(names, key=lambda r: int(r[0].rsplit("-c", 1)[1]))]  # chunk order
    con.close()
    shard = sum(f.stat().st_size for f in (wh / "logits" / ref[0]).glob("*.parquet"))
    return {"kl": row[0], "se": row[1], "rows": row[2], "floor": row[3], "ref_floor": json.loads(ref[1])["storage_floor"],
            "wall": w1 + w2, "walls": (w1, w2), "peak_gb_run_driver": m1, "peak_gb_actor": actors.peak_gb,
            "peak_gb": m2 if via_analyze else actors.peak_gb, "peak_what": "analyze" if via_analyze else "actor",
            "disk": shard,
            "ids": ids}


def forwards_alone(model, artifacts: dict[str, dict], ids: list[list[int]], threads: int) -> dict[str, float]:
    """The floor under any tool that runs these forwards: each GGUF's prefill of every chunk through
    logit-matrix's own backend, in this process (no Ray, no rounding, no writes, no comparison)."""
    from backends.llamacpp_backend import LlamaCppBackend
    from common.positions import parse
    from common.stack import StackDesc

    keep, out = parse("llama_perplexity", "positions", print), {}
    for dtype, art in artifacts.items():
        be = LlamaCppBackend(StackDesc("llamacpp", dtype, "default", weights_sha256=model.weights_sha256),
                             model.hf_dir, threads)
        be.load()
        if be.artifact["path"] != art["path"]:  # the cells' own file, or the figure means nothing
            raise SystemExit(f"forwards alone: {dtype} loaded {be.artifact['path']}, not {art['path']}")
        t0 = time.perf_counter()
        for chunk in ids:
            be.forward(*keep.fed(chunk))  # what a cell feeds and keeps
        out[dtype] = time.perf_counter() - t0
        be.close()
    return out


MODES = {"analyze": "2 cells side by side, {half} thread(s) each, then matrix analyze",
         "in_actor": "reference_metrics: in_actor: the cells one after the other, {all} threads each"}


def table(lp: dict, lms: dict, alone: dict, modes: list[str], executors: list[str], threads: int) -> None:
    """The side-by-side figures, one column per tool (and logit-matrix mode and executor)."""
    for m in modes:
        print(f"  logit-matrix ({m}): {MODES[m].format(half=max(1, threads // 2), all=threads)}")
    rows = [("", "llama-perplexity", *[f"logit-matrix ({m}, {ex})" for m, ex in lms])]
    rows.append(("KL(F16 || Q4_K_M) mean ± s.e.", f"{lp['kl']:.6f} ± {lp['se']:.6f}",
                 *[f"{lm['kl']:.6f} ± {lm['se']:.6f} ({abs(lp['kl'] - lm['kl']) / max(lp['se'], lm['se']):.2f} s.e.)"
                   for lm in lms.values()]))
    rows.append(("wall time (s)", f"{lp['wall']:.1f} ({lp['walls'][0]:.1f} + {lp['walls'][1]:.1f})",
                 *[f"{lm['wall']:.1f} = {lm['wall'] / lp['wall']:.2f}x" + (f" ({lm['walls'][0]:.1f} run + "
                   f"{lm['walls'][1]:.1f} analyze)" if m == "analyze" else " (run)") for (m, _), lm in lms.items()]))
    rows.append(("disk, reference rows (MB)", f"{lp['disk'] / 1e6:.1f} (uint16 base file)",
                 *[f"{lm['disk'] / 1e6:.1f} = {lm['disk'] / lp['disk']:.2f}x (bf16, floor {lm['ref_floor']:.1e})"
                   for lm in lms.values()]))
    rows.append(("peak memory (GB)", f"{lp['peak_gb']:.2f}",
                 *[f"{lm['peak_gb']:.2f} {lm['peak_what']} = {lm['peak_gb'] / lp['peak_gb']:.2f}x (driver "
                   f"{lm['peak_gb_run_driver']:.2f}, actor {lm['peak_gb_actor']:.2f})" for lm in lms.values()]))
    rows.append(("the forwards alone (s)", "", *[f"{sum(alone.values()):.1f} = {sum(alone.values()) / lp['wall']:.2f}x "
                 f"(F16 {alone['f16']:.1f} + Q4_K_M {alone['q4_k_m']:.1f}; in-process, {threads} threads)"] * len(lms)))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(f"{c:{w[i]}}" for i, c in enumerate(r)).rstrip())
    floor = sum(alone.values()) / lp["wall"]
    for m in modes:
        print(f"wall time / llama-perplexity's ({m}): " + ", ".join(
            f"{ex} {lms[(m, ex)]['wall'] / lp['wall']:.2f}x" for ex in executors) + f"; the forwards alone {floor:.2f}x")
    print("targets: KL within 1 s.e.; wall <= 1.0x; disk <= 0.65x (bf16, floor printed); analysis peak <= 2 GB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-perplexity", help="a built binary (default: build it from the sdist once)")
    ap.add_argument("--keep", help="keep the work directory here")
    ap.add_argument("--modes", default="analyze,in_actor", help=f"logit-matrix's ways, comma-separated: {', '.join(MODES)}")
    ap.add_argument("--executors", default="ray,local", help="where its cells run, comma-separated: ray, local")
    args = ap.parse_args()
    from benchmarks._common import cpu

    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: expected some of {', '.join(MODES)} (got {args.modes!r})")
    executors = [e for e in args.executors.split(",") if e]
    if not executors or set(executors) - {"ray", "local"}:
        raise SystemExit(f"--executors: expected some of ray, local (got {args.executors!r})")
    binary = Path(args.llama_perplexity) if args.llama_perplexity else build_llama_perplexity(print)
    f16, q4, model = ggufs(args.threads)
    d = Path(args.keep or tempfile.mkdtemp(prefix="vs-lp-"))
    d.mkdir(parents=True, exist_ok=True)
    lp = run_llama(binary, f16["path"], q4["path"], args.text, d, args.threads)
    lms = {}
    for m in modes:
        for ex in executors:
            (d / m / ex).mkdir(parents=True, exist_ok=True)
            lms[(m, ex)] = run_matrix(f16, args.text, d / m / ex, args.threads, m == "analyze", ex)
    from store import llamacpp_kld as K

    base = K.read(lp["base"])
    chunks = [list(map(int, t)) for t in base["tokens"]]  # llama-perplexity's own chunk ids
    alone = forwards_alone(model, {"f16": f16, "q4_k_m": q4}, chunks, args.threads)
    same = all(chunks == [list(t) for t in lm["ids"]] for lm in lms.values())
    print(f"\nCPU: {cpu()}; llama-perplexity {args.threads} threads; text {args.text}: {base['n_chunk']} chunks of 512, "
          f"{next(iter(lms.values()))['rows']} scored rows; chunk ids identical to llama-perplexity's: "
          f"{'yes' if same else 'NO'}")
    table(lp, lms, alone, modes, executors, args.threads)
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
