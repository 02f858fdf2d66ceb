"""Spec validation and cell expansion (no Ray, no model load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from matrix.spec.cells import load_spec
from tests.conftest import REPO, run_cli


def spec_file(tmp_path: Path, body: dict | str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(body if isinstance(body, str) else yaml.safe_dump(body, sort_keys=False))
    return p


BASE = {"models": ["smollm2-135m"], "engines": ["hf"], "dtypes": ["fp32", "bf16"], "attention": ["eager", "sdpa"]}


def test_two_models_spec_gives_each_model_its_own_reference_and_every_engine():
    spec = load_spec(REPO / "configs" / "two-models.yaml")
    assert set(spec.reference_stacks) == {"smollm2-135m", "gemma3-270m"}
    for model, ref in spec.reference_stacks.items():
        assert ref.startswith(f"{model}.hf.fp32.eager")
        engines = {c.engine for c in spec.cells if c.model == model}
        from backends.vllm_backend import vllm_python

        want = {"hf", "llamacpp", "mlx"} | ({"vllm"} if vllm_python() else set())  # else skipped, with the way out
        assert engines == want, (model, engines)
    # each model's published file runs as its own stack (the catalog's source quant)
    assert {(c.model, c.dtype) for c in spec.cells if c.engine == "llamacpp"} >= {
        ("smollm2-135m", "q4_1"),
        ("gemma3-270m", "q4_k_m"),
    }


def test_smoke_spec_covers_hf_llamacpp_mlx_with_bf16_eager_reference():
    spec = load_spec(REPO / "configs" / "smoke.yaml")
    assert [(c.engine, c.dtype, c.attention) for c in spec.cells] == [
        ("hf", "fp32", "eager"),
        ("hf", "fp32", "sdpa"),
        ("hf", "bf16", "eager"),
        ("hf", "bf16", "sdpa"),
        ("llamacpp", "f16", "default"),
        ("llamacpp", "q8_0", "default"),
        ("llamacpp", "q4_k_m", "default"),
        ("mlx", "bf16", "default"),
        ("mlx", "q8_g64", "default"),
        ("mlx", "q4_g64", "default"),
        ("mlx", "q8_g64", "default"),
        ("mlx", "q4_g64", "default"),
        ("hf", "fp32", "sdpa"),
        ("hf", "fp32", "sdpa"),
        ("hf", "bf16", "sdpa"),
        ("hf", "bf16", "sdpa"),
        ("llamacpp", "q4_1", "default"),
    ]  # the shipped file, a candidate
    assert [c.artifact for c in spec.cells if c.artifact] == ["source"]
    assert [c.opts.get("activations") for c in spec.cells if c.engine == "mlx"] == [None, None, None, "fp32", "fp32"]
    assert {c.max_tokens for c in spec.cells if c.engine != "mlx" and not c.extra("batch")} == {
        768
    }  # 768-token prefixes
    # HF fp32 and bf16 at batch 1 and 8 (64-token prefixes), beside their batch-free cells
    batched = [(c.dtype, b.size, c.max_tokens, b.fill) for c in spec.cells if (b := c.extra("batch"))]
    assert batched == [("fp32", 1, 64, "corpus"), ("fp32", 8, 64, "corpus"), ("bf16", 1, 64, "corpus")] + [
        ("bf16", 8, 64, "corpus")
    ]
    assert {c.max_tokens for c in load_spec(REPO / "configs" / "long.yaml").cells} == {None}
    assert spec.spec.repeats == 2 and spec.spec.stride == 32
    ref = spec.reference_stacks["smollm2-135m"]
    assert ref.startswith("smollm2-135m.hf.bf16.eager.tp1.cpu-")
    # the demo's per-layer cell and decode cell; the reference records both as their yardstick
    by = {c.stack_id: c for c in spec.cells}
    q4, q8 = (next(c for c in spec.cells if c.dtype == d and not c.artifact) for d in ("q4_k_m", "q8_0"))
    assert q4.extra("layers") == (0, 1, 2, 3) and q8.extra("decode") == (8, (6, 128))
    assert by[ref].extra("layers") == (0, 1, 2, 3) and by[ref].extra("decode") == (8, (6, 128))
    # HF has no prefix cache: nothing to record there
    assert q8.extra("prefix_cache") and by[ref].extra("prefix_cache") is None
    assert [c.extra("layers") for c in spec.cells].count(None) == len(spec.cells) - 2


def test_cell_ids_are_stable_and_change_with_what_changes_rows(tmp_path):
    a = load_spec(spec_file(tmp_path, BASE, "a.yaml"))
    b = load_spec(spec_file(tmp_path, BASE, "b.yaml"))
    assert [c.stack_id for c in a.cells] == [c.stack_id for c in b.cells]
    c = load_spec(spec_file(tmp_path, {**BASE, "stride": 16}, "c.yaml"))
    assert not {x.stack_id for x in a.cells} & {x.stack_id for x in c.cells}
    d = load_spec(spec_file(tmp_path, {**BASE, "bos": "always"}, "d.yaml"))
    assert not {x.stack_id for x in a.cells} & {x.stack_id for x in d.cells}


def test_include_exclude_follow_github_actions_semantics(tmp_path):
    body = {
        **BASE,
        "exclude": [{"dtype": "fp32", "attention": "sdpa"}],
        "include": [
            {"dtype": "bf16", "threads": 1},  # extends both bf16 cells
            {"dtype": "f16", "attention": "eager"},
        ],
    }  # a new combination
    spec = load_spec(spec_file(tmp_path, body))
    got = {(c.dtype, c.attention, c.threads) for c in spec.cells}
    assert got == {("fp32", "eager", None), ("bf16", "eager", 1), ("bf16", "sdpa", 1), ("f16", "eager", None)}
    # a combination an include created is not extended by a later include: both stand
    body = {
        **BASE,
        "dtypes": ["fp32"],
        "attention": ["eager"],
        "include": [
            {"engine": "llamacpp", "dtype": "q8_0", "attention": "default"},
            {"engine": "llamacpp", "dtype": "q8_0", "attention": "default", "kv_cache": "f32"},
        ],
    }
    spec = load_spec(spec_file(tmp_path, body, "b.yaml"))
    assert sorted(c.opts.get("kv_cache", "-") for c in spec.cells if c.engine == "llamacpp") == ["-", "f32"]


def test_engine_options_and_max_tokens(tmp_path):
    body = {
        **BASE,
        "dtypes": ["fp32"],
        "attention": ["eager"],
        "options": {"n_ubatch": 256},
        "include": [
            {"engine": "llamacpp", "dtype": "fp32", "attention": "default", "kv_cache": "f32"},
            {"engine": "llamacpp", "dtype": "q8_0", "attention": "default"},
            {"engine": "mlx", "dtype": "q4_g64", "attention": "default", "max_tokens": 9},
            {"engine": "hf", "dtype": "bf16", "attention": "eager", "kv_cache": "f32"},
        ],
    }
    spec = load_spec(spec_file(tmp_path, body))
    by = {(c.engine, c.dtype): c for c in spec.cells}
    assert by[("llamacpp", "fp32")].opts == {"kv_cache": "f32", "n_ubatch": 256}
    assert by[("llamacpp", "q8_0")].opts == {"n_ubatch": 256}
    assert by[("hf", "fp32")].opts == {}  # defaults only reach engines that take them
    assert by[("mlx", "q4_g64")].max_tokens == 9
    assert [s["reason"] for s in spec.skipped] == ["engine hf takes no option kv_cache"]
    # an option changes the rows, so it changes the id
    plain = load_spec(spec_file(tmp_path, {**body, "options": {}}, "b.yaml"))
    assert {c.stack_id for c in plain.cells} ^ {c.stack_id for c in spec.cells} != set()


def test_replicas_are_cells_of_one_stack_and_only_replica_0_is_the_reference(tmp_path):
    one = load_spec(spec_file(tmp_path, {**BASE, "attention": ["eager"]}))
    body = {
        **BASE,
        "attention": ["eager"],
        "replicas": 2,
        "include": [{"dtype": "fp32", "replicas": 3}],
        "reference": {"dtype": "bf16"},
    }
    spec = load_spec(spec_file(tmp_path, body))
    plain = {c.dtype: c.stack_id for c in one.cells}
    got = sorted((c.dtype, c.replica, c.stack_id) for c in spec.cells)
    assert got == [
        ("bf16", 0, plain["bf16"]),
        ("bf16", 1, plain["bf16"] + ".r1"),
        ("fp32", 0, plain["fp32"]),
        ("fp32", 1, plain["fp32"] + ".r1"),
        ("fp32", 2, plain["fp32"] + ".r2"),
    ]
    assert spec.reference_stacks == {"smollm2-135m": plain["bf16"]}  # replica 0 keeps the stack's own id
    from common.ids import split_cell_id

    assert split_cell_id(plain["fp32"] + ".r2@0123abcd") == (plain["fp32"], 2, "0123abcd")


def test_unrunnable_combinations_are_skipped_with_a_reason(tmp_path):
    body = {**BASE, "engines": ["hf", "vllm"], "attention": ["eager", "flash_attention_2"]}
    spec = load_spec(spec_file(tmp_path, body))
    reasons = {(s["engine"], s["attention"]): s["reason"] for s in spec.skipped}
    assert "needs a CUDA device" in reasons[("hf", "flash_attention_2")]
    assert "engine vllm has no attention 'eager'" in reasons[("vllm", "eager")]
    assert {(c.engine, c.attention) for c in spec.cells} == {("hf", "eager")}


def test_cells_json_lists_cells_and_skipped(tmp_path):
    body = {**BASE, "attention": ["sdpa", "flash_attention_2"]}
    r = run_cli("cells", str(spec_file(tmp_path, body)), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["cells"]) == 2 and len(out["skipped"]) == 2
    assert all(c["stack_id"].startswith("smollm2-135m.hf.") for c in out["cells"])


@pytest.mark.parametrize(
    "body, needle",
    [
        ("models: [smollm2-135m\nengines: [hf", "malformed YAML: line"),
        ({**BASE, "engines": ["hf", "vlm"]}, "engines[1]: unknown engine"),
        ({**BASE, "dtypes": ["bf17"]}, "dtypes[0]: unknown dtype"),
        ({**BASE, "attention": ["flash"]}, "attention[0]: unknown attention"),
        ({**BASE, "models": [{"path": "/no/such/model"}]}, "models[0].path: does not exist"),
        ({**BASE, "corpus": "missing-corpus.yaml"}, "corpus: corpus file not found"),
        ({**BASE, "stirde": 32}, "stirde: unknown key"),
        ({**BASE, "stride": 0}, "stride: must be a positive integer"),
        ({**BASE, "exclude": [{"dtype": "q9"}]}, "exclude[0].dtype: unknown dtype"),
        ({**BASE, "reference": {"dtype": "f16"}}, "reference: matches no cell"),
        ({**BASE, "options": {"kv_cache": "f8"}}, "options.kv_cache: expected one of f32, f16, bf16, q8_0"),
        ({**BASE, "include": [{"engine": "llamacpp", "dtype": "q9_k"}]}, "include[0].dtype: unknown dtype"),
        (
            {**BASE, "include": [{"engine": "llamacpp", "dtype": "q8_0", "attention": "sdpa"}]},
            "include[0].attention: engine llamacpp has no attention 'sdpa'",
        ),
        (
            {**BASE, "centroid": {"definition": "median"}},
            "centroid.definition: expected one of mean_prob, mean_logprob",
        ),
        ({**BASE, "centroid": {"groups": {"g": {"dtype": "q9"}}}}, "centroid.groups.g[0].dtype: unknown dtype"),
        ({**BASE, "centroid": {"group": {}}}, "centroid.group: unknown key"),
        ({**BASE, "replicas": 0}, "replicas: must be a positive integer (got 0)"),
        ({**BASE, "retries": -1}, "retries: must be a whole number, 0 or more (got -1)"),
        ({**BASE, "capture_timeout_s": "1h"}, "capture_timeout_s: must be a number of seconds above 0, or null"),
        ({**BASE, "include": [{"engine": "hf", "replicas": "two"}]}, "include[0].replicas: must be a positive integer"),
        ({**BASE, "keep_rows": "some"}, "keep_rows: expected one of all, references (got 'some')"),
        ({**BASE, "keep_rows": "references"}, "keep_rows: references needs reference_metrics: in_actor"),
        (
            {**BASE, "keep_rows": "references", "reference_metrics": "in_actor"},
            "keep_rows: references needs centroid: {definition: none}",
        ),
    ],
)
def test_bad_spec_is_one_line_exit_2_naming_file_field_value(tmp_path, body, needle):
    path = spec_file(tmp_path, body)
    wh = tmp_path / "wh"
    for cmd in (["cells", str(path)], ["run", str(path), "--warehouse", str(wh)]):
        r = run_cli(*cmd)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert str(path) in err and needle in err, err
    assert not wh.exists()  # nothing was created


def test_incompatible_warehouse_is_refused_and_untouched(tmp_path):
    wh = tmp_path / "wh"
    (wh / "logits").mkdir(parents=True)
    (wh / "WAREHOUSE.json").write_text('{"format": "logit-matrix-warehouse", "schema_version": 99}')
    (wh / "logits" / "keep.parquet").write_bytes(b"not touched")
    before = sorted((p.relative_to(wh), p.read_bytes()) for p in wh.rglob("*") if p.is_file())
    r = run_cli("run", str(REPO / "configs" / "smoke.yaml"), "--warehouse", str(wh))
    assert r.returncode == 2
    assert "WAREHOUSE.json: schema_version 99 is incompatible" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    after = sorted((p.relative_to(wh), p.read_bytes()) for p in wh.rglob("*") if p.is_file())
    assert after == before


def test_bad_corpus_entry_names_the_field(tmp_path):
    corpus = tmp_path / "c.yaml"
    corpus.write_text("prompts:\n  - id: a\n    category: poetry\n    text: hi\n")
    r = run_cli("cells", str(spec_file(tmp_path, {**BASE, "corpus": str(corpus)})))
    # cells only fingerprints the corpus files; run parses the entries
    assert r.returncode == 0, r.stderr
    r = run_cli("run", str(spec_file(tmp_path, {**BASE, "corpus": str(corpus)})), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2
    assert "prompts[0].category" in r.stderr and "'poetry'" in r.stderr
    assert not (tmp_path / "wh").exists()
