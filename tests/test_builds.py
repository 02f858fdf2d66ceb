"""The engine build is part of a cell: a new build captures new cells (or, when asked, reuses the
old ones), nodes of one device class with different builds are told apart, and `replicas:`
puts the same stack on several nodes so that cross-host byte identity is a query.

"Another build" here is a real one: a copy of the installed safetensors (a library the HF backend
names) with one source file changed, installed where pip would put it (its RECORD rewritten with
the new file's hash), and put first on a node's PYTHONPATH. The engine really imports it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from common.builds import engine_build
from tests.conftest import REPO, run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

HF_LIBS = ("torch", "transformers", "accelerate", "safetensors")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def rebuilt_safetensors(tmp_path_factory) -> Path:
    """A site directory holding safetensors rebuilt with one changed source file."""
    dist = metadata.distribution("safetensors")
    site = Path(dist.locate_file(""))
    out = tmp_path_factory.mktemp("rebuilt-site")
    shutil.copytree(site / "safetensors", out / "safetensors")
    info = Path(dist._path)  # the .dist-info directory
    shutil.copytree(info, out / info.name)
    init = out / "safetensors" / "__init__.py"
    init.write_bytes(init.read_bytes() + b"\n# rebuilt for the build test\n")
    lines = []
    for line in (out / info.name / "RECORD").read_text().splitlines():
        if line.startswith("safetensors/__init__.py,"):
            line = f"safetensors/__init__.py,{_record_hash(init.read_bytes())},{init.stat().st_size}"
        lines.append(line)
    (out / info.name / "RECORD").write_text("\n".join(lines) + "\n")
    return out


def _build_with(pythonpath: Path | None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(pythonpath or ""), str(REPO)) if p)}
    code = f"from common.builds import engine_build; print(engine_build({HF_LIBS!r})['build'])"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def _wheel(path: Path, version: str, body: bytes) -> Path:
    """A real (pure-Python) wheel of distribution `buildprobe`, with a console script."""
    files = {
        "buildprobe/__init__.py": body,
        f"buildprobe-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: buildprobe\nVersion: {version}\n".encode()
        ),
        f"buildprobe-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"buildprobe-{version}.dist-info/entry_points.txt": b"[console_scripts]\nbuildprobe = buildprobe:main\n",
    }
    record = (
        "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in files.items())
        + f"buildprobe-{version}.dist-info/RECORD,,\n"
    )
    whl = path / f"buildprobe-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"buildprobe-{version}.dist-info/RECORD", record)
    return whl


def test_build_is_the_installed_files_not_the_install_location(tmp_path):
    """pip installs the same wheel in two places: one build. Same version, other bytes (another
    compile): another build. Another version: another build."""
    wheels = {"a": _wheel(tmp_path, "1.0", b"def main():\n    return 1\n")}
    (tmp_path / "b").mkdir()
    wheels["b"] = _wheel(tmp_path / "b", "1.0", b"def main():\n    return 2\n")  # same version, rebuilt
    (tmp_path / "c").mkdir()
    wheels["c"] = _wheel(tmp_path / "c", "1.1", b"def main():\n    return 1\n")
    builds = {}
    for name, whl in [("a", wheels["a"]), ("a2", wheels["a"]), ("b", wheels["b"]), ("c", wheels["c"])]:
        target = tmp_path / f"site-{name}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-index",
                "--target",
                str(target),
                str(whl),
            ],
            check=True,
        )
        code = "import json; from common.builds import engine_build; print(json.dumps(engine_build(['buildprobe'])))"
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{REPO}"},
        ).stdout
        builds[name] = json.loads(out)
    assert (tmp_path / "site-a" / "bin" / "buildprobe").exists()  # a script whose shebang names the interpreter
    assert builds["a"] == builds["a2"]
    assert (
        builds["a"]["libraries"]["buildprobe"]["version"] == builds["b"]["libraries"]["buildprobe"]["version"] == "1.0"
    )
    assert len({builds[k]["build"] for k in ("a", "b", "c")}) == 3
    assert engine_build(["no-such-distribution"])["libraries"] == {
        "no-such-distribution": {"version": None, "files": None}
    }


def _run(spec: Path, wh: Path, *extra: str, pythonpath: Path | None = None, address: str | None = None):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["run", str(spec), "--warehouse", str(wh), "--json", *extra] + (["--address", address] if address else [])
    r = subprocess.run(
        [sys.executable, "-m", "matrix", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr


def test_a_new_build_captures_new_cells_unless_told_to_reuse(tiny_model, short_corpus, rebuilt_safetensors, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
    )
    wh = tmp_path / "wh"
    old, new = _build_with(None), _build_with(rebuilt_safetensors)
    assert old != new
    first, _ = _run(spec, wh)
    assert first["cells_run"] == 1
    (cell,) = sql(wh, "select * from cells")
    stack = cell["stack_id"]
    assert cell["cell_id"] == f"{stack}@{old[:8]}" and cell["build"] == old and cell["replica"] == 0
    assert json.loads(cell["build_libraries"])["safetensors"]["version"] == metadata.version("safetensors")

    # this machine's safetensors is now the rebuilt one: `matrix cells` says what a run would do
    env = {**os.environ, "PYTHONPATH": f"{rebuilt_safetensors}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, "-m", "matrix", "cells", str(spec), "--warehouse", str(wh), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["cells"]
    assert c["build"] == new and [b["build"] for b in c["captured"]] == [old]
    assert c["action"] == f"capture again as build {new} (or --reuse-cells-from-other-builds: {cell['cell_id']})"

    reused, _ = _run(spec, wh, "--reuse-cells-from-other-builds", pythonpath=rebuilt_safetensors)
    assert reused["cells_run"] == 0 and reused["reused"] == {stack: cell["cell_id"]}
    assert len(sql(wh, "select * from runs")) == 1  # nothing to do: no run recorded

    second, _ = _run(spec, wh, pythonpath=rebuilt_safetensors)
    assert second["cells_run"] == 1
    cells = sql(wh, "select cell_id, build, stack_id, status from cells order by finished_at")
    assert [(c["cell_id"], c["build"], c["stack_id"]) for c in cells] == [
        (f"{stack}@{old[:8]}", old, stack),
        (f"{stack}@{new[:8]}", new, stack),
    ]
    (pair,) = sql(wh, "select * from stack_identity")
    assert {pair["build_a"], pair["build_b"]} == {old, new}
    assert pair["rows"] == cell["rows_per_repeat"] > 0 and pair["identical"]  # a comment changes no logit
    again, _ = _run(spec, wh, pythonpath=rebuilt_safetensors)
    assert again["cells_run"] == 0 and again["reused"] == {}

    r = run_cli("analyze", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    refs = sql(wh, "select distinct reference_cell_id from metrics")
    assert refs == [{"reference_cell_id": f"{stack}@{new[:8]}"}]  # the newest capture of the reference stack


@pytest.fixture(scope="module")
def two_builds(rebuilt_safetensors):
    """A cluster of two CPU nodes whose HF builds differ (the head runs nothing)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    plain = c.add_node(num_cpus=2)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(rebuilt_safetensors), saved) if p)
    try:  # the node's raylet, and so its workers, start with the rebuilt library first on the path
        rebuilt = c.add_node(num_cpus=2)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    c.wait_for_nodes()
    try:
        yield (
            c,
            {
                "plain": (plain.node_id, _build_with(None)),
                "rebuilt": (rebuilt.node_id, _build_with(rebuilt_safetensors)),
            },
        )
    finally:
        c.shutdown()


