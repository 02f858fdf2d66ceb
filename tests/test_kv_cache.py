"""KV cache types as a plug-in engine option: llama.cpp's every cache type, K and V apart, swept as
an axis on the 2-layer SmolLM2 (the rows, what the settings record, and each cache graded against
the same stack on f16: its partner cell, the kv_cache_drift view, its card line and report table),
measured by `matrix kld --kv-cache`, and refused in one line where the value is no cache type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from common import kv_cache
from common.errors import UserError
from matrix.spec.cells import load_spec
from tests.conftest import REPO, llama_sweep, run_cli, sql

AXIS = ["f16", "q8_0", "q4_0", {"k": "q8_0", "v": "q4_0"}]


def test_every_type_llama_cpp_takes_maps_to_its_ggml_type():
    lc = pytest.importorskip("llama_cpp")
    from backends.llamacpp_contexts import KV_TYPES

    assert set(KV_TYPES) == set(kv_cache.TYPES)
    for name, number in KV_TYPES.items():  # llama-cpp-python exports all but BF16 (ggml.h: 30)
        assert getattr(lc, f"GGML_TYPE_{name.upper()}", 30) == number, name


@pytest.mark.parametrize(
    "given, normal",
    [
        ("q8_0", "q8_0"),
        ({"k": "q8_0", "v": "q8_0"}, "q8_0"),  # K and V alike: the plain type, one cell
        ({"k": "q8_0"}, "q8_0,f16"),  # a part left out: llama.cpp's default
        ("q8_0,q4_0", "q8_0,q4_0"),
        ({"k": "q8_0", "v": "q4_0"}, "q8_0,q4_0"),  # a mapping and K,V: one encoding
    ],
)
def test_a_value_has_one_encoding(given, normal):
    assert kv_cache.parse(given, lambda *a: AssertionError(a)) == normal
    kv = kv_cache.KVCache.of(normal)
    assert kv.label == normal and kv_cache.parse(kv.label, lambda *a: AssertionError(a)) == normal
    assert kv.settings() == {"kv_cache_k": "q8_0", "kv_cache_v": normal.split(",")[-1]}
    # the {k, v} mapping an older cell's options may hold, and the settings, read as the same value
    assert kv_cache.KVCache.of({"k": kv.k, "v": kv.v}) == kv == kv_cache.KVCache.ran(kv.settings())
    assert kv_cache.KVCache.ran({"kv_cache": "q8_0"}) == kv_cache.KVCache("q8_0", "q8_0")


def _spec(tmp_path: Path, **over) -> Path:
    body = {"models": ["smollm2-135m"], "engines": ["llamacpp"], "dtypes": ["f16"], "attention": ["default"], **over}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def test_an_axis_of_caches_keeps_each_plain_types_cell_id(tmp_path):
    axis = load_spec(_spec(tmp_path, options={"kv_cache": AXIS}))
    ids = {kv_cache.KVCache.of(c.opts["kv_cache"]).label: c.stack_id for c in axis.cells}
    assert list(ids) == ["f16", "q8_0", "q4_0", "q8_0,q4_0"]
    for plain in ("f16", "q8_0", {"k": "q4_0", "v": "q4_0"}):  # the id a spec of that one value gives
        (one,) = load_spec(_spec(tmp_path, options={"kv_cache": plain})).cells
        label = kv_cache.KVCache.of(plain).label
        assert one.stack_id == ids[label] and one.opts == {"kv_cache": label}


@pytest.mark.parametrize(
    "options, line",
    [
        ({"kv_cache": "q3"}, "options.kv_cache: expected one of f32, f16, bf16, q8_0"),
        ({"kv_cache": {"k": "q8_0", "x": "f16"}}, "options.kv_cache.x: unknown key; expected k"),
        ({"kv_cache": {"k": "q3_k"}}, "options.kv_cache.k: expected one of f32"),
        ({"kv_cache": ["q8_0", {"k": "q8_0", "v": "q8_0"}]}, "options.kv_cache: has duplicate values"),
        ({"kv_cache": ["f16", "q9"]}, "options.kv_cache[1]: expected one of"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field_and_value(tmp_path, options, line):
    with pytest.raises(UserError) as e:
        load_spec(_spec(tmp_path, options=options))
    assert len(str(e.value).splitlines()) == 1 and line in str(e.value), e.value


def test_a_bad_value_exits_2_with_one_line(tmp_path):
    r = run_cli("cells", str(_spec(tmp_path, include=[{"engine": "llamacpp", "kv_cache": {"k": "q8_0", "x": "f16"}}])))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "include[0].kv_cache.x: unknown key" in err[0], r.stderr


@pytest.fixture(scope="module")
def kv_sweep(tiny_model, short_corpus, tmp_path_factory):
    """llama.cpp f16 weights under each cache of AXIS, f16 the reference, and eager + q4_0 (skipped)."""
    pytest.importorskip("llama_cpp")
    wh, cells, err = llama_sweep(
        tmp_path_factory.mktemp("kv"),
        tiny_model,
        short_corpus,
        options={"kv_cache": AXIS},
        include=[{"engine": "llamacpp", "dtype": "f16", "attention": "eager", "kv_cache": "q4_0"}],
        reference={"engine": "llamacpp", "attention": "default", "kv_cache": "f16"},
    )
    done = {kv_cache.KVCache.of(json.loads(c["options"])["kv_cache"]).label: c for c in cells if c["status"] == "done"}
    return wh, done, [line for line in err.splitlines() if line.startswith("skipping ")]


@pytest.mark.slow
def test_each_cache_runs_with_its_types_and_flash_attention_recorded(kv_sweep):
    _, done, skipped = kv_sweep
    assert list(sorted(done)) == sorted(["f16", "q8_0", "q4_0", "q8_0,q4_0"])
    for name, c in done.items():
        s = json.loads(c["settings"])
        k, v = kv_cache.KVCache.of(name).k, kv_cache.KVCache.of(name).v
        assert (s["kv_cache_k"], s["kv_cache_v"]) == (k, v)
        assert s["flash_attn"] == ("default" if v == "f16" else "flash_attn")  # a quantised V turns it on
    (eager,) = skipped  # the spec's own combination, never run
    assert ".llamacpp.f16.eager." in eager and eager.endswith(
        ": a quantised V cache (q4_0) requires flash attention in llama.cpp, and attention eager turns it off"
    )


@pytest.mark.slow
def test_a_quantised_cache_moves_the_rows_a_little_and_q4_0_more_than_q8_0(kv_sweep):
    wh, done, _ = kv_sweep
    hashes = {
        n: {(r["prompt_id"], r["position"]): r["row_hash"] for r in sql(wh, _rows(c["cell_id"]))}
        for n, c in done.items()
    }
    assert hashes["f16"].keys() == hashes["q8_0"].keys()
    assert sum(hashes["f16"][k] != hashes["q8_0"][k] for k in hashes["f16"]) > len(hashes["f16"]) // 2
    kld = {
        n: sql(wh, f"select kld_mean from summary where cell_id = '{c['cell_id']}'")[0]["kld_mean"]
        for n, c in done.items()
    }
    assert kld["f16"] == 0 and 0 < kld["q8_0"] < 1e-3, kld
    assert kld["q4_0"] >= kld["q8_0"] and kld["q8_0,q4_0"] >= kld["q8_0"], kld


def _rows(cell_id: str) -> str:
    return f"select prompt_id, position, row_hash from logits where cell_id = '{cell_id}'"


@pytest.mark.slow
def test_stack_names_tell_the_caches_apart(kv_sweep):
    wh, _, _ = kv_sweep
    r = run_cli("stacks", "--warehouse", str(wh), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    names = {s["name"] for s in json.loads(r.stdout)["stacks"]}
    assert {"llamacpp/f16/kv_cache=f16", "llamacpp/f16/kv_cache=q8_0,q4_0"} <= names, names


@pytest.mark.slow
def test_the_position_bucket_view_gives_each_caches_kl_as_float64_over_the_stored_rows(kv_sweep):
    """position_buckets over the sweep: each cache's KL against the f16 cache per bucket, as a
    float64 log-softmax of both cells' stored float32 rows gives it (the same rows, a kernel's
    exp/log and summation order apart: ~1e-11 relative)."""
    import numpy as np

    from tests.float64_rows import bucket, log_softmax, stored

    wh, done, _ = kv_sweep

    def rows(cell_id: str) -> dict:
        return {key: log_softmax(x) for key, (x, _) in stored(wh, cell_id).items()}

    ref = rows(done["f16"]["cell_id"])
    view = sql(wh, "select * from position_buckets")
    for name in ("q8_0", "q4_0", "q8_0,q4_0"):
        by: dict[str, list[float]] = {}
        for key, lq in rows(done[name]["cell_id"]).items():
            by.setdefault(bucket(key[1]), []).append(float(np.sum(np.exp(ref[key]) * (ref[key] - lq))))
        got = {r["bucket"]: r for r in view if r["cell_id"] == done[name]["cell_id"] and r["rows"]}
        assert set(got) == set(by), (name, got.keys(), by.keys())
        for label, kl in by.items():
            assert got[label]["rows"] == len(kl)
            assert got[label]["kld_mean"] == pytest.approx(np.mean(kl), rel=1e-9), (name, label)
            assert got[label]["kld_stderr"] == pytest.approx(np.std(kl, ddof=1) / np.sqrt(len(kl)), rel=1e-8)


def test_each_cache_names_the_f16_stack_it_is_graded_against(tmp_path):
    """The partner is the same stack with `kv_cache: f16` where the sweep has it, else the stack
    without the option (what `matrix kld` runs a file's plain candidate as); f16 itself has none."""
    swept = load_spec(_spec(tmp_path, options={"kv_cache": AXIS}))
    by = {kv_cache.KVCache.of(c.opts["kv_cache"]).label: c for c in swept.cells}
    assert by["f16"].partners == ()
    for name in ("q8_0", "q4_0", "q8_0,q4_0"):
        assert by[name].partners == (("kv_cache", by["f16"].stack_id),), name
    (q8,) = load_spec(_spec(tmp_path, include=[{"engine": "llamacpp", "kv_cache": "q8_0"}])).cells
    (plain,) = load_spec(_spec(tmp_path)).cells
    assert plain.opts == {} and q8.partner_of("kv_cache") == plain.stack_id


def test_a_partner_follows_the_reference_when_it_records_more_rows(tmp_path):
    """A reference that records another cell's extra rows takes another stack id (its decode rows
    beside its own); a cache graded against it names that id, not the one it had before."""
    spec = _spec(
        tmp_path,
        dtypes=["f16", "q8_0"],
        options={"kv_cache": ["f16", "q8_0"]},
        reference={"engine": "llamacpp", "dtype": "f16", "kv_cache": "f16"},
        include=[{"engine": "llamacpp", "dtype": "q8_0", "decode": {"steps": 2, "at": [4]}}],
    )
    m = load_spec(spec)
    ref = m.reference_stacks["smollm2-135m"]
    (q8,) = [c for c in m.cells if c.dtype == "f16" and c.opts["kv_cache"] == "q8_0"]
    assert dict(next(c for c in m.cells if c.stack_id == ref).extras).get("decode")  # it records the decode rows
    assert q8.partner_of("kv_cache") == ref and ref in {c.stack_id for c in m.cells}


@pytest.mark.slow
def test_the_kv_cache_drift_view_is_each_caches_kl_against_f16_in_float64(kv_sweep):
    """Row by row against the f16 cell (its partner, cells.kv_cache_of): KL(f16 || cache) of the
    stored float32 rows' float64 log-softmax, bit-identity from the row hashes."""
    import numpy as np

    from tests.float64_rows import log_softmax, stored

    wh, done, _ = kv_sweep
    f16 = {k: log_softmax(x) for k, (x, _) in stored(wh, done["f16"]["cell_id"]).items()}
    f16_hash = {(r["prompt_id"], r["position"]): r["row_hash"] for r in sql(wh, _rows(done["f16"]["cell_id"]))}
    view = {r["cell_id"]: r for r in sql(wh, "select * from kv_cache_drift")}
    assert done["f16"]["cell_id"] not in view and len(view) == 3
    for name in ("q8_0", "q4_0", "q8_0,q4_0"):
        c = done[name]
        assert c["kv_cache_of"] == done["f16"]["stack_id"]
        got = view[c["cell_id"]]
        assert got["f16_cell_id"] == done["f16"]["cell_id"]
        assert (got["kv_cache_k"], got["kv_cache_v"]) == (kv_cache.KVCache.of(name).k, kv_cache.KVCache.of(name).v)
        rows = stored(wh, c["cell_id"])
        kl = [float(np.sum(np.exp(f16[k]) * (f16[k] - log_softmax(x)))) for k, (x, _) in rows.items()]
        same = sum(r["row_hash"] == f16_hash[(r["prompt_id"], r["position"])] for r in sql(wh, _rows(c["cell_id"])))
        assert got["rows"] == len(kl) and got["identical_rows"] == same < len(kl)
        assert got["kld_mean"] == pytest.approx(np.mean(kl), rel=1e-9), name
        assert got["kld_stderr"] == pytest.approx(np.std(kl, ddof=1) / np.sqrt(len(kl)), rel=1e-8), name
        assert got["kld_max"] == pytest.approx(max(kl), rel=1e-9), name
    assert view[done["q4_0"]["cell_id"]]["kld_mean"] > view[done["q8_0"]["cell_id"]]["kld_mean"]


@pytest.mark.slow
def test_a_caches_card_and_the_report_grade_it_against_f16(kv_sweep, tmp_path):
    wh, done, _ = kv_sweep
    r = run_cli("card", done["q4_0"]["cell_id"], "--warehouse", str(wh), "--allow-undisclosed")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("- K q4_0, V q4_0 against the f16 cache: KL ")]
    got = sql(wh, f"select kld_mean from kv_cache_drift where cell_id = '{done['q4_0']['cell_id']}'")[0]
    assert f"KL {got['kld_mean']:.3g} ± " in line, line
    r = run_cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "report" / "report.html").read_text()
    assert "KV cache: each cache type against the same stack on f16" in page and 'id="kv-cache-rows-0"' in page


