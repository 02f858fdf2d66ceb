"""imatrix ladders, measured: logit-matrix's importance matrix against llama-imatrix's own, and the
KL each quant type gains from one.

1. The same F32 GGUF and calibration text through both collectors:
       llama-imatrix -m F32 -f TEXT -o tool.gguf -c 512 -b 512 --no-ppl      (one chunk per batch)
       backends/gguf_imatrix.collect (llama.cpp's graph through the binding's eval callback)
   Prints how many tensors' sums are equal bit for bit, the largest relative difference, both
   times, and whether Q4_K_M quantised with either file has the same tensor bytes.
2. configs/imatrix.yaml: Q5_K_M, Q4_K_M, Q4_0, each round-to-nearest and with the builtin
   calibration text's imatrix, against the HF fp32 reference; prints KL per pair.

    .venv/bin/python benchmarks/vs_llama_imatrix.py [--threads 2] [--skip-ladder] [--skip-tool]

llama-imatrix and llama-quantize are built from the installed llama-cpp-python's sdist once
(benchmarks/llama_tools.py; seconds when llama-perplexity's build tree is there, else ~12-35 min).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cpu, save_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "configs" / "corpus" / "calibration.txt"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def f32_gguf() -> dict:
    from backends.gguf_build import convert
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    m = fetch(ModelRef("smollm2-135m", "catalog", "smollm2-135m"), log=log)
    return convert(m.hf_dir, m.weights_sha256, "f32")


def tensor_bytes(path: str) -> str:
    """sha256 over every tensor's name and bytes (headers differ: each names its own imatrix file)."""
    from gguf import GGUFReader

    h = hashlib.sha256()
    for t in sorted(GGUFReader(path).tensors, key=lambda t: t.name):
        h.update(t.name.encode() + bytes(t.data))
    return h.hexdigest()


def tool_imatrix(imatrix_bin: Path, f32: dict, out: Path, threads: int) -> float:
    """llama-imatrix on the calibration text, one chunk per batch, into out; -> its seconds."""
    from benchmarks.llama_tools import tool_env

    t0 = time.perf_counter()
    subprocess.run(
        [
            str(imatrix_bin),
            "-m",
            f32["path"],
            "-f",
            str(TEXT),
            "-o",
            str(out),
            "-c",
            "512",
            "-b",
            "512",
            "--no-ppl",
            "-t",
            str(threads),
        ],
        check=True,
        capture_output=True,
        env=tool_env(imatrix_bin),
    )
    return time.perf_counter() - t0


def our_imatrix(f32: dict, text: str, threads: int) -> tuple[dict, float]:
    """backends/gguf_imatrix.collect on the same text, under a fresh key (timed, not cached); -> (it, seconds)."""
    from backends import gguf_imatrix as gi

    t0 = time.perf_counter()
    ours = gi.collect(
        {**f32, "sha256": f"{f32['sha256']}-bench-{time.time()}"},
        text,
        "builtin",
        hashlib.sha256(text.encode()).hexdigest(),
        None,
        512,
        threads,
    )
    return ours, time.perf_counter() - t0


def equal_sums(a: dict, b: dict) -> tuple[int, float]:
    """How many tensors' sums and counts are equal bit for bit, and the largest relative difference of a sum."""
    import numpy as np

    same = worst = 0
    for k, (sa, ca) in a["entries"].items():
        sb, cb = b["entries"][k]
        same += bool(np.array_equal(sa, sb) and np.array_equal(ca, cb))
        worst = max(worst, float(np.max(np.abs(sa - sb) / np.maximum(np.abs(sa), 1e-30))))
    return same, worst


def same_q4km(quantize_bin: Path, f32: dict, tool_file: Path, ours_file: str, d: Path, threads: int) -> bool:
    """Q4_K_M by llama-quantize --imatrix with the tool's file, and by llama_model_quantize with ours:
    whether their tensor bytes are identical."""
    import ctypes

    import llama_cpp

    from backends import gguf_imatrix as gi
    from benchmarks.llama_tools import tool_env

    q_tool, q_ours = d / "q4km-tool.gguf", d / "q4km-ours.gguf"
    subprocess.run(
        [str(quantize_bin), "--imatrix", str(tool_file), f32["path"], str(q_tool), "Q4_K_M", str(threads)],
        check=True,
        capture_output=True,
        env=tool_env(quantize_bin),
    )
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, threads
    arr, kv, _keep = gi.quantize_inputs(ours_file, "builtin")
    params.imatrix, params.kv_overrides = arr, kv
    assert llama_cpp.llama_model_quantize(f32["path"].encode(), str(q_ours).encode(), ctypes.byref(params)) == 0
    return tensor_bytes(str(q_tool)) == tensor_bytes(str(q_ours))


