"""CPU code paths as an engine option (`options: {cpu_path: ...}`): HF on the 2-layer SmolLM2 on its
native path, torch's scalar kernels and oneDNN at AVX2, the path each host ran read back from the
host, each graded against the same stack on the native path (hardware_drift) with the KL a float64
log-softmax of the stored rows gives, the same rows from two warehouses merged, and a path this CPU
cannot run or a name that is none refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from common import cpu_paths
from common.errors import UserError
from matrix.spec.cells import load_spec
from tests.conftest import llama_sweep, run_cli, sql, write_spec


def _spec(tmp_path, **over):
    body = {"models": ["smollm2-135m"], "engines": ["hf"], "dtypes": ["fp32"], "attention": ["eager"], **over}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def test_native_is_the_plain_cell_and_each_path_is_graded_against_it(tmp_path):
    (plain,) = load_spec(_spec(tmp_path)).cells
    swept = load_spec(_spec(tmp_path, options={"cpu_path": ["native", "scalar"]})).cells
    by = {c.opts.get("cpu_path", "native"): c for c in swept}
    assert by["native"].stack_id == plain.stack_id and by["native"].opts == {}  # ids of cells without a path stay
    assert by["scalar"].stack_id != plain.stack_id and by["scalar"].partner_of("cpu_path") == plain.stack_id
    (alone,) = load_spec(_spec(tmp_path, options={"cpu_path": "scalar"})).cells  # no native cell in this spec
    assert alone.stack_id == by["scalar"].stack_id and alone.partner_of("cpu_path") == plain.stack_id


def test_a_cell_on_another_device_is_graded_against_its_stack_on_the_cpu(tmp_path):
    """A GPU cell's partner is the same stack on the CPU's native path, whether the CPU cell is in its
    sweep or in a warehouse of its own (a GPU box's spec, merged in later): the ids agree."""
    both = load_spec(_spec(tmp_path, devices=["cpu", "cuda"], options={"cpu_path": ["native", "scalar"]}))
    by = {(c.device, c.opts.get("cpu_path", "native")): c for c in both.cells}
    assert set(by) == {("cpu", "native"), ("cpu", "scalar"), ("cuda", "native")}  # no CPU path on a GPU
    (skipped,) = both.skipped
    assert skipped["reason"] == "CPU code path scalar: it runs on device cpu, and this cell runs on cuda"
    cpu = by[("cpu", "native")].stack_id
    assert by[("cuda", "native")].partner_of("cpu_path") == cpu and by[("cpu", "scalar")].partner_of("cpu_path") == cpu
    assert by[("cpu", "native")].partners == ()
    (gpu,) = load_spec(_spec(tmp_path, devices=["cuda"])).cells  # the GPU box's own sweep
    assert gpu.stack_id == by[("cuda", "native")].stack_id and gpu.partner_of("cpu_path") == cpu


def test_the_reference_hardware_is_the_device_and_path_the_reference_names(tmp_path):
    """reference: {cpu_path: scalar}: every other path, native included, is graded against the scalar
    stack, and the scalar cell against none; reference: {device: cuda}: the CPU cells against the GPU's."""
    spec = load_spec(
        _spec(
            tmp_path,
            options={"cpu_path": ["native", "scalar", "avx2"]},
            reference={"engine": "hf", "cpu_path": "scalar"},
        )
    )
    by = {c.opts.get("cpu_path", "native"): c for c in spec.cells}
    assert by["scalar"].partners == ()
    assert by["native"].partner_of("cpu_path") == by["avx2"].partner_of("cpu_path") == by["scalar"].stack_id
    gpu = load_spec(
        _spec(
            tmp_path, devices=["cpu", "cuda"], options={"cpu_path": ["native", "scalar"]}, reference={"device": "cuda"}
        )
    )
    by = {(c.device, c.opts.get("cpu_path", "native")): c for c in gpu.cells}
    assert by[("cuda", "native")].partners == ()
    for key in (("cpu", "native"), ("cpu", "scalar")):
        assert by[key].partner_of("cpu_path") == by[("cuda", "native")].stack_id, key


def test_offered_is_every_path_this_cpu_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma"}))
    cells = load_spec(_spec(tmp_path, options={"cpu_path": "offered"})).cells
    assert [c.opts.get("cpu_path", "native") for c in cells] == ["native", "scalar", "avx2"]
    flags = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert cpu_paths.offered(frozenset(flags)) == list(cpu_paths.NAMES)


@pytest.mark.parametrize(
    "flags, value, line",
    [
        ({"sse4_2"}, "avx2", "options.cpu_path: this CPU cannot run CPU code path avx2: it lacks avx2, fma"),
        (
            {"avx2", "fma", "avx512f"},
            "avx512",
            "cannot run CPU code path avx512: it lacks avx512bw, avx512vl, avx512dq",
        ),
        ({"avx2", "fma"}, "amx", "cannot run CPU code path amx: it lacks avx512f"),
        (set(), "avx3", "options.cpu_path: unknown CPU code path; expected one of native, scalar, avx2"),
        ({"avx2", "fma"}, ["offered", "native"], "options.cpu_path[0]: is several values (an axis of its own)"),
    ],
)
def test_a_path_this_cpu_cannot_run_or_no_path_is_one_line(tmp_path, monkeypatch, flags, value, line):
    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: frozenset(flags))
    with pytest.raises(UserError) as e:
        load_spec(_spec(tmp_path, options={"cpu_path": value}))
    assert len(str(e.value).splitlines()) == 1 and line in str(e.value), e.value