@pytest.fixture(scope="module")
def f16_gguf(tiny_model):
    pytest.importorskip("llama_cpp")
    from backends.gguf_build import build_for
    from common.files import weights_digest_cached

    return build_for("f16", str(tiny_model), weights_digest_cached(Path(tiny_model)), 2)["path"]


def _kld(gguf: str, text: Path, wh: Path, *more: str):
    return run_cli(
        "kld", "--reference", gguf, "--candidate", gguf, "--text", str(text), "--n-ctx", "64", "--chunks", "2",
        "--threads", "2", "--warehouse", str(wh), "--json", *more,
    )  # fmt: skip


@pytest.mark.slow
def test_kld_measures_the_reference_file_itself_under_another_cache(f16_gguf, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text((REPO / "configs/corpus/long_prose.txt").read_text()[:4000])
    wh = tmp_path / "wh"
    r = _kld(f16_gguf, text, wh, "--kv-cache", "q8_0")
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads(r.stdout)["results"]
    assert res["label"].endswith("(KV cache q8_0)") and 0 < res["statistics"]["kld"][0] < 1e-2, res["statistics"]
    assert res["card"]["disclosure"]["kv_cache"] == {
        "candidate": "K q8_0, V q8_0, attention flash_attn",
        "reference": "K f16, V f16 (llama.cpp's default), attention default",
    }
    again = _kld(f16_gguf, text, wh, "--kv-cache", "q8_0,q4_0")  # the same file, another cache: another candidate
    assert again.returncode == 0, again.stderr[-3000:]
    job = yaml.safe_load(Path(f"{wh}.kld.yaml").read_text())
    assert [c.get("kv_cache") for c in job["candidates"]] == ["q8_0", "q8_0,q4_0"]  # one encoding: the label
    assert "options" not in job  # the reference keeps llama.cpp's default cache
    plain = _kld(f16_gguf, text, wh)  # the file on f16: what both caches are graded against
    assert plain.returncode == 0, plain.stderr[-3000:]
    cells = {c["stack_id"]: c for c in sql(wh, "select * from cells where not is_reference")}
    (f16,) = [c for c in cells.values() if json.loads(c["options"] or "{}") == {}]
    assert sorted(c["kv_cache_of"] == f16["stack_id"] for c in cells.values()) == [False, True, True]
    a = run_cli("analyze", "--warehouse", str(wh))
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.stderr.count("no kv_cache drift: the rows of") == 2, a.stderr[-3000:]  # only hashes kept (keep_rows)


def test_kld_refuses_a_cache_type_it_does_not_know_in_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("words")
    r = run_cli("kld", "--reference", "smollm2-135m", "--candidate", "smollm2-135m", "--text", str(text),
                "--kv-cache", "q3", "--warehouse", str(tmp_path / "wh"))  # fmt: skip
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "--kv-cache q3: expected a type" in err[0], r.stderr


def test_the_json_schema_takes_what_parsing_takes():
    jsonschema = pytest.importorskip("jsonschema")
    from matrix.spec import schema as S

    ok = {"models": ["m"], "options": {"kv_cache": AXIS + ["q5_1,iq4_nl"]}, "reference": {"kv_cache": "f16"}}
    jsonschema.validate(ok, S.json_schema())
    for bad in ("q3", {"k": "q8_0", "x": "f16"}, "q8_0,q3"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"models": ["m"], "options": {"kv_cache": bad}}, S.json_schema())


def test_an_option_no_plug_in_declares_is_refused_by_name():
    from matrix.spec.kld import flag_options

    assert flag_options({"kv_cache": "q8_0"}) == {"kv_cache": "q8_0"}
    assert flag_options({"kv_cache": "f16"}) == {}  # the engine's default: the same cell as no flag
    with pytest.raises(UserError, match="options kv_cahce: no such engine option"):
        flag_options({"kv_cahce": "q8_0"})