def test_replicas_run_on_distinct_nodes_with_their_own_builds(two_builds, tiny_model, short_corpus, tmp_path):
    c, nodes = two_builds
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
        replicas=2,
    )
    wh = tmp_path / "wh"
    first, _ = _run(spec, wh, address=c.address)
    assert first["cells_run"] == 2
    cells = sql(wh, "select cell_id, stack_id, replica, build, node_id, is_reference from cells order by replica")
    assert {(x["node_id"], x["build"]) for x in cells} == set(nodes.values())  # each replica: its node's build
    assert cells[0]["stack_id"] == cells[1]["stack_id"] and [x["replica"] for x in cells] == [0, 1]
    assert cells[1]["cell_id"] == f"{cells[0]['stack_id']}.r1@{cells[1]['build'][:8]}"
    assert [x["is_reference"] for x in cells] == [True, False]
    (pair,) = sql(wh, "select * from stack_identity")
    assert pair["node_a"] != pair["node_b"] and pair["identical"] and pair["identical_rows"] == pair["rows"] > 0

    # one replica now: replica 0's stack is captured by one of the two builds, so nothing to do
    one = write_spec(
        tmp_path / "one.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
    )
    again, log = _run(one, wh, address=c.address)
    assert again["cells_run"] == 0, log[-2000:]
    assert "differ in hf build" in log and "(already captured)" in log


def test_a_cell_on_nodes_of_two_builds_is_pinned_to_one(two_builds, tiny_model, short_corpus, tmp_path):
    c, nodes = two_builds
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32", "bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=1,
        max_tokens=24,
    )
    wh = tmp_path / "wh"
    out, log = _run(spec, wh, address=c.address)
    assert out["cells_run"] == 2
    cells = sql(wh, "select build, node_id from cells")
    chosen = min(b for _, b in nodes.values())  # a tie: the smaller build id, for every cell alike
    assert {(x["node_id"], x["build"]) for x in cells} == {next(v for v in nodes.values() if v[1] == chosen)}
    assert f"it runs on build {chosen} (most nodes)" in log
