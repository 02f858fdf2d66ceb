"""`matrix kld` against llama-perplexity at long context: Gemma 3 270M (262,144 logits a row) at
n_ctx 16,384 and 4,096, the F16 GGUF converted here from the catalog checkpoint as the reference,
three candidates: the catalog's published Q4_K_M, and the F16 itself with its KV cache in q8_0 and
in q4_0. Per tool and context: wall time, peak memory, KL mean ± s.e. of each candidate, whether
the two tools' means agree within one s.e., and `matrix kld`'s KL by position in the chunk.

    llama-perplexity  -m F16 -f TEXT -c N --kl-divergence-base BASE     (the base pass)
                      -m Q4_K_M -c N --kl-divergence-base BASE --kl-divergence
                      -m F16 -c N -ctk q8_0 -ctv q8_0 -fa on --kl-divergence-base BASE --kl-divergence
                      (and q4_0)
    logit-matrix      matrix kld --reference F16 --candidate Q4_K_M --text TEXT --n-ctx N
                      matrix kld --reference F16 --candidate F16 --kv-cache q8_0 ...   (and q4_0)

`--kv-cache` applies to every candidate of one invocation, so `matrix kld` runs once per KV type
into one warehouse: each later call extends the job, its reference already captured. A `matrix kld`
without `--kv-cache` has its KV candidates skipped, with a note.

    .venv/bin/python benchmarks/long_context.py [--contexts 16384,4096] [--chunks N] [--kv-types q8_0,q4_0]
        [--threads N] [--executor local|ray] [--llama-perplexity BIN] [--keep DIR]

The text: license texts shipped in /usr/share/common-licenses, whole files in a fixed order until
they hold 2 x 16,384 Gemma 3 tokens (llama-perplexity refuses a text under 2 x n_ctx tokens); the
script writes it into its work directory and names the files it took.

KL by position: buckets 0-1k, 1k-4k, 4k-16k and 16k+ of a row's position in its chunk, from the
warehouse's metrics table. Both tools score the second half of each chunk (n_ctx/2 .. n_ctx-2), so
n_ctx 16,384 fills the 4k-16k bucket, 4,096 the 1k-4k one, and 16k+ fills only at n_ctx 32,768.

Peak memory: llama-perplexity's own (wait4); `matrix kld`'s largest process, a cell host of its own
(VmHWM, benchmarks/process_watch.py ActorPeak) or the kld process itself (wait4).

Memory: llama-perplexity keeps every logit of a chunk, n_ctx x n_vocab floats (17.2 GB at 16,384
for Gemma 3), and in its base pass the chunk's log-probabilities as uint16 beside them (8.6 GB);
its base file takes (n_ctx/2 - 1) x n_vocab x 2 bytes a chunk on disk (4.3 GB). A tool that runs
out of memory or fails is recorded as it ended (a process the OOM killer took: SIGKILL) with the
peak it reached, and the script goes on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kld_common import (  # noqa: E402
    MATRIX_ENV,
    USER_ENV,
    bytecode,
    catalog_ggufs,
    kld_command,
    kld_results,
    llama_figures,
)
from benchmarks.long_context_report import BUCKETS, machine, report  # noqa: E402
from benchmarks.process_watch import ActorPeak, exit_text, watched  # noqa: E402

MODEL = "gemma3-270m"
LICENSES = Path("/usr/share/common-licenses")
# Distinct texts first: LGPL-2 and GFDL-1.2 come last as near-copies of LGPL-2.1 and GFDL-1.3, since
# a passage the model has already seen in its context is one it can copy, which flatters long-context KL.
TEXTS = (
    "GPL-3",
    "GPL-2",
    "LGPL-2.1",
    "MPL-1.1",
    "GFDL-1.3",
    "MPL-2.0",
    "Apache-2.0",
    "CC0-1.0",
    "Artistic",
    "GPL-1",
    "LGPL-3",
    "BSD",
    "LGPL-2",
    "GFDL-1.2",
)
LONGEST = 16384  # the text holds two chunks of this, whatever --contexts asks, so one text serves every run


def prepare_text(vocab: str, need: int, d: Path) -> tuple[Path, list[str], int]:
    """The license files in TEXTS' order, whole, until they hold `need` tokens of the reference's
    llama.cpp tokenizer (as llama-perplexity tokenises: BOS first); -> (the file, names, tokens)."""
    from backends.llama_binding import gguf_tokenize

    taken, parts, n = [], [], 0
    for name in TEXTS:
        f = LICENSES / name
        if not f.is_file():
            continue
        taken.append(str(f))
        parts.append(f.read_text())
        n = len(gguf_tokenize(vocab, "\n\n".join(parts))[0])
        if n >= need:
            break
    if n < need:
        raise SystemExit(f"the texts in {LICENSES} hold {n:,} tokens, under the {need:,} two chunks need")
    out = d / "text.txt"
    out.write_text("\n\n".join(parts))
    return out, taken, n


def candidates(f16: str, q4: str, kv_types: list[str]) -> list[dict]:
    """Each candidate with its KV cache type (None: llama.cpp's default, f16)."""
    return [{"label": "Q4_K_M", "file": q4, "kv": None}] + [
        {"label": f"F16 KV {t}", "file": f16, "kv": t} for t in kv_types
    ]


def matrix_takes_kv() -> bool:
    """Whether this checkout's `matrix kld` takes --kv-cache."""
    out = subprocess.run(
        [sys.executable, "-m", "matrix", "kld", "--help"], env=MATRIX_ENV, capture_output=True, text=True
    ).stdout
    return "--kv-cache" in out


def disk_room(d: Path, need: int, what: str) -> bool:
    """Whether `need` bytes fit on d's filesystem with 1 GB to spare; says so either way."""
    free = shutil.disk_usage(d).free
    ok = need + 1e9 <= free
    print(f"  disk: {what} takes ~{need / 1e9:.1f} GB; {free / 1e9:.1f} GB free at {d}{'' if ok else ': skipped'}")
    return ok


def outcome(wall: float, peak_gb: float, code: int, **more) -> dict:
    return {"wall": wall, "peak_gb": peak_gb, "exit": exit_text(code), "ok": code == 0, **more}


def skipped(why: str) -> dict:
    return {"wall": None, "peak_gb": None, "exit": f"skipped: {why}", "ok": False}


def llama_sizes(n_ctx: int, n_chunk: int, n_vocab: int) -> tuple[int, int]:
    """(the base file's bytes, the two buffers a base pass holds: n_ctx x n_vocab float logits and
    n_ctx x nv uint16 log-probabilities), as tools/perplexity/perplexity.cpp sizes them."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    base = 20 + n_chunk * n_ctx * 4 + n_chunk * (n_ctx - 1 - n_ctx // 2) * nv * 2
    return base, n_ctx * n_vocab * 4 + n_ctx * nv * 2


def run_llama(binary: Path, f16: str, cands: list[dict], text: Path, run: dict, d: Path) -> dict:
    """The base pass, then each candidate against its base file; -> {'base': ..., label: ...}."""
    n_ctx, n_chunk, threads = run["n_ctx"], run["n_chunk"], run["threads"]
    base = d / f"base-{n_ctx}.kld"
    base_bytes, buffers = llama_sizes(n_ctx, n_chunk, run["n_vocab"])
    print(f"  llama-perplexity: its base pass holds >= {buffers / 1e9:.1f} GB of logits and log-probabilities")
    if not disk_room(d, base_bytes, f"llama-perplexity's base file ({n_chunk} chunk(s))"):
        return {k: skipped("not enough disk for the base file") for k in ["base"] + [c["label"] for c in cands]}
    env = {**USER_ENV, "LD_LIBRARY_PATH": str(binary.parent)}  # a shared-library build keeps its .so beside it
    common = ["-c", str(n_ctx), "-t", str(threads), "--kl-divergence-base", str(base)]
    os.sync()  # neither tool pays for the other's writeback
    wall, peak, out, code = watched(
        [str(binary), "-m", f16, "-f", str(text), *common, "--chunks", str(n_chunk)], env, d / f"lp-base-{n_ctx}.log"
    )
    res = {"base": outcome(wall, peak, code, disk=base.stat().st_size if base.is_file() else None)}
    for c in cands:
        if not res["base"]["ok"]:
            res[c["label"]] = skipped(f"no base file (the base pass: {res['base']['exit']})")
            continue
        kv = ["-ctk", c["kv"], "-ctv", c["kv"], "-fa", "on"] if c["kv"] else []  # a quantised V cache needs FA
        log = d / f"lp-{c['label'].replace(' ', '-')}-{n_ctx}.log"
        wall, peak, out, code = watched([str(binary), "-m", c["file"], *common, "--kl-divergence", *kv], env, log)
        figures = llama_figures(out)
        res[c["label"]] = outcome(wall, peak, code, **(figures or {}))
        if code == 0 and figures is None:
            res[c["label"]].update(ok=False, exit=f"exit 0 without a 'Mean KLD' line (see {log})")
    base.unlink(missing_ok=True)  # nothing reads it again; at 16,384 it is 4.3 GB a chunk
    return res


def position_buckets(wh: Path, cell_id: str) -> list[dict]:
    """KL by position in the chunk over a candidate's scored rows (the rows its statistics take:
    repeat 0, both sides finite, a next token), from the metrics table itself."""
    from analysis.sql import connect

    con = connect(str(wh))
    try:
        out = []
        for name, lo, hi in BUCKETS:
            n, mean, sd = con.execute(
                "SELECT count(kld), avg(kld), stddev_samp(kld) FROM metrics WHERE cell_id = ? AND repeat = 0 "
                "AND nonfinite IS NULL AND nll_stack IS NOT NULL AND position >= ? AND position < ?",
                [cell_id, lo, hi],
            ).fetchone()
            out.append({"bucket": name, "rows": n, "kl": mean, "se": sd / n**0.5 if n > 1 and sd is not None else None})
        return out
    finally:
        con.close()


def matrix_once(f16: str, c: dict, text: Path, run: dict, wh: Path, d: Path) -> dict:
    """One `matrix kld` invocation for one candidate into the context's warehouse; -> its figures."""
    extra = ("--chunks", str(run["n_chunk"]), *(("--kv-cache", c["kv"]) if c["kv"] else ()))
    cmd = kld_command(f16, [c["file"]], str(text), run["n_ctx"], run["threads"], str(wh), run["executor"], extra)
    log = d / f"kld-{c['label'].replace(' ', '-')}-{run['n_ctx']}.log"
    os.sync()
    with ActorPeak() as actors:
        wall, driver_gb, out, code = watched(cmd, MATRIX_ENV, log, actors)
    worker_gb = actors.peak_kb * 1024 / 1e9
    # the peak of the run: its largest process, a cell worker or the kld process itself
    res = outcome(wall, max(worker_gb, driver_gb), code, worker_gb=worker_gb, driver_gb=driver_gb)
    try:
        found = kld_results(out)
    except ValueError:  # no JSON: refused or failed before any result
        found = []
    if not found:
        res.update(ok=False, exit=f"{res['exit']}, no result (see {log})")
        return res
    st = found[0]["statistics"]
    res.update(kl=st["kld"][0], se=st["kld"][1], ppl_ratio=tuple(st["ppl_ratio"]), rows=st["rows"])
    res.update(chunks=found[0]["chunks"], buckets=position_buckets(wh, found[0]["cell_id"]))
    return res