def test_an_unknown_path_exits_2_with_one_line(tmp_path):
    r = run_cli("cells", str(_spec(tmp_path, options={"cpu_path": "cpu:avx9"})))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "options.cpu_path: unknown CPU code path" in err[0], r.stderr


def test_what_ran_is_checked_against_the_path_asked_for():
    p = cpu_paths.PATHS
    assert cpu_paths.mismatch("scalar", "DEFAULT", None) is None
    assert "torch ran its AVX512 kernels, not DEFAULT" in cpu_paths.mismatch("scalar", "AVX512", None)
    assert "where avx2 runs none" in cpu_paths.mismatch("avx2", "AVX2", "Intel AVX-512 with AVX512BW")
    assert cpu_paths.mismatch("avx512_bf16", "AVX512", "Intel AVX-512 with Intel DL Boost and bfloat16 support") is None
    amx = "Intel AVX-512 with Intel DL Boost and bfloat16 support and Intel AMX with bfloat16 and 8-bit integer support"
    assert "not AVX512_CORE_BF16" in cpu_paths.mismatch("avx512_bf16", "AVX512", amx)  # AMX is no fallback either
    assert cpu_paths.mismatch("amx", "AVX512", amx) is None and p["scalar"].env()["ATEN_CPU_CAPABILITY"] == "default"


def _capture(d, tiny_model, short_corpus, dtypes=("fp32",), options=None, reference_path="native", **more):
    spec = write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=list(dtypes),
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32", "attention": "eager"}
        | ({"cpu_path": reference_path} if reference_path else {}),
        repeats=1,
        **({"options": options} if options else {}),
        **more,
    )
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", "local")
    assert r.returncode == 0, r.stderr[-3000:]
    return wh


@pytest.fixture(scope="module")
def paths(tiny_model, short_corpus, tmp_path_factory):
    """fp32 and bf16, each on the native path, torch's scalar kernels and AVX2, with their layer
    states, in one warehouse, analysed."""
    if cpu_paths.lacks("avx2", cpu_paths.cpu_flags()):
        pytest.skip("this CPU runs no AVX2")
    d = tmp_path_factory.mktemp("cpu-path")
    wh = _capture(
        d, tiny_model, short_corpus, ("fp32", "bf16"), {"cpu_path": ["native", "scalar", "avx2"]}, layers="all"
    )
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-3000:]
    cells = {
        (c["dtype"], json.loads(c["options"] or "{}").get("cpu_path", "native")): c
        for c in sql(wh, "select * from cells")
    }
    return wh, cells, a.stdout + a.stderr


@pytest.mark.slow
def test_each_host_ran_the_path_it_was_given(paths):
    _, cells, _ = paths
    assert {k for k, c in cells.items() if c["status"] == "done"} == {
        (d, p) for d in ("fp32", "bf16") for p in ("native", "scalar", "avx2")
    }
    scalar, avx2 = (json.loads(cells[k]["settings"]) for k in (("fp32", "scalar"), ("bf16", "avx2")))
    assert (scalar["cpu_path"], scalar["cpu_capability"], scalar["onednn_isa"]) == ("scalar", "DEFAULT", None)
    assert scalar["cpu_path_env"] == {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    }
    assert (avx2["cpu_path"], avx2["cpu_capability"], avx2["onednn_isa"]) == ("avx2", "AVX2", None)
    assert "cpu_path" not in json.loads(cells[("fp32", "native")]["settings"])  # native: nothing set, nothing probed


