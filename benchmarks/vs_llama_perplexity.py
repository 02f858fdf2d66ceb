"""`matrix kld` against llama-perplexity on llama-perplexity's own job: KL(F16 || Q4_K_M) over its
scored half of each 512-token chunk (--n-ctx) of one text, the same two GGUFs, both tools in one run, for
each model asked for (SmolLM2-135M: 49,152 logits a row; Gemma 3 270M: 262,144).

    llama-perplexity  -m F16 -f TEXT -c 512 --kl-divergence-base BASE     (the base pass)
                      -m Q4_K_M -c 512 --kl-divergence-base BASE --kl-divergence
    logit-matrix      matrix kld --reference F16 --candidate Q4_K_M --text TEXT --n-ctx 512

llama-perplexity is built from the vendor/llama.cpp of the installed llama-cpp-python's sdist with
the flags that binding was built with (benchmarks/llama_tools.py), once, into the cache.

    .venv/bin/python benchmarks/vs_llama_perplexity.py [--models smollm2-135m,gemma3-270m] [--text FILE]
        [--chunks smollm2-135m=0,gemma3-270m=6] [--n-ctx 512] [--threads N] [--executor local|ray]
        [--llama-perplexity BIN] [--repeat N]

--n-ctx sets both tools' chunk length. llama-perplexity decodes n_batch / n_ctx chunks a batch (4 at
512, with attention over the whole batch's cache), one at 2048 and above, as logit-matrix does at any.

Each tool runs --repeat times, in turn, and its best wall time counts: on a shared machine a run
can lose seconds to other work, and taking each tool's best compares what each does itself.

Beside the two wall times: the forwards alone (each GGUF's prefill of every chunk through
logit-matrix's llama.cpp backend, in this process, one after another on every thread as
llama-perplexity runs them; a capture's lanes run two at once where a prompt's rows are small,
actors/lanes.py, so it can take less), and
what each stored row costs on top of its forward at that vocabulary (ms per row): rounding to bf16
with its KL floor, encoding (row hash, Parquet pages, the shard file), and the comparison with the reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.capture_costs import forwards_alone, per_row_costs  # noqa: E402
from benchmarks.kld_common import (  # noqa: E402
    MATRIX_ENV,
    USER_ENV,
    bytecode,
    catalog_ggufs,
    kld_command,
    kld_results,
    llama_figures,
)
from benchmarks.process_watch import ActorPeak, timed  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # 35 KB of license text: ~9k SmolLM2 tokens, 17 chunks
DEFAULT_CHUNKS = {"gemma3-270m": 6}  # 0 or absent: every chunk of the text


def ggufs(model: str, threads: int) -> tuple[dict, dict, object]:
    """(F16, Q4_K_M) GGUFs of a catalog model, built once into the artifact cache, and the model."""
    built, m = catalog_ggufs(model, ("f16", "q4_k_m"), threads)
    return built["f16"], built["q4_k_m"], m


def cut_text(text: str, vocab: str, chunks: int, d: Path, n_ctx: int = 512) -> str:
    """The text, or its first part holding `chunks` chunks of n_ctx llama.cpp tokens (a few tokens
    spare), so both tools read one file of that many chunks."""
    from backends.llama_binding import gguf_tokenize

    whole = Path(text).read_text()
    if not chunks:
        return text
    n = len(gguf_tokenize(vocab, whole)[0])
    cut = whole[: int(len(whole) * min(1.0, (chunks * n_ctx + 64) / n))]
    while len(gguf_tokenize(vocab, cut)[0]) // n_ctx > chunks:
        cut = cut[: int(len(cut) * 0.98)]
    out = d / f"text-{chunks}x{n_ctx}.txt"
    out.write_text(cut)
    return str(out)


def run_llama(binary: Path, f16: str, q4: str, text: str, d: Path, threads: int, n_ctx: int) -> dict:
    base = d / "base.kld"
    common = ["-c", str(n_ctx), "-t", str(threads), "--kl-divergence-base", str(base)]
    env = {**USER_ENV, "LD_LIBRARY_PATH": str(binary.parent)}  # a shared-library build keeps its .so beside it
    w1, m1, _ = timed([str(binary), "-m", f16, "-f", text, *common], env, d / "lp-base.log")
    w2, m2, out = timed([str(binary), "-m", q4, *common, "--kl-divergence"], env, d / "lp-kld.log")
    figures = llama_figures(out)
    if figures is None or figures["ppl_ratio"] is None:
        raise SystemExit(f"llama-perplexity printed no 'Mean KLD' or PPL ratio line:\n{out[-2000:]}")
    return {
        **figures,
        "wall": w1 + w2,
        "walls": (w1, w2),
        "peak_gb": max(m1, m2),
        "disk": base.stat().st_size,
        "base": base,
    }


def run_kld(f16: dict, q4: dict, text: str, d: Path, threads: int, executor: str, n_ctx: int) -> dict:
    """`matrix kld` as a user runs it, from a fresh process; -> its figures and the chunk ids it cut."""
    wh = d / "wh"
    for old in (wh, d / "wh.kld.yaml", d / "wh.kld-corpus.yaml"):  # a kept directory's last job: captured again
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    cmd = kld_command(f16["path"], [q4["path"]], text, n_ctx, threads, str(wh), executor)
    with ActorPeak() as actors:
        wall, driver_gb, out = timed(cmd, MATRIX_ENV, d / "kld.log", actors)
    res = kld_results(out)[0]
    from analysis.sql import connect

    con = connect(str(wh))
    ref = con.execute("select cell_id from cells where is_reference").fetchone()[0]
    names = con.execute("select name, token_ids from prompts").fetchall()
    con.close()
    ids = [t for _, t in sorted(names, key=lambda r: int(r[0].rsplit("-c", 1)[1]))]  # chunk order
    st = res["statistics"]
    return {
        "kl": st["kld"][0],
        "se": st["kld"][1],
        "ppl_ratio": tuple(st["ppl_ratio"]),
        "rows": st["rows"],
        "wall": wall,
        "peak_gb": actors.peak_kb * 1024 / 1e9,
        "driver_gb": driver_gb,
        "disk": sum(f.stat().st_size for f in (wh / "logits" / ref).glob("*.parquet")),
        "cand_disk": sum(f.stat().st_size for f in (wh / "logits" / res["cell_id"]).glob("*.parquet")),
        "floor": res["card"]["disclosure"]["storage_floor"],
        "ids": ids,
    }


def best_of(runs: list[dict]) -> dict:
    """The last run's figures with the best wall time of all (the least disturbed by the machine's
    other work) and every run's wall time."""
    best = min(runs, key=lambda x: x["wall"])
    return {**runs[-1], "wall": best["wall"], "walls": best.get("walls"), "runs": [x["wall"] for x in runs]}


