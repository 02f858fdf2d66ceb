"""`hosts: shared`: cells of the same weights run in turn in one host on one loaded model (HF switches
its attention implementation), with the rows one host per cell gives, bit for bit; a cell that
fails there is its own failure, and the cells queued behind it start on a fresh host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, sql, write_spec

ATTENTION = ["eager", "sdpa_math", "sdpa_flash"]
HASHES = (
    "select c.stack_id, l.prompt_id, l.position, l.row_hash from logits l join cells c using (cell_id) order by all"
)


def _spec(d: Path, tiny_model: Path, short_corpus: Path, hosts: str, **over) -> Path:
    body = {
        "dtypes": ["fp32", "bf16"],
        "attention": ATTENTION,
        "reference": {"engine": "hf", "dtype": "fp32", "attention": "eager"},
        "repeats": 1,
        "stride": 1,
        "hosts": hosts,
    }
    return write_spec(d / f"{hosts}.yaml", tiny_model, short_corpus, **{**body, **over})


def _run(spec: Path, wh: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "matrix", "run", str(spec), "--warehouse", str(wh), "--executor", "local"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def per_cell(tiny_model, short_corpus, tmp_path_factory) -> Path:
    """The same cells, each loaded in a host of its own."""
    d = tmp_path_factory.mktemp("per_cell")
    p = _run(_spec(d, tiny_model, short_corpus, "per_cell"), d / "wh")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    return d / "wh"


@pytest.mark.slow  # `matrix run` captures end to end
def test_one_load_per_dtype_gives_the_rows_of_one_host_per_cell(per_cell, tiny_model, short_corpus, tmp_path):
    p = _run(_spec(tmp_path, tiny_model, short_corpus, "shared"), tmp_path / "wh")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    cells = sql(tmp_path / "wh", "select cell_id, dtype, attention, status, loaded_by from cells")
    assert len(cells) == 6 and {c["status"] for c in cells} == {"done"}
    for dtype in ("fp32", "bf16"):  # one load per dtype; the others took that model over, in turn
        mine = [c for c in cells if c["dtype"] == dtype]
        loader = [c for c in mine if c["loaded_by"] is None]
        assert len(loader) == 1, mine
        assert {c["loaded_by"] for c in mine if c is not loader[0]} == {loader[0]["cell_id"]}
    assert len(re.findall(r"took over the model", err)) == 4
    assert {c["loaded_by"] for c in sql(per_cell, "select loaded_by from cells")} == {None}
    rows = sql(tmp_path / "wh", HASHES)
    assert len(rows) > 1000 and rows == sql(per_cell, HASHES)  # every row's hash, stack by stack


@pytest.mark.slow  # `matrix run` captures end to end
def test_a_cell_failing_in_a_shared_host_leaves_the_others_rows(per_cell, tiny_model, short_corpus, tmp_path):
    """The fp32 host is killed while its second cell runs (retries: 0, so that cell fails): the
    first cell's rows stay, and the third starts on a fresh host and lands the rows it lands alone."""
    wh = tmp_path / "wh"
    p = _run(_spec(tmp_path, tiny_model, short_corpus, "shared", dtypes=["fp32"], retries=0), wh)
    killed = None
    for line in p.stderr:
        m = re.search(r"fp32\.sdpa_math\S* took over the model .* \(pid (\d+)\)", line)
        if m and killed is None:
            killed = int(m.group(1))
            os.kill(killed, signal.SIGKILL)
    p.wait(timeout=900)
    assert killed is not None and p.returncode == 1  # a failed cell: the run says so
    cells = {c["attention"]: c for c in sql(wh, "select attention, status, error, loaded_by from cells")}
    assert cells["sdpa_math"]["status"] == "failed" and "SIGKILL" in cells["sdpa_math"]["error"]
    assert cells["eager"]["status"] == cells["sdpa_flash"]["status"] == "done"
    assert cells["sdpa_flash"]["loaded_by"] is None  # a fresh host loaded it
    mine = sql(wh, HASHES)
    theirs = [r for r in sql(per_cell, HASHES) if ".fp32.sdpa_math." not in r["stack_id"] and ".fp32." in r["stack_id"]]
    assert len(mine) > 500 and mine == theirs
    assert [r["cells_failed"] for r in sql(wh, "select cells_failed from runs")] == [1]


@pytest.mark.slow  # `matrix run` captures end to end
def test_ray_actors_are_shared_too(swept):
    """The Ray executor's sweep (fp32 and bf16, eager and sdpa): one actor load per dtype."""
    cells = sql(swept[1], "select cell_id, dtype, loaded_by from cells")
    for dtype in ("fp32", "bf16"):
        mine = [c for c in cells if c["dtype"] == dtype]
        loader = [c["cell_id"] for c in mine if c["loaded_by"] is None]
        assert len(mine) == 2 and len(loader) == 1 and {c["loaded_by"] for c in mine} == {None, loader[0]}


def test_cells_per_gpu_shares_each_gpu_among_that_many_hosts():
    """The local executor's GPU pool (`cells_per_gpu: 2`): tp 1 hosts take half a GPU each, the
    freest GPU first, and a whole-GPU host waits until one is free of them."""
    from fractions import Fraction

    from matrix.run.local import LocalExecutor
    from matrix.run.local_worker import Worker

    ex = LocalExecutor()
    ex.gpu_free = {"0": Fraction(1), "1": Fraction(1)}
    half = [Worker(f"c{i}", (), 1, 1, None, Fraction(1, 2)) for i in range(4)]
    whole = Worker("w", (), 1, 1, None, Fraction(1))
    got = []
    for w in half:
        ids = ex._gpus_for(w)
        for g in ids:
            ex.gpu_free[g] -= w.gpu_part
        w.gpu_ids = ids
        got.append(ids)
    assert got == [["0"], ["1"], ["0"], ["1"]] and ex._gpus_for(half[0]) is None and ex._gpus_for(whole) is None
    ex.running = half[:2]
    ex._release(half[0])
    assert ex._gpus_for(whole) is None  # GPU 0 still holds half[2]
    ex.running = [half[2]]
    ex._release(half[2])
    assert ex._gpus_for(whole) == ["0"]
