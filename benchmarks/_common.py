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

    be = HFBackend(StackDesc("hf", dtype, attention), model_dir,
                   int(os.environ.get("THREADS", os.cpu_count() or 1)))
    be.load()
    return be