def one_model(model: str, binary: Path, text: str, chunks: int, d: Path, args: argparse.Namespace) -> dict:
    threads, executor, repeat, n_ctx = args.threads, args.executor, args.repeat, args.n_ctx
    f16, q4, resolved = ggufs(model, threads)
    text = cut_text(text, f16["path"], chunks, d, n_ctx)
    lps, lms = [], []
    for _ in range(repeat):  # in turn, so a slow spell of the machine falls on both tools
        os.sync()  # each tool starts with the other's writes on disk: neither pays for the other's writeback
        lps.append(run_llama(binary, f16["path"], q4["path"], text, d, threads, n_ctx))
        os.sync()
        lms.append(run_kld(f16, q4, text, d, threads, executor, n_ctx))
    lp, lm = best_of(lps), best_of(lms)
    from store import llamacpp_kld as K

    base = K.read(lp["base"])
    from backends.llama_binding import gguf_tokenize

    # llama-perplexity's own chunk ids, as it evaluates them: its base file keeps each chunk's
    # first token, and it puts BOS in that place where the model takes one (perplexity.cpp)
    bos = gguf_tokenize(f16["path"], "a")[1]
    ids = [[bos] + list(map(int, t[1:])) if bos is not None else list(map(int, t)) for t in base["tokens"]]
    alone, last, nxt = forwards_alone(resolved, {"f16": f16, "q4_k_m": q4}, ids, threads)
    return {
        "model": model,
        "vocab": int(base["n_vocab"]),
        "chunks": int(base["n_chunk"]),
        "n_ctx": n_ctx,
        "lp": lp,
        "lm": lm,
        "alone": alone,
        "costs": per_row_costs(last["f16"], last["q4_k_m"], nxt),
        "same_ids": ids == [list(t) for t in lm["ids"]],
    }


