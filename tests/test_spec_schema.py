"""The spec's schema (matrix/spec/schema.py) is what parsing accepts: the same keys, allowed values and
defaults; `matrix spec --schema` accepts every shipped spec and refuses what parsing refuses."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.conftest import REPO, run_cli, run_process


def _schema() -> dict:
    r = run_process("spec", "--schema")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_parsing_takes_its_keys_and_defaults_from_the_schema():
    import extras
    from matrix.spec import parse
    from matrix.spec import schema as S

    S._check()  # every key the nested parsers accept is described
    assert parse.TOP_KEYS == {
        "name",
        "description",
        "models",
        "engines",
        "dtypes",
        "attention",
        "tp",
        "devices",
        "include",
        "exclude",
        "reference",
        "stride",
        "positions",
        "repeats",
        "corpus",
        "bos",
        "threads",
        "max_tokens",
        "store",
        "reference_metrics",
        "keep_rows",
        "candidates",
        "options",
        "centroid",
        "replicas",
        "hosts",
        "cells_per_gpu",
        "retries",
        "load_timeout_s",
        "capture_timeout_s",
    }
    assert (
        set(S.by_name(S.top())) - parse.TOP_KEYS
        == set(extras.keys())
        == {"layers", "decode", "prefix_cache", "prefill_chunk", "batch"}
    )
    assert (parse.STORES, parse.BOS_POLICIES, parse.DEFAULT_STRIDE) == (
        ("native", "bf16"),
        ("tokenizer", "always", "never"),
        32,
    )
    assert parse.CENTROID_DEFINITIONS == ("mean_prob", "mean_logprob", "none")
    assert parse.KEEP_ROWS == ("all", "references")
    assert parse.HOSTS == ("shared", "per_cell")
    assert parse.OPTION_KEYS == {
        "kv_cache": ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"),
        "cpu_path": ("native", "scalar", "avx2", "avx512", "avx512_bf16", "amx"),
        "n_batch": int,
        "n_ubatch": int,
        "trt_backend": ("pytorch", "tensorrt"),
        "vllm_executor": ("mp", "ray"),
        "activations": ("native", "fp32"),
        "quantizer": ("torchao", "quanto"),
        "deterministic": bool,
        "imatrix": dict,
    }


def test_every_shipped_spec_passes_the_json_schema():
    schema = _schema()
    specs = [
        p for p in sorted((REPO / "configs").glob("*.yaml")) if p.name != "gates.yaml"
    ]  # gates: admit's thresholds
    assert len(specs) >= 5
    for path in specs:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


@pytest.mark.parametrize(
    "bad",
    [
        {"stor": "bf16"},
        {"store": "fp8"},
        {"stride": 0},
        {"centroid": {"definition": "median"}},
        {"include": [{"engine": "hf", "kv_cachee": "f16"}]},
        {"positions": {"form": 3}},
        {"options": {"kv_cache": "q4"}},
        {"retries": -1},
    ],
)
def test_what_parsing_refuses_the_schema_refuses(bad, tmp_path):
    spec = {"models": ["smollm2-135m"], "engines": ["hf"], **bad}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = run_cli("cells", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(spec, _schema())


def test_matrix_spec_lists_every_key_with_its_default():
    r = run_cli("spec", "--json")
    assert r.returncode == 0, r.stderr
    keys = {k["key"]: k for k in json.loads(r.stdout)["keys"]}
    assert keys["store"]["default"] == "native" and keys["models"]["required"]
    assert {
        "positions.from",
        "options.imatrix.corpus",
        "centroid.definition",
        "include[].layers",
        "candidates.gguf",
    } <= set(keys)
    assert (
        "`reference_metrics` | one of analyze, in_actor | `analyze` |"
        in (REPO / "docs" / "spec-reference.md").read_text()
    )


@pytest.mark.parametrize(
    "good",
    [
        {"engines": "hf"},
        {"models": "smollm2-135m"},
        {"tp": 1},
        {"include": [{"engine": "llamacpp", "dtype": "q8_0", "attention": "default", "threads": None, "layers": None}]},
        {
            "include": [
                {
                    "engine": "llamacpp",
                    "dtype": "q8_0",
                    "attention": "default",
                    "layers": "first-2",
                    "decode": {"steps": 2, "at": [3]},
                    "prefix_cache": "check",
                }
            ]
        },
        {"positions": "llama_perplexity"},
        {"positions": {"from": "half", "to": -2}},
        {"threads": None, "capture_timeout_s": None},
    ],
)
def test_what_parsing_accepts_the_schema_accepts(good, tmp_path):
    spec = {"models": ["smollm2-135m"], "engines": ["hf"], "dtypes": ["fp32"], "attention": ["eager"], **good}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = run_cli("cells", str(path))
    assert r.returncode == 0, r.stderr
    jsonschema.validate(spec, _schema())


def test_a_key_declared_as_one_field_is_parsed_checked_and_documented(tmp_path):
    """A spec key is one typed field with its record: the parser, the JSON Schema and the reference
    rows all come from it, for a subclass of Spec as for Spec."""
    import dataclasses

    from common.errors import UserError
    from matrix.api.pages import spec_page
    from matrix.spec import schema as S
    from matrix.spec.keys import key
    from matrix.spec.parse import Spec, parse_spec
    from matrix.spec.reference import rows

    about = "forwards run before the first capture"
    grown = dataclasses.make_dataclass("Grown", [("warmup", int, key(S.POS_INT, about, 1))], bases=(Spec,), frozen=True)
    path = tmp_path / "spec.yaml"

    def parsed(extra: str, cls=grown):
        path.write_text("models: [smollm2-135m]\nengines: [hf]\n" + extra)
        return parse_spec(path, cls)

    assert parsed("warmup: 3\n").warmup == 3
    assert parsed("").warmup == 1  # absent: its default
    # Spec's own keys beside it
    assert parsed("stride: 8\n").stride == 8 and parsed("").engines == ["hf"]
    for bad, got in (("0", "0"), ("two", "'two'"), ("true", "True"), ("null", "None")):
        with pytest.raises(UserError) as e:
            parsed(f"warmup: {bad}\n")
        assert str(e.value) == f"{path}: warmup: must be a positive integer (got {got})"
    with pytest.raises(UserError, match=r"spec\.yaml: warmup: unknown key; expected one of .*, tp"):
        parsed("warmup: 3\n", Spec)  # Spec itself has no such key

    schema = S.json_schema(S.top(grown))
    assert schema["properties"]["warmup"] == {"type": "integer", "minimum": 1, "description": about, "default": 1}
    assert "warmup" not in S.json_schema()["properties"]
    jsonschema.validate({"models": ["m"], "warmup": 3}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"models": ["m"], "warmup": 0}, schema)

    got = [r for r in rows(S.top(grown)) if r["key"] == "warmup"]
    assert got == [{"key": "warmup", "type": "integer >= 1", "default": 1, "required": False, "about": about}]
    assert f"| `warmup` | integer >= 1 | `1` | {about} |" in spec_page(S.top(grown)).splitlines()
    assert "`warmup`" not in spec_page()


def test_a_plug_ins_key_is_the_same_record_as_a_fields():
    """Each plug-in's key (extras/) reaches the parser, the schema and the reference as a Key made
    from what the plug-in declares, after the fields' keys."""
    import extras
    from matrix.spec import schema as S
    from matrix.spec.keys import Key, declared
    from matrix.spec.parse import Spec

    top = S.top()
    plugins = top[len(declared(Spec)) :]
    assert [k.name for k in plugins] == list(extras.keys())
    for k, x in zip(plugins, extras.cell_extras()):
        assert isinstance(k, Key) and (k.json, k.about) == ({"anyOf": [x.json_schema, {"type": "null"}]}, x.about)