@pytest.mark.slow
def test_hardware_drift_grades_each_path_against_native_as_float64_does(paths):
    from tests.float64_rows import log_softmax, stored

    wh, cells, out = paths
    view = sql(wh, "select * from hardware_drift")
    assert {(r["dtype"], r["cpu_path"]) for r in view} == {(d, p) for d in ("fp32", "bf16") for p in ("scalar", "avx2")}
    for r in view:
        dtype, path = r["dtype"], r["cpu_path"]
        native = cells[(dtype, "native")]["cell_id"]
        assert r["reference_hardware_cell_id"] == native and r["cell_id"] == cells[(dtype, path)]["cell_id"]
        ref = {k: log_softmax(x) for k, (x, _) in stored(wh, native).items()}
        mine = {k: log_softmax(x) for k, (x, _) in stored(wh, r["cell_id"]).items()}
        assert mine.keys() == ref.keys() and r["rows"] == len(ref)
        kl = [float(np.sum(np.exp(ref[k]) * (ref[k] - mine[k]))) for k in ref]
        same = sum(np.array_equal(stored(wh, native)[k][0], stored(wh, r["cell_id"])[k][0]) for k in ref)
        assert r["identical_rows"] == same
        assert r["kld_mean"] == pytest.approx(np.mean(kl), rel=1e-9, abs=1e-15), path
    by = {(r["dtype"], r["cpu_path"]): r for r in view}
    assert by[("fp32", "scalar")]["identical_rows"] < by[("fp32", "scalar")]["rows"]  # torch's scalar kernels
    assert "hardware" in out


def _states(wh, cell_id: str) -> dict:
    """layer -> (index, {(prompt, position): its state as float64}) of repeat 0's layer_states shard."""
    from analysis import layer_analysis as LA
    from store import Warehouse
    from store.layer_states import states_by_layer

    pf = LA._open(Warehouse(str(wh)), cell_id, 0)
    out: dict = {}
    for prompt, groups in LA._groups(pf)[0].items():
        for layer, (keys, values, index) in states_by_layer(LA._prompt_rows(pf, groups, prompt)).items():
            out.setdefault(layer, (index, {}))[1].update(zip(keys, np.asarray(values, np.float64)))
    return out


@pytest.mark.slow
def test_the_first_layer_where_two_paths_part_and_by_how_much(paths):
    """Where both sides recorded `layers:`: the shallowest state that differs on any row, and the
    largest |difference| there, as the two shards' states give them."""
    wh, _, _ = paths
    for r in sql(wh, "select * from hardware_drift"):
        mine, theirs = _states(wh, r["cell_id"]), _states(wh, r["reference_hardware_cell_id"])
        differ = {
            layer: max(float(np.abs(mine[layer][1][k] - theirs[layer][1][k]).max()) for k in mine[layer][1])
            for layer in mine
        }
        parted = sorted((mine[layer][0], layer) for layer, d in differ.items() if d > 0)
        first = parted[0][1] if parted else None  # none: every state bit-identical
        assert r["first_layer_differing"] == first, r
        assert r["first_layer_max_abs_diff"] == (differ[first] if first else None), r


@pytest.mark.slow
def test_two_warehouses_merged_grade_as_one(paths, tiny_model, short_corpus, tmp_path_factory):
    """The native cell captured in one warehouse, its scalar path in another (whose reference, its only
    cell, names no path: the reference hardware stays the CPU's native path): merged, the same
    hardware_drift row as the warehouse that holds both."""
    wh, cells, _ = paths
    d = tmp_path_factory.mktemp("cpu-path-merge")
    (d / "a").mkdir()
    (d / "b").mkdir()
    a = _capture(d / "a", tiny_model, short_corpus, layers="all")
    b = _capture(d / "b", tiny_model, short_corpus, options={"cpu_path": "scalar"}, reference_path=None, layers="all")
    r = run_cli("merge", str(b), "--into", str(a))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("analyze", "--warehouse", str(a))
    assert r.returncode == 0, r.stderr[-3000:]
    cols = (
        "cell_id, reference_hardware_cell_id, rows, identical_rows, kld_mean, kld_p99, kld_max, top1_agreement, "
        "max_abs_diff, first_layer_differing, first_layer_max_abs_diff"
    )
    merged = sql(a, f"select {cols} from hardware_drift")
    whole = sql(wh, f"select {cols} from hardware_drift where cpu_path = 'scalar' and dtype = 'fp32'")
    assert len(merged) == 1 and merged[0].keys() == whole[0].keys()
    for k, v in whole[0].items():  # floats to DuckDB's summation order (avg over files read in another order)
        assert merged[0][k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), k
    shutil.rmtree(d)


