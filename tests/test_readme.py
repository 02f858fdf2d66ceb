"""The README's recipes, run as written: its code blocks are taken from the README itself and run
in a directory that holds what they name (the test model's GGUFs under the recipe's file names,
a text of a few 512-token chunks, `warehouse` the recipe's own warehouse). The README stays short."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

README = (REPO / "README.md").read_text()


def blocks(heading: str, lang: str) -> list[str]:
    """The ```lang blocks under one '## ' heading of the README, in order."""
    section = README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def sh(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """A recipe block in bash, `matrix` the checkout's (as `make` installs it), Ray auth off for a local run."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "disabled",
    }
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_readme_is_one_screen_per_job():
    lines = README.splitlines()
    assert len(lines) <= 250 and max(map(len, lines)) <= 200, (len(lines), max(map(len, lines)))
    assert lines[2:6] == [
        "```sh",
        "make demo   # sets up .venv, runs the embedded default sweep end to end into ./warehouse",
        "make test   # sets up .venv (and .venv-vllm for vLLM on CPU), runs the test suite",
        "```",
    ]
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", README):
        assert (REPO / link).is_file(), link


@pytest.fixture(scope="module")
def recipe_dir(tiny_model, tmp_path_factory):
    """The files the quant-author recipe names: the test model as F16, Q4_K_M and Q8_0 GGUFs, a text."""
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    d = tmp_path_factory.mktemp("recipe")
    sha = weights_digest_cached(Path(tiny_model))
    for dtype in ("f16", "q4_k_m", "q8_0"):
        os.symlink(build_for(dtype, str(tiny_model), sha, 2)["path"], d / f"model-{dtype}.gguf")
    prose = (REPO / "configs/corpus/long_prose.txt").read_text()
    (d / "wiki.test.raw").write_text(prose[: len(prose) // 3])  # a few chunks of 512
    return d


@pytest.mark.slow  # builds GGUF files and runs the recipe's commands
def test_my_gguf_against_my_reference_as_written(recipe_dir):
    (block,) = blocks("My GGUF against my reference", "sh")
    r = sh(block, recipe_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Mean    KLD:") == 2 and "model-q8_0.gguf" in r.stdout and "model-q4_k_m.gguf" in r.stdout, (
        r.stdout[-3000:]
    )
    assert (recipe_dir / "kld-wh.kld.yaml").is_file()
    admit = re.search(r"`(matrix admit [^`]+)`", README.split("## My GGUF against my reference", 1)[1]).group(1)
    r = sh(admit + " --json", recipe_dir)
    assert r.returncode in (0, 1) and '"cell_id"' in r.stdout, r.stderr[-2000:]


@pytest.mark.slow  # builds GGUF files and runs the recipe's commands
def test_sql_over_a_warehouse_as_written(recipe_dir):
    """The recipe's `warehouse` is the one the quant-author recipe made (the test above)."""
    if not (recipe_dir / "kld-wh").is_dir():
        test_my_gguf_against_my_reference_as_written(recipe_dir)
    if not (recipe_dir / "warehouse").exists():
        os.symlink(recipe_dir / "kld-wh", recipe_dir / "warehouse")
    matrix_block, duckdb_block = blocks("SQL over a warehouse", "sh")
    r = sh(matrix_block, recipe_dir)
    assert r.returncode == 0 and "kld_mean" in r.stdout and "llamacpp" in r.stdout, r.stderr[-3000:]
    if shutil.which("duckdb") is None:  # the DuckDB CLI is not a pip package: the same script through its module
        export, query = duckdb_block.strip().splitlines()
        assert sh(export, recipe_dir).returncode == 0
        sql = re.search(r'-c "(.*)"', query).group(1)
        import duckdb

        con = duckdb.connect()
        con.execute((recipe_dir / "views.sql").read_text())
        rows = con.execute(sql).fetchall()
    else:
        r = sh(duckdb_block, recipe_dir)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = r.stdout.strip().splitlines()
    assert len(rows) >= 3  # the reference and both candidates
    (py,) = blocks("SQL over a warehouse", "python")
    here = os.getcwd()
    try:
        os.chdir(recipe_dir)
        scope: dict = {}
        exec(py, scope)  # noqa: S102 - the README's own notebook cell
    finally:
        os.chdir(here)
    assert scope["rows"].num_rows >= 3 and "kld_mean" in scope["rows"].column_names


def test_the_gpu_recipes_spec_expands():
    spec = re.search(
        r"`(configs/[\w-]+\.yaml)`", README.split("## A cross-hardware sweep on a GPU cluster", 1)[1]
    ).group(1)
    r = run_cli("cells", spec, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