def report(r: dict, threads: int, executor: str) -> None:
    lp, lm, alone = r["lp"], r["lm"], r["alone"]
    floor = sum(alone.values())
    print(
        f"\n{r['model']} ({r['vocab']:,} logits a row): {r['chunks']} chunks of {r['n_ctx']}, "
        f"{lm['rows']:,} scored rows; chunk ids identical to llama-perplexity's: {'yes' if r['same_ids'] else 'NO'}"
    )
    rows = [
        ("", "llama-perplexity", f"matrix kld ({executor} executor)"),
        (
            "KL(F16 || Q4_K_M) mean ± s.e.",
            f"{lp['kl']:.6f} ± {lp['se']:.6f}",
            f"{lm['kl']:.6f} ± {lm['se']:.6f} ({abs(lp['kl'] - lm['kl']) / max(lp['se'], lm['se']):.2f} s.e. apart)",
        ),
        (
            "PPL(Q4_K_M) / PPL(F16)",
            f"{lp['ppl_ratio'][0]:.6f} ± {lp['ppl_ratio'][1]:.6f}",
            f"{lm['ppl_ratio'][0]:.6f} ± {lm['ppl_ratio'][1]:.6f}",
        ),
        (
            f"wall time (s), best of {len(lp['runs'])}",
            f"{lp['wall']:.1f} ({lp['walls'][0]:.1f} + {lp['walls'][1]:.1f})",
            f"{lm['wall']:.1f} = {lm['wall'] / lp['wall']:.2f}x",
        ),
        ("  every run (s)", " ".join(f"{w:.1f}" for w in lp["runs"]), " ".join(f"{w:.1f}" for w in lm["runs"])),
        (
            "the forwards alone (s)",
            "",
            f"{floor:.1f} = {floor / lp['wall']:.2f}x (F16 {alone['f16']:.1f} + "
            f"Q4_K_M {alone['q4_k_m']:.1f}; in-process, {threads} threads)",
        ),
        (
            "disk, reference rows (MB)",
            f"{lp['disk'] / 1e6:.1f} (uint16 base file)",
            f"{lm['disk'] / 1e6:.1f} = {lm['disk'] / lp['disk']:.2f}x (bf16, floor {lm['floor']:.1e})",
        ),
        ("disk, candidate's rows (MB)", "none kept", f"{lm['cand_disk'] / 1e6:.2f} (row hashes; values not kept)"),
        (
            "peak memory (GB)",
            f"{lp['peak_gb']:.2f}",
            f"{lm['peak_gb']:.2f} (the largest cell worker; "
            f"{lm['driver_gb']:.2f} the kld process or a worker it waited for)",
        ),
    ]
    w = [max(len(x[i]) for x in rows) for i in range(3)]
    for x in rows:
        print("  " + "  ".join(f"{c:{w[i]}}" for i, c in enumerate(x)).rstrip())
    c = r["costs"]
    print(
        f"  per stored row, beyond its forward (ms): rounding and floor {c['rounding and floor']:.3f}, "
        f"encoding {c['encoding']:.3f}, comparison {c['comparison']:.3f}; total {sum(c.values()):.3f} "
        f"(x {lm['rows']:,} rows = {sum(c.values()) * lm['rows'] / 1000:.1f} s)"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument(
        "--chunks",
        default=",".join(f"{k}={v}" for k, v in DEFAULT_CHUNKS.items()),
        help="MODEL=N,...: the first N chunks of the text for that model (0: all)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--n-ctx", type=int, default=512, help="tokens a chunk, both tools (llama-perplexity's -c)")
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--llama-perplexity", help="a built binary (default: build it from the sdist once)")
    ap.add_argument("--keep", help="keep the work directory here")
    ap.add_argument(
        "--repeat", type=int, default=2, help="runs of each tool, in turn; the best wall time of each counts"
    )
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: must be >= 1")
    return args


def parse_chunks(spec: str) -> dict[str, int]:
    """--chunks MODEL=N,... over DEFAULT_CHUNKS: how many chunks of the text each model reads (0: all)."""
    chunks = dict(DEFAULT_CHUNKS)
    for part in filter(None, spec.split(",")):
        name, _, n = part.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--chunks: expected MODEL=N (got {part!r})")
        chunks[name] = int(n)
    return chunks


def scoreboard_rows(results: list[dict]) -> list[dict]:
    """Each model's figures as the row benchmarks/results keeps (docs/benchmarks.md's scoreboard)."""
    return [
        {
            "model": r["model"],
            "vocab": r["vocab"],
            "n_ctx": r["n_ctx"],
            "rows": r["lm"]["rows"],
            "wall_ratio": r["lm"]["wall"] / r["lp"]["wall"],
            "forwards_alone_ratio": sum(r["alone"].values()) / r["lp"]["wall"],
            "wall_s": [r["lp"]["wall"], r["lm"]["wall"]],
            "wall_runs_s": [r["lp"]["runs"], r["lm"]["runs"]],
            "kld": [[r["lp"]["kl"], r["lp"]["se"]], [r["lm"]["kl"], r["lm"]["se"]]],
            "kld_se_apart": abs(r["lp"]["kl"] - r["lm"]["kl"]) / max(r["lp"]["se"], r["lm"]["se"]),
            "ppl_ratio": [r["lp"]["ppl_ratio"][0], r["lm"]["ppl_ratio"][0]],
            "per_row_ms": r["costs"],
        }
        for r in results
    ]


def main() -> int:
    args = parse_args()
    bytecode()
    from benchmarks._common import cpu, save_result
    from benchmarks.llama_tools import build_tool

    chunks = parse_chunks(args.chunks)
    binary = Path(args.llama_perplexity) if args.llama_perplexity else build_tool("llama-perplexity", print)
    d = Path(args.keep or tempfile.mkdtemp(prefix="vs-lp-"))
    results = []
    for model in filter(None, args.models.split(",")):
        (d / model).mkdir(parents=True, exist_ok=True)
        results.append(one_model(model, binary, args.text, chunks.get(model, 0), d / model, args))
    import llama_cpp

    print(
        f"\nCPU: {cpu()}; both tools {args.threads} threads; llama.cpp of llama-cpp-python {llama_cpp.__version__} "
        f"({llama_cpp.llama_print_system_info().decode().strip()}); text {args.text}"
    )
    for r in results:
        report(r, args.threads, args.executor)
    print(
        "\nwall time / llama-perplexity's: "
        + ", ".join(
            f"{r['model']} {r['lm']['wall'] / r['lp']['wall']:.2f}x "
            f"(forwards alone {sum(r['alone'].values()) / r['lp']['wall']:.2f}x)"
            for r in results
        )
    )
    print("targets: KL within 1 s.e.; wall <= 1.0x llama-perplexity's")
    rows = scoreboard_rows(results)
    met = all(x["wall_ratio"] <= 1.0 and x["kld_se_apart"] <= 1 for x in rows)
    print(
        f"recorded: {save_result('vs_llama_perplexity', rows, 'KL within 1 s.e.; wall <= 1.0x llama-perplexity', met)}"
    )
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
