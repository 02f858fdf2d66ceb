"""Make a virtual environment from an existing one, minus some distributions: how the tests stand
in for a machine that has only part of the stack (a bare CUDA image: no ray, duckdb, llama.cpp,
vLLM or MLX). Every other distribution is linked, not copied, so it takes seconds and no disk.

    python scripts/bare_env.py DEST --drop ray duckdb llama-cpp-python vllm mlx mlx-lm mlx-cpu
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
from importlib.metadata import distributions
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tops(dist) -> set[str]:
    """The top-level names a distribution installed into site-packages (from its RECORD)."""
    out = set()
    for f in dist.files or ():
        first = Path(f).parts[0]
        if first not in ("..", "__pycache__") and not first.startswith("__editable__"):
            out.add(first)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dest", type=Path)
    ap.add_argument("--drop", nargs="*", default=[], help="distribution names left out")
    args = ap.parse_args()
    drop = {norm(d) for d in args.drop}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(args.dest)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    dest_site = next((args.dest / "lib").glob("python3*/site-packages"))
    kept, dropped = [], []
    for dist in distributions(path=[str(site)]):
        name = norm(dist.metadata["Name"])
        if name in drop:
            dropped.append(name)
            continue
        for top in tops(dist):
            src, link = site / top, dest_site / top
            if src.exists() and not link.exists():
                link.symlink_to(src)
        kept.append(name)
    missing = sorted(drop - set(dropped))
    print(
        f"{args.dest}: {len(kept)} distributions linked, left out: {', '.join(sorted(dropped))}"
        + (f" (not installed here: {', '.join(missing)})" if missing else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