def run_matrix(f16: str, cands: list[dict], text: Path, run: dict, d: Path, takes_kv: bool) -> dict:
    """`matrix kld` once per KV type, into one warehouse; -> {label: figures, 'disk': reference rows' bytes}."""
    wh = d / f"wh-{run['n_ctx']}"
    for old in (wh, d / f"{wh.name}.kld.yaml", d / f"{wh.name}.kld-corpus.yaml"):  # a kept directory's last run
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    # bf16 rows of the scored half of each chunk, before compression (it stores ~0.45x llama's base file)
    need = run["n_chunk"] * (run["n_ctx"] // 2) * run["n_vocab"] * 2
    if not disk_room(d, need, f"matrix kld's reference rows ({run['n_chunk']} chunk(s), at most)"):
        return {c["label"]: skipped("not enough disk for the reference's rows") for c in cands}
    res = {}
    for c in cands:
        if c["kv"] and not takes_kv:
            res[c["label"]] = skipped("this matrix kld has no --kv-cache")
            continue
        res[c["label"]] = matrix_once(f16, c, text, run, wh, d)
    res["disk"] = sum(f.stat().st_size for f in wh.glob("logits/*/*.parquet")) if wh.is_dir() else 0
    if not run["keep"]:
        shutil.rmtree(wh, ignore_errors=True)
    return res


def steps(lp: dict, lm: dict, cands: list[dict]) -> list[dict]:
    """What each tool did for each candidate, side by side: the first candidate's step holds the
    reference too (llama-perplexity's base pass; the reference cell of `matrix kld`'s first call)."""
    out = []
    for i, c in enumerate(cands):
        a, b = lp[c["label"]], lm[c["label"]]
        if i == 0 and not lp["base"]["ok"]:  # the base pass's own end, and the peak it reached
            a = {**lp["base"], "exit": f"base pass {lp['base']['exit']}"}
        elif i == 0 and a["ok"]:
            a = {**a, "wall": lp["base"]["wall"] + a["wall"], "peak_gb": max(lp["base"]["peak_gb"], a["peak_gb"])}
        both = a["ok"] and b["ok"]
        apart = abs(a["kl"] - b["kl"]) / max(a["se"], b["se"], 1e-300) if both else None
        out.append(
            {
                "step": ("F16 reference + " if i == 0 else "") + c["label"],
                "candidate": c["label"],
                "llama": a,
                "matrix": b,
                "wall_ratio": b["wall"] / a["wall"] if both else None,
                "peak_ratio": b["peak_gb"] / a["peak_gb"] if both else None,
                "kld_se_apart": apart,
                "kld_agree": apart <= 1 if apart is not None else None,
            }
        )
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="16384,4096", help="n_ctx values, run in this order")
    ap.add_argument("--chunks", type=int, help="only the text's first N chunks at each n_ctx (default: every chunk)")
    ap.add_argument("--kv-types", default="q8_0,q4_0", help="the F16 candidates' KV cache types ('' for none)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--llama-perplexity", help="a built binary (default: build it from the sdist once)")
    ap.add_argument("--keep", help="keep the work directory (logs, text, warehouses) here")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.kv_types = [x for x in args.kv_types.split(",") if x]
    if args.chunks is not None and args.chunks < 1:
        raise SystemExit(f"--chunks {args.chunks}: must be >= 1")
    return args


