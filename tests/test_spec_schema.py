"""The spec's schema (matrix/spec/schema.py) is what parsing accepts: the same keys, allowed values and
defaults; `matrix spec --schema` accepts every shipped spec and refuses what parsing refuses."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.conftest import REPO, run_cli


def _schema() -> dict:
    r = run_cli("spec", "--schema")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_parsing_takes_its_keys_and_defaults_from_the_schema():
    import extras
    from matrix.spec import parse
    from matrix.spec import schema as S

    S._check()  # every key the nested parsers accept is described
    top = S.by_name(S.top())
    assert parse.TOP_KEYS | set(extras.keys()) == set(top)
    assert (parse.STORES, parse.BOS_POLICIES, parse.DEFAULT_STRIDE) == (("native", "bf16"), ("tokenizer", "always", "never"), 32)
    assert parse.CENTROID_DEFINITIONS == ("mean_prob", "mean_logprob", "none")
    assert set(parse.OPTION_KEYS) == {k.name for k in S.OPTIONS} and parse.OPTION_KEYS["n_batch"] is int


def test_every_shipped_spec_passes_the_json_schema():
    schema = _schema()
    specs = [p for p in sorted((REPO / "configs").glob("*.yaml")) if p.name != "gates.yaml"]  # gates: admit's thresholds
    assert len(specs) >= 5
    for path in specs:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


@pytest.mark.parametrize("bad", [{"stor": "bf16"}, {"store": "fp8"}, {"stride": 0}, {"centroid": {"definition": "median"}},
                                 {"include": [{"engine": "hf", "kv_cachee": "f16"}]}, {"positions": {"form": 3}},
                                 {"options": {"kv_cache": "q4"}}, {"retries": -1}])
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
    assert {"positions.from", "options.imatrix.corpus", "centroid.definition", "include[].layers", "candidates.gguf"} <= set(keys)
    assert "`reference_metrics` | one of analyze, in_actor | `analyze` |" in (REPO / "docs" / "spec-reference.md").read_text()
