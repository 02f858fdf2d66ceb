"""Shared setup for the benchmark scripts: the real model and the built-in corpus."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def model_and_prompts(model: str = "smollm2-135m"):
    import transformers

    from matrix.corpus import tokenize
    from matrix.models import fetch
    from matrix.spec import ModelRef

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
