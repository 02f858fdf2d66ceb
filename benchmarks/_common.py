"""Shared setup for the benchmark scripts: the real model and the built-in corpus."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cpu() -> str:
    """The CPU every printed figure is for: model, widest vector ISA (what bf16 speed hangs on), cores."""
    import platform

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for line in text.splitlines():
        if line.startswith("model name"):
            isa = "AMX" if "amx_tile" in text else "AVX-512" if "avx512f" in text else "AVX2" if "avx2" in text else "?"
            return f"{line.split(':', 1)[1].strip()} ({isa}), {os.cpu_count()} cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def gpu() -> str | None:
    """The GPUs of this machine by name (NVML), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        return ", ".join(n.decode() if isinstance(n, bytes) else n for n in names) or None
    except Exception:  # noqa: BLE001 - no NVIDIA driver or library: a CPU-only figure
        return None


def save_result(name: str, rows: list[dict], target: str, met: bool | None) -> Path:
    """One run's figures as benchmarks/results/<name>/<UTC time>-<commit>.json (e.g.
    20261207T140650Z-85d0281eaa.json), the row docs/benchmarks.md's scoreboard shows, newest first
    by that time (`matrix docs` regenerates it): when, which commit, on what, by which command.
    met: whether the figures reach the target; None where the script states no pass/fail target."""
    import datetime
    import json
    import subprocess

    repo = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    now = datetime.datetime.now(datetime.timezone.utc)
    out = repo / "benchmarks" / "results" / name / f"{now:%Y%m%dT%H%M%SZ}-{commit}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": name,
                "date": f"{now:%Y-%m-%d}",
                "commit": commit + ("+" if dirty else ""),
                "cpu": cpu(),
                "gpu": gpu(),
                "command": " ".join(["python", *sys.argv]),
                "target": target,
                "met": met,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    return out


def model_and_prompts(model: str = "smollm2-135m"):
    import transformers

    from matrix.spec.corpus import tokenize
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    resolved = fetch(ModelRef(model, "catalog", model), log=lambda m: print(m, file=sys.stderr))
    tok = transformers.AutoTokenizer.from_pretrained(resolved.hf_dir)
    prompts = tokenize("builtin", model, tok, "tokenizer")
    return resolved, [(p.prompt_id, p.token_ids) for p in prompts]


def load_backend(model_dir: str, dtype: str, attention: str):
    from backends.hf_backend import HFBackend
    from common.stack import StackDesc

    be = HFBackend(
        StackDesc.of(HFBackend.engine, dtype, attention), model_dir, int(os.environ.get("THREADS", os.cpu_count() or 1))
    )
    be.load()
    return be