AVX512 = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")


def test_a_path_cell_is_graded_against_its_native_partner_from_its_own_host():
    """Two native captures of the stack, one from each of two machines: the path cell's partner is
    the one from its own host (CPU flags are outside the engine build's hash)."""
    from analysis.hardware_drift import PARTNERING
    from analysis.partner_drift import pairs
    from store.cell_rows import CellRow

    def row(cid, sid, host, **more):
        base = {"model": "m", "engine": "hf", "dtype": "fp32", "attention": "eager", "status": "done", "build": "b"}
        return CellRow.of({**base, "cell_id": cid, "stack_id": sid, "host": host, **more})

    native = [row(f"n@{h}", "n", h, finished_at=t) for h, t in (("wide", 1), ("narrow", 2))]
    path = row("p@b", "p", "wide", cpu_path_of="n")
    assert pairs(PARTNERING, [*native, path]) == [(path, native[0])]  # not the newer capture on "narrow"


def test_a_path_is_placed_only_on_nodes_whose_cpu_runs_it(tmp_path, monkeypatch):
    """Faked nodes: two probe answers of one build, an AVX-512 node and an AVX2-only one. The
    native cell may run on either; the avx512 cell is pinned to the AVX-512 node; with no such
    node it is left out of the run, saying which node lacks what."""
    from matrix.run import builds

    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: frozenset(AVX512))  # the driver's, for the spec
    cells = load_spec(_spec(tmp_path, options={"cpu_path": ["native", "avx512"]})).cells
    native, avx512 = sorted(cells, key=lambda c: "cpu_path" in c.opts)
    node = {"build": "b" * 12, "libraries": {}}
    wide = {**node, "node_id": "n-wide", "host": "wide", "cpu_flags": sorted(AVX512)}
    narrow = {**node, "node_id": "n-narrow", "host": "narrow", "cpu_flags": ["avx2", "fma"]}
    both = {c.stack_id: [wide, narrow] for c in cells}
    bound, _, left_out = builds.bind(cells, both, {}, lambda line: None)
    pins = {c.stack_id: c.pin for c in bound}
    assert left_out == {} and pins == {native.stack_id: ("n-narrow", "n-wide"), avx512.stack_id: ("n-wide",)}
    bound, _, left_out = builds.bind(cells, {c.stack_id: [narrow] for c in cells}, {}, lambda line: None)
    assert [c.stack_id for c in bound] == [native.stack_id]
    assert left_out == {
        avx512.stack_id: "no node that can host it runs it: cpu_path avx512: narrow lacks avx512f, avx512bw, "
        "avx512vl, avx512dq"
    }


def test_every_probe_answer_carries_its_cpu_flags_outside_the_build_hash(monkeypatch):
    from common.builds import engine_build

    plain = engine_build(["numpy"])
    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: frozenset({"sse4_2"}))
    other = engine_build(["numpy"])
    assert other["cpu_flags"] == ["sse4_2"] and other["build"] == plain["build"]


@pytest.mark.slow
def test_the_atlas_and_the_ladder_read_well_in_chromium(paths, tmp_path):
    """The report's CPU-path section in headless Chromium: the atlas (stacks x paths) and the KL
    ladder drawn, their labels apart, the hardware table there; the card's line beside it."""
    from tests.test_report_browser import CHROMIUM, check_report

    if CHROMIUM is None:
        pytest.skip("Debian chromium is not installed (.ci/run installs it)")
    wh, cells, _ = paths
    got = check_report(wh, tmp_path, ["hardware-atlas-0", "hardware-ladder-0"])
    charts = {c["id"]: c for c in got["charts"]}
    assert {"scalar", "avx2", "hf/fp32", "hf/bf16"} <= set(charts["hardware-atlas-0"]["labels"])
    assert "hardware-rows-0" in (tmp_path / "rep" / "report.html").read_text()
    r = run_cli("card", cells[("bf16", "native")]["cell_id"], "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    at = lines.index("Across hardware (the same stack on the reference hardware, row by row):")
    assert "on avx2" in lines[at + 2] and "on scalar" in lines[at + 2], lines[at : at + 8]


def test_llama_cpp_refuses_amx_with_its_reason_and_takes_the_other_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: frozenset(AVX512 + ("avx512_bf16", "amx_tile", "amx_bf16")))
    spec = load_spec(
        _spec(tmp_path, engines=["llamacpp"], dtypes=["f16"], attention=["default"], options={"cpu_path": "offered"})
    )
    assert sorted(c.opts.get("cpu_path", "native") for c in spec.cells) == sorted(
        ["native", "scalar", "avx2", "avx512", "avx512_bf16"]
    )
    (amx,) = spec.skipped
    assert amx["reason"] == (
        "CPU code path amx: llama.cpp's AMX matmul crashes on some Xeons (ggml-org/llama.cpp#20824); its AMX stays off"
    )


