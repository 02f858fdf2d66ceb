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