def rows_of(n_ctx: int, n_chunk: int, st: list[dict]) -> list[dict]:
    """A context's steps as the rows benchmarks/results keeps."""
    return [{"n_ctx": n_ctx, "chunks": n_chunk, **s} for s in st]


def main() -> int:
    args = parse_args()
    bytecode()
    from benchmarks._common import save_result
    from benchmarks.llama_tools import build_tool
    from matrix.spec.kld import catalog_gguf
    from matrix.spec.models import CATALOG

    binary = Path(args.llama_perplexity) if args.llama_perplexity else build_tool("llama-perplexity", print)
    d = Path(args.keep or tempfile.mkdtemp(prefix="long-ctx-"))
    d.mkdir(parents=True, exist_ok=True)
    built, _ = catalog_ggufs(MODEL, ("f16",), args.threads)
    f16, q4 = built["f16"]["path"], catalog_gguf(MODEL, lambda s: print(s, file=sys.stderr))
    text, taken, n_tok = prepare_text(f16, 2 * max(LONGEST, *args.contexts), d)
    machine(binary)
    print(f"model: {MODEL} ({CATALOG[MODEL].vocab:,} logits a row); reference {f16}; published Q4_K_M {q4}")
    print(f"text: {text}: {', '.join(taken)}, joined by a blank line; {n_tok:,} tokens (BOS included)")
    takes_kv = matrix_takes_kv()
    if args.kv_types and not takes_kv:
        print("note: this matrix kld has no --kv-cache: the KV candidates run in llama-perplexity only")
    cands = candidates(f16, q4, args.kv_types)
    rows = []
    for n_ctx in args.contexts:
        n_chunk = min(args.chunks or n_tok, n_tok // n_ctx)
        if n_tok < 2 * n_ctx:  # llama-perplexity's own floor (tools/perplexity/perplexity.cpp)
            print(f"\nn_ctx {n_ctx}: skipped: the text's {n_tok:,} tokens are under 2 x {n_ctx}")
            continue
        run = {"n_ctx": n_ctx, "n_chunk": n_chunk, "n_vocab": CATALOG[MODEL].vocab, "threads": args.threads}
        run.update(executor=args.executor, keep=bool(args.keep))
        print(
            f"\nn_ctx {n_ctx}: {n_chunk} chunk(s), scored positions {n_ctx // 2}..{n_ctx - 2} of each; "
            f"both tools {args.threads} threads"
        )
        lp = run_llama(binary, f16, cands, text, run, d)
        lm = run_matrix(f16, cands, text, run, d, takes_kv)
        st = steps(lp, lm, cands)
        report(run, st, lp, lm)
        rows += rows_of(n_ctx, n_chunk, st)
    print(f"\nrecorded: {save_result('long_context', rows, 'none: figures at long context', None)}")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