def test_a_paths_directory_holds_the_packages_libraries_with_the_variant_as_its_cpu_backend(tmp_path, monkeypatch):
    """The package's libraries copied, the variant under every name of its libggml-cpu, a partial directory of
    an earlier try cleared; a package with no libggml-cpu of its own is refused in one line."""
    from backends import llamacpp_cpu_path as P

    pkg, root, module = tmp_path / "lib", tmp_path / "tree", tmp_path / "libggml-cpu-haswell.so"
    pkg.mkdir()
    for name in ("libllama.so", "libggml.so.0", "libggml-base.so.0"):
        (pkg / name).write_bytes(name.encode())
    module.write_bytes(b"haswell")
    monkeypatch.setattr(P, "_package_libs", lambda: pkg)
    with pytest.raises(RuntimeError, match="have no libggml-cpu of their own"):
        P._assembled(root, module)
    for name in ("libggml-cpu.so", "libggml-cpu.so.0"):
        (pkg / name).write_bytes(b"the package's own")
    partial = root / "paths" / "libggml-cpu-haswell-0123456789"
    partial.mkdir(parents=True)
    out = P._assembled(root, module)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        "libllama.so": b"libllama.so",
        "libggml.so.0": b"libggml.so.0",
        "libggml-base.so.0": b"libggml-base.so.0",
        "libggml-cpu.so": b"haswell",
        "libggml-cpu.so.0": b"haswell",
    }
    assert not partial.exists() and P._assembled(root, module) == out


@pytest.fixture(scope="module")
def llama_paths(tiny_model, short_corpus, tmp_path_factory):
    """llama.cpp F16 on the package's own CPU backend (native) and on ggml's haswell variant (avx2),
    which its host builds into the tools cache on first use, analysed."""
    pytest.importorskip("llama_cpp")
    if cpu_paths.lacks("avx2", cpu_paths.cpu_flags()):
        pytest.skip("this CPU runs no AVX2")
    wh, rows, _ = llama_sweep(
        tmp_path_factory.mktemp("llama-path"),
        tiny_model,
        short_corpus,
        options={"cpu_path": ["native", "avx2"]},
        reference={"engine": "llamacpp", "dtype": "f16", "attention": "default", "cpu_path": "native"},
    )
    cells = {json.loads(c["options"] or "{}").get("cpu_path", "native"): c for c in rows}
    return wh, cells


@pytest.mark.slow
def test_llama_cpp_runs_the_variant_it_loaded_graded_as_float64_does(llama_paths):
    from tests.float64_rows import log_softmax, stored

    wh, cells = llama_paths
    ran = json.loads(cells["avx2"]["settings"])
    assert ran["ggml_cpu_variant"] == "haswell" and ran["ggml_cpu_module"].endswith("libggml-cpu-haswell.so")
    assert "AVX2 = 1" in ran["ggml_cpu_features"] and "AVX512 = 1" not in ran["ggml_cpu_features"]
    assert "ggml_cpu_variant" not in json.loads(cells["native"]["settings"])
    card = run_cli("card", cells["avx2"]["cell_id"], "--warehouse", str(wh), "--json")
    assert card.returncode == 0, card.stderr[-2000:]
    said = json.loads(card.stdout)["disclosure"]["cpu_path"]
    assert said == {"candidate": "avx2 (ggml's haswell CPU backend)", "reference": "native"}, said
    (r,) = sql(wh, "select * from hardware_drift")
    assert (r["hardware"], r["cell_id"], r["reference_hardware_cell_id"]) == (
        "avx2",
        cells["avx2"]["cell_id"],
        cells["native"]["cell_id"],
    )
    ref = {k: log_softmax(x) for k, (x, _) in stored(wh, r["reference_hardware_cell_id"]).items()}
    mine = {k: log_softmax(x) for k, (x, _) in stored(wh, r["cell_id"]).items()}
    kl = [float(np.sum(np.exp(ref[k]) * (ref[k] - mine[k]))) for k in ref]
    assert r["rows"] == len(ref) and r["kld_mean"] == pytest.approx(np.mean(kl), rel=1e-9, abs=1e-15)
