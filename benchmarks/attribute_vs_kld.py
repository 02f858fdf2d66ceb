"""`matrix attribute` over N groups against one `matrix kld` call with the same N + 1 files (the
base and each group's variant) as candidates, in one run, alternated, best of --repeat each.

    python benchmarks/attribute_vs_kld.py [--model smollm2-135m] [--quant q4_k_m] [--groups N]
        [--text configs/corpus/long_prose.txt] [--threads N] [--repeat 2]

Both measure the same rows against the same reference; attribute also quantises the N + 1 files
(each call gets an artifact cache of its own, so nothing is reused from the call before) and ranks
them. `--frontier 0` keeps it to those files: the frontier's steps are files kld is not given.
Target: attribute's wall <= 1.1x kld's. Prints the CPU with every figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401 - puts the repository on sys.path
from _common import cpu, save_result
from kld_common import MATRIX_ENV, bytecode, catalog_ggufs, kld_command

TARGET = 1.1


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return wall, p.stdout


def attribute(ref: str, a: argparse.Namespace, groups: str, d: Path) -> tuple[float, dict]:
    import json

    cache = d / "cache"
    env = {**MATRIX_ENV, "LOGIT_MATRIX_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "matrix", "attribute", "--reference", ref, "--quant", a.quant, "--text", a.text]
    cmd += ["--groups", groups, "--frontier", "0", "--threads", str(a.threads), "--warehouse", str(d / "wh")]
    wall, out = timed([*cmd, "--json"], env)
    return wall, json.loads(out[out.index("{\n") :])


def kld(ref: str, files: list[str], a: argparse.Namespace, d: Path) -> float:
    cmd = kld_command(ref, files, a.text, 512, a.threads, str(d / "wh"), "local")
    return timed(cmd, {**MATRIX_ENV, "LOGIT_MATRIX_CACHE": str(d / "cache")})[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="q4_k_m")
    p.add_argument("--groups", type=int, default=4, help="the first N groups (kinds, then thirds)")
    p.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "configs/corpus/long_prose.txt"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    bytecode()
    from backends.gguf_groups import flag_name, groups

    built, _ = catalog_ggufs(a.model, ("f16",), a.threads)
    ref = built["f16"]["path"]
    names = ",".join(flag_name(g.name) for g in groups(ref)[: a.groups])
    walls: dict[str, list[float]] = {"attribute": [], "kld": []}
    kl: dict[str, float] = {}
    for i in range(a.repeat):
        with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
            wall, result = attribute(ref, a, names, Path(t1))
            walls["attribute"].append(wall)
            files = [result["base"]["path"]] + [v["path"] for v in result["variants"] if v["rank"] is not None]
            kl = {v["group"]: v["summary"]["kld"][0] for v in result["variants"] if v["summary"]}
            # kld reads the files attribute quantised, from that call's cache, into a warehouse of its own
            os.makedirs(Path(t2) / "wh", exist_ok=True)
            Path(t2, "cache").symlink_to(Path(t1) / "cache")
            walls["kld"].append(kld(ref, files, a, Path(t2)))
        print(f"run {i + 1}: attribute {walls['attribute'][-1]:.1f} s, kld {walls['kld'][-1]:.1f} s", file=sys.stderr)
    best = {k: min(v) for k, v in walls.items()}
    ratio = best["attribute"] / best["kld"]
    print(f"CPU: {cpu()}, {a.threads} threads; {a.model} {a.quant}, {a.groups} groups ({names}), {len(files)} files")
    print(f"attribute (quantise {len(files)} files + measure + rank): best of {a.repeat} {best['attribute']:.1f} s")
    print(f"kld ({len(files)} candidates, files given):              best of {a.repeat} {best['kld']:.1f} s")
    print(f"ratio {ratio:.2f}x (target <= {TARGET}x): {'met' if ratio <= TARGET else 'NOT met'}")
    print("KL mean per variant: " + ", ".join(f"{g} {v:.4g}" for g, v in kl.items()))
    row = {"model": a.model, "groups": a.groups, **{f"{k}_s": v for k, v in best.items()}, "ratio": ratio}
    save_result("attribute_vs_kld", [row], f"attribute <= {TARGET}x kld", ratio <= TARGET)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