def compare_with_tool(threads: int, d: Path) -> dict:
    from backends import gguf_imatrix as gi
    from benchmarks.llama_tools import build_tool

    f32 = f32_gguf()
    imatrix_bin, quantize_bin = build_tool("llama-imatrix", log), build_tool("llama-quantize", log)
    tool_out = d / "tool-imatrix.gguf"
    t_tool = tool_imatrix(imatrix_bin, f32, tool_out, threads)
    ours, t_ours = our_imatrix(f32, TEXT.read_text(), threads)
    a, b = gi.read(str(tool_out)), gi.read(ours["path"])
    same, worst = equal_sums(a, b)
    print(f"\nimatrix of {Path(f32['path']).name} on {TEXT.name} ({a['chunk_count']} chunks of {a['chunk_size']}):")
    print(
        f"  tensors: tool {len(a['entries'])}, logit-matrix {len(b['entries'])}, names equal: "
        f"{set(a['entries']) == set(b['entries'])}"
    )
    print(
        f"  sums and counts equal bit for bit: {same} of {len(a['entries'])}; largest relative difference {worst:.3g}"
    )
    print(f"  time: llama-imatrix {t_tool:.1f} s, logit-matrix {t_ours:.1f} s (load included) = {t_ours / t_tool:.2f}x")
    identical = same_q4km(quantize_bin, f32, tool_out, ours["path"], d, threads)
    print(
        f"  Q4_K_M tensor bytes, llama-quantize --imatrix tool file vs llama_model_quantize with ours: "
        f"{'identical' if identical else 'DIFFERENT'}"
    )
    return {
        "part": "imatrix",
        "tensors": len(a["entries"]),
        "equal_tensors": same,
        "names_equal": set(a["entries"]) == set(b["entries"]),
        "max_rel_diff": float(worst),
        "tool_s": t_tool,
        "ours_s": t_ours,
        "ratio": t_ours / t_tool,
        "q4_k_m_identical": identical,
    }


def ladder(d: Path) -> list[dict]:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    wh = d / "wh"
    t0 = time.perf_counter()
    for cmd in (["run", str(REPO / "configs" / "imatrix.yaml")], ["analyze"]):
        r = subprocess.run(
            [sys.executable, "-m", "matrix", *cmd, "--warehouse", str(wh)], env=env, capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SystemExit(f"matrix {cmd[0]} failed: {r.stderr.strip().splitlines()[-1:]}")
    wall = time.perf_counter() - t0
    from analysis.sql import connect
    from backends.llamacpp_backend import LlamaCppBackend

    con = connect(str(wh))
    rows = con.execute(
        "select c.dtype, c.options like '%imatrix%' as im, s.kld_mean, s.kld_stderr, s.top1_agreement, "
        "s.rows from cells c join summary s using (cell_id) where c.engine = ?",
        [LlamaCppBackend.engine],
    ).fetchall()
    others = con.execute(
        "select dtype, options like '%imatrix%', status, coalesce(error, skip_reason) from cells "
        "where engine = ? and status <> 'done'",
        [LlamaCppBackend.engine],
    ).fetchall()
    con.close()
    got = {(r[0], bool(r[1])): r[2:] for r in rows}
    for dtype, im, status, error in others:
        print(f"  {dtype} {'imatrix' if im else 'round-to-nearest'}: {status}: {error}")
    print(
        f"\nKL(HF fp32 || llama.cpp) on the builtin corpus, first 1,024 tokens, stride 8 ({rows[0][5]} rows); "
        f"imatrix: builtin calibration text; {wall:.0f} s for run + analyze"
    )
    print(f"  {'type':8} {'round-to-nearest':>22} {'imatrix':>22} {'imatrix / rtn':>14} {'top-1 rtn / imatrix':>20}")
    out = []
    for q in ("q5_k_m", "q4_k_m", "q4_0"):
        if (q, False) not in got or (q, True) not in got:
            continue
        a, b = got[(q, False)], got[(q, True)]
        print(
            f"  {q:8} {a[0]:>12.5f} ± {a[1]:.5f} {b[0]:>12.5f} ± {b[1]:.5f} {b[0] / a[0]:>14.3f} "
            f"{a[2]:>10.3f} / {b[2]:.3f}"
        )
        out.append(
            {
                "part": "ladder",
                "type": q,
                "ratio": b[0] / a[0],
                "kld_rtn": a[0],
                "kld_rtn_se": a[1],
                "kld_imatrix": b[0],
                "kld_imatrix_se": b[1],
                "top1_rtn": a[2],
                "top1_imatrix": b[2],
                "rows": a[3],
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--skip-tool", action="store_true", help="do not build or run llama-imatrix")
    ap.add_argument("--skip-ladder", action="store_true", help="do not run configs/imatrix.yaml")
    ap.add_argument("--keep", help="work under this directory (default: the system's temp directory)")
    args = ap.parse_args()
    print(f"CPU: {cpu()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="vs-imatrix-", dir=args.keep) as tmp:
        if not args.skip_tool:
            rows.append(compare_with_tool(args.threads, Path(tmp)))
        if not args.skip_ladder:
            rows += ladder(Path(tmp))
    record(rows)
    return 0


def record(rows: list[dict]) -> None:
    """The pass/fail target is the tool comparison's: the same sums bit for bit and the same Q4_K_M
    bytes; the ladder's KL ratios are figures beside it (with no tool run, no target: met None)."""
    tool = [r for r in rows if r["part"] == "imatrix"]
    met = (
        all(r["equal_tensors"] == r["tensors"] and r["names_equal"] and r["q4_k_m_identical"] for r in tool)
        if tool
        else None
    )
    target = (
        "every tensor's imatrix sums and counts equal llama-imatrix's bit for bit, and Q4_K_M quantised with "
        "either has identical tensor bytes; ladder: KL with the imatrix over round-to-nearest per type"
    )
    print(f"recorded: {save_result('vs_llama_imatrix', rows, target, met)}")


if __name__ == "__main__":
    raise SystemExit(main())
