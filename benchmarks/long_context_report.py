"""benchmarks/long_context.py's printing: the machine every figure is for, and each context's tables
(wall and peak per step, KL of each tool and whether they agree, `matrix kld`'s KL by position)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.kld_common import USER_ENV

BUCKETS = (("0-1k", 0, 1024), ("1k-4k", 1024, 4096), ("4k-16k", 4096, 16384), ("16k+", 16384, 1 << 31))
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def fmt_run(r: dict) -> str:
    if r["wall"] is None:
        return r["exit"]
    if r["ok"]:
        return f"{r['wall']:.1f} s, peak {r['peak_gb']:.2f} GB"
    return f"{r['exit']} after {r['wall']:.1f} s, peak reached {r['peak_gb']:.2f} GB"


def fmt_kl(r: dict) -> str:
    return f"{r['kl']:.6f} ± {r['se']:.6f}" if r.get("kl") is not None else "-"


def table(rows: list[tuple[str, ...]]) -> None:
    w = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
    for x in rows:
        print("    " + "  ".join(f"{c:{w[i]}}" for i, c in enumerate(x)).rstrip())


def report(run: dict, st: list[dict], lp: dict, lm: dict) -> None:
    rows = [("step", "llama-perplexity", "matrix kld", "wall ratio", "peak ratio")]
    for s in st:
        ratio = [f"{s[k]:.2f}x" if s[k] is not None else "-" for k in ("wall_ratio", "peak_ratio")]
        rows.append((s["step"], fmt_run(s["llama"]), fmt_run(s["matrix"]), *ratio))
    done = [s for s in st if s["wall_ratio"] is not None]
    if done:
        wa, wb = sum(s["llama"]["wall"] for s in done), sum(s["matrix"]["wall"] for s in done)
        pa, pb = max(s["llama"]["peak_gb"] for s in done), max(s["matrix"]["peak_gb"] for s in done)
        rows.append(("the steps both completed", f"{wa:.1f} s, peak {pa:.2f} GB", f"{wb:.1f} s, peak {pb:.2f} GB"))
        rows[-1] += (f"{wb / wa:.2f}x", f"{pb / pa:.2f}x")
    table(rows)
    rows = [("KL(F16 || candidate)", "llama-perplexity", "matrix kld", "within 1 s.e.")]
    for s in st:
        agree = "-" if s["kld_agree"] is None else f"{'yes' if s['kld_agree'] else 'NO'} ({s['kld_se_apart']:.2f} s.e.)"
        rows.append((s["candidate"], fmt_kl(s["llama"]), fmt_kl(s["matrix"]), agree))
    table(rows)
    measured = [s for s in st if s["matrix"].get("buckets")]
    if measured:
        print("    matrix kld's KL by position in the chunk (rows: mean ± s.e.):")
        rows = [("candidate", *(b[0] for b in BUCKETS))]
        for s in measured:
            rows.append((s["candidate"], *(bucket_text(b) for b in s["matrix"]["buckets"])))
        table(rows)
    disk = f"{lp['base']['disk'] / 1e9:.2f} GB" if lp["base"].get("disk") else "none"
    print(
        f"    disk: llama-perplexity's base file {disk}; matrix kld's reference rows {lm.get('disk', 0) / 1e9:.2f} GB"
    )


def bucket_text(b: dict) -> str:
    if not b["rows"]:
        return "-"
    se = f" ± {b['se']:.6f}" if b["se"] is not None else ""
    return f"{b['rows']:,}: {b['kl']:.6f}{se}"


def machine(binary: Path) -> None:
    """The CPU, its vector extensions, the memory and the versions every figure is for."""
    import llama_cpp

    from benchmarks._common import cpu

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), 0)
    env = {**USER_ENV, "LD_LIBRARY_PATH": str(binary.parent)}
    version = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
    line = next((ln for ln in (version.stdout + version.stderr).splitlines() if ln.startswith("version")), "?")
    commit = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
    ).stdout.strip()
    print(f"CPU: {cpu()}; flags: {' '.join(f for f in CPU_FLAGS if f in flags) or 'none of ' + ', '.join(CPU_FLAGS)}")
    print(f"memory: {int(mem) / 1e6:.1f} GB; free disk at the work directory is printed with each run")
    print(
        f"versions: logit-matrix {commit or '?'}; llama-cpp-python {llama_cpp.__version__}; "
        f"llama-perplexity {line} ({binary}); Python {sys.version.split()[0]}"
    )
    print(f"llama.cpp: {llama_cpp.llama_print_system_info().decode().strip()}")
