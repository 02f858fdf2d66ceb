"""What the benchmarks that race `matrix kld` against llama-perplexity share: the environment both
tools start from, a catalog model's GGUFs, the `matrix kld` command line and the figures each tool
prints."""

from __future__ import annotations

import json
import os
import re
import sys

# The environment both tools start from, as the user gave it: nothing this process sets on its way
# (logit-matrix's llama.cpp backend sets OMP_WAIT_POLICY where it still can) reaches either tool.
# Taken at import, so a script imports this module before any backend.
USER_ENV = dict(os.environ)
MATRIX_ENV = {**USER_ENV, "RAY_AUTH_MODE": USER_ENV.get("RAY_AUTH_MODE", "disabled")}


def bytecode() -> None:
    """The project's modules compiled to bytecode in place, as an installed package's are: each
    `matrix kld` process (the driver and every host) then imports them from bytecode, even where
    the environment sets PYTHONDONTWRITEBYTECODE or a module was edited since its last import.
    From source, each process compiles what it imports first (the driver and a host together import
    about 250 of them: 0.4 s of compiling)."""
    import compileall
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    found = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in (p.rstrip("*") for p in found["include"]):  # the packages the project installs
        if not compileall.compile_dir(root / package, quiet=1):
            raise SystemExit(f"{root / package}: a module does not compile")


def catalog_ggufs(model: str, dtypes: tuple[str, ...], threads: int) -> tuple[dict[str, dict], object]:
    """({dtype: GGUF artifact}, the resolved model): each dtype converted or quantised from the catalog
    model's checkpoint, built once into the artifact cache."""
    from backends.gguf_build import build_for
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    m = fetch(ModelRef(model, "catalog", model), log=lambda s: print(s, file=sys.stderr))
    return {t: build_for(t, m.hf_dir, m.weights_sha256, threads) for t in dtypes}, m


def kld_command(
    reference: str,
    candidates: list[str],
    text: str,
    n_ctx: int,
    threads: int,
    warehouse: str,
    executor: str,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`matrix kld ... --json` as a user runs it, from a fresh process of this interpreter."""
    cands = [a for c in candidates for a in ("--candidate", c)]
    return [
        sys.executable,
        "-m",
        "matrix",
        "kld",
        "--reference",
        reference,
        *cands,
        "--text",
        text,
        "--n-ctx",
        str(n_ctx),
        "--threads",
        str(threads),
        "--warehouse",
        warehouse,
        "--executor",
        executor,
        *extra,
        "--json",
    ]


def kld_results(out: str) -> list[dict]:
    """The candidates' results from `matrix kld --json`'s output (the log lines before it are stderr's)."""
    return json.loads(out[out.index("{\n") :])["results"]


def llama_figures(out: str) -> dict | None:
    """llama-perplexity --kl-divergence's 'Mean KLD: x ± y' and 'Mean PPL(Q)/PPL(base): x ± y', or
    None where it printed no KL (it failed before its summary)."""
    kl = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)\s+±\s+([0-9.eE+-]+)", out)
    ratio = re.search(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.eE+-]+)\s+±\s+([0-9.eE+-]+)", out)
    if not kl:
        return None
    return {
        "kl": float(kl[1]),
        "se": float(kl[2]),
        "ppl_ratio": (float(ratio[1]), float(ratio[2])) if ratio else None,
    }
