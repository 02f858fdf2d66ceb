"""Every spec key in one table: its type, default, allowed values and meaning.

matrix/spec/parse.py takes from here the keys it accepts, their allowed values and defaults;
`matrix spec --schema` prints the table as JSON Schema (for editors: yaml-language-server), and
`matrix docs` writes it out as docs/spec-reference.md. The nested parsers below the driver
(positions, the imatrix option, candidates, the per-cell extras) keep their own key lists; this
table describes each of their keys, and `_check` (run by `matrix docs` and the tests) fails when
one is accepted without being described here, or described without being accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import backends
import extras
from backends.base import CHECKPOINT, GGUF
from common import names
from common import positions as P


@dataclass(frozen=True)
class Key:
    name: str
    json: dict  # its JSON Schema
    about: str
    default: Any = None  # None: absent means none / off
    required: bool = False
    keys: tuple["Key", ...] = field(default_factory=tuple)  # a mapping's own keys (documented below it)

    @property
    def allowed(self) -> tuple:
        return tuple(self.json.get("enum", ()))


def enum(*values) -> dict:
    return {"enum": list(values)}


POS_INT = {"type": "integer", "minimum": 1}
SECONDS = {"type": ["number", "null"], "exclusiveMinimum": 0}


def axes() -> dict[str, dict]:
    """Each axis's JSON schema: the registered engines (entry points included) and what they declare,
    read when asked (backends.refresh() after an engine is installed in this process shows it here;
    the options, OPTIONS, are read once, when this module is imported)."""
    return {
        "model": {"type": "string"},
        "engine": enum(*backends.engines()),
        "dtype": enum(*backends.dtypes()),
        "attention": enum(*backends.attentions()),
        "tp": POS_INT,
        "device": enum(*backends.devices()),
    }


AXIS_ABOUT = {
    "model": "a model's name (models[].name, or the catalog name)",
    "engine": "the engine",
    "dtype": "the weights' dtype or quant type",
    "attention": "the attention implementation",
    "tp": "tensor-parallel degree",
    "device": "the device class a node offers",
}

MODEL = (
    Key("name", {"type": "string"}, "the model's name in cells and ids (default: from its source)"),
    Key("catalog", {"type": "string"}, "a catalog model (`matrix models list`)"),
    Key("path", {"type": "string"}, "a Hugging Face model directory (with config.json)"),
    Key("hub", {"type": "string"}, "a Hugging Face hub id, org/name"),
    Key("gguf", {"type": "string"}, "a GGUF file: its own reference (llama.cpp F16/F32 of it, or as it is)"),
    Key("revision", {"type": "string"}, "a hub revision (commit, tag or branch)"),
)


def _option_plugin(x) -> Key:
    """An engine option a plug-in declares (extras.Extra.option), as the options' other keys are."""
    return Key(x.key, x.json_schema, x.about, keys=tuple(Key(*k) for k in x.schema_keys))


def _engine_options() -> list[Key]:
    """The options each engine defines (Backend.option_docs), in the registry's order; one that several
    engines define has one schema and each engine's line."""
    found: dict[str, tuple[dict, list[str]]] = {}
    for name, cls in backends.declared().items():  # an engine that does not import is left out (broken())
        for key, (json_schema, about) in cls.option_docs.items():
            if key in found and found[key][0] != json_schema:
                raise AssertionError(f"engine {name} declares option {key} with another schema than an earlier engine")
            found.setdefault(key, (json_schema, []))[1].append(about)
    return [Key(k, j, "; ".join(abouts)) for k, (j, abouts) in found.items()]


OPTIONS = (
    *(_option_plugin(x) for x in extras.options()),
    *_engine_options(),
    Key(
        "imatrix",
        {"type": "object"},
        "llama.cpp quant cells: quantise with an importance matrix of a calibration text",
        keys=(
            Key("corpus", {"type": "string"}, "builtin, or a text file", required=True),
            Key("chunks", POS_INT, "chunks of the text to use (default: all)"),
            Key("ctx", POS_INT, "context of each chunk", 512),
            Key(
                "max_overlap",
                {"type": "number", "minimum": 0, "maximum": 1},
                "largest share of the evaluation corpus's token 8-grams the text may contain",
                0.02,
            ),
        ),
    ),
)

POSITIONS = (
    Key(
        "from",
        {"anyOf": [{"type": "integer", "minimum": 0}, enum("half")]},
        "first position kept, or `half` (n // 2 of each prompt)",
        0,
    ),
    Key("to", {"type": ["integer", "null"]}, "last position kept (inclusive; negative counts from the end)"),
    Key("stride", POS_INT, "keep every stride-th position of the window", 1),
    Key("last", {"type": "boolean"}, "also keep each prompt's last position", True),
)
CANDIDATE = {
    "model": "the model it is a quant of (default: the spec's only model)",
    "engine": f"the engine that runs it (default: {backends.default_engine(GGUF)} for gguf, "
    f"{backends.default_engine(CHECKPOINT)} otherwise)",
    "gguf": "a GGUF file",
    "path": "a Hugging Face checkpoint directory",
    "hub": "a hub id",
    "revision": "a hub revision",
    "dtype": "its quant type (default: what the file declares)",
    "attention": "attention implementation",
    "name": "a label for cards and stack names",
    "device": "device class",
    "threads": "CPU threads",
    "calibration": "calibration data, for its card",
    **{
        x.key: f"the {x.title or x.key} it runs with, as options.{x.key} (default: the spec's options)"
        for x in extras.options()
    },
}
CELL_EXTRA = {
    "threads": (POS_INT, "CPU threads for the engine (null: the engine's default)"),
    "max_tokens": (POS_INT, "feed at most this many tokens of each prompt (rows below it only)"),
    "calibration": ({"type": "string"}, "what the artefact was calibrated on, for its model card"),
    "replicas": (POS_INT, "run the stack on this many distinct nodes of its device class"),
}


def _entry(extra_ok: bool, options_ok: bool = False) -> dict:
    """JSON Schema of an include entry (extra_ok), a reference selector (options_ok: engine options
    too) or an exclude selector."""
    props = axes()
    if extra_ok:
        props.update({k: nullable(j) if k in ("threads", "max_tokens") else j for k, (j, _) in CELL_EXTRA.items()})
    if extra_ok or options_ok:
        props.update({k.name: k.json for k in OPTIONS})
    if extra_ok:
        props.update({x.key: nullable(x.json_schema) for x in extras.cell_extras()})  # null: off for this cell
    return {"type": "object", "properties": props, "additionalProperties": False, "minProperties": 1}


def one_or_list(item: dict) -> dict:
    """A value or a list of values (parsing takes `engines: hf` as `engines: [hf]`)."""
    return {"anyOf": [item, {"type": "array", "items": item}]}


def nullable(j: dict) -> dict:
    return {"anyOf": [j, {"type": "null"}]}


def _axis(key: str, default: list, about: str) -> Key:
    return Key(key, one_or_list(axes()[names.SPEC_AXES[key]]), about, default)


def top() -> tuple[Key, ...]:
    """The spec's top-level keys, the per-cell extras' included."""
    return tuple(
        _sweep_keys()
        + _row_keys()
        + _storage_keys()
        + _measure_keys()
        + _run_keys()
        + [Key(x.key, nullable(x.json_schema), x.about) for x in extras.cell_extras()]
    )


def _sweep_keys() -> list[Key]:
    """The matrix: its name, its axes, the cells added or left out, and each model's reference."""
    model = {
        "anyOf": [
            {"type": "string"},
            {"type": "object", "properties": {k.name: k.json for k in MODEL}, "additionalProperties": False},
        ]
    }
    return [
        Key("name", {"type": "string"}, "the spec's name in runs (default: the file's stem)"),
        Key("description", {"type": "string"}, "free text, kept with the run"),
        Key(
            "models",
            one_or_list(model),
            "the model axis: catalog names, directories, GGUF files, hub ids, or mappings",
            required=True,
            keys=MODEL,
        ),
        _axis("engines", [backends.default_engine(CHECKPOINT)], "the engine axis"),
        _axis("dtypes", ["bf16"], "the dtype axis"),
        _axis("attention", ["default"], "the attention axis"),
        _axis("tp", [1], "the tensor-parallel axis"),
        _axis("devices", ["cpu"], "the device axis"),
        Key(
            "include",
            {"type": "array", "items": _entry(True)},
            "cells to add, with the singular axis keys "
            "(model, engine, ...) and per-cell keys (threads, max_tokens, options, extras)",
        ),
        Key("exclude", {"type": "array", "items": _entry(False)}, "combinations to leave out (axis keys only)"),
        Key(
            "reference",
            _entry(False, options_ok=True),
            "the reference stack of each model, by axis keys and engine options (default: the first cell)",
        ),
    ]


def _row_keys() -> list[Key]:
    """What each cell is fed and which of its rows are kept."""
    return [
        Key("stride", POS_INT, "keep every stride-th position of each prompt, and its last", 32),
        Key(
            "positions",
            {
                "anyOf": [
                    enum(*P.PRESETS),
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {k.name: k.json for k in POSITIONS},
                    },
                ]
            },
            "a window of positions instead of stride, or a preset (llama_perplexity: the scored half of each chunk)",
            keys=POSITIONS,
        ),
        Key("repeats", POS_INT, "captures of each cell (bit-reproducibility is checked across them)", 1),
        Key("corpus", {"type": "string"}, "builtin, or a corpus YAML file", "builtin"),
        Key("bos", enum("tokenizer", "always", "never"), "BOS policy: the tokenizer's own, or forced", "tokenizer"),
        Key("threads", {"type": ["integer", "null"], "minimum": 1}, "CPU threads for every engine"),
        Key("max_tokens", {"type": ["integer", "null"], "minimum": 1}, "feed at most this many tokens of each prompt"),
    ]


def _storage_keys() -> list[Key]:
    """How rows are stored, where they are measured against the reference, whose values are kept."""
    return [
        Key(
            "store",
            enum("native", "bf16"),
            "how rows are stored: lossless, or bf16 with each row's KL floor measured",
            "native",
        ),
        Key(
            "reference_metrics",
            enum("analyze", "in_actor"),
            "where metrics against the reference are computed: by `matrix analyze`, or in the capturing process",
            "analyze",
        ),
        Key(
            "keep_rows",
            enum("all", "references"),
            "whose rows keep their values: every stack's, or only each "
            "model's reference (the others' rows are measured and hashed where they are captured, as "
            "llama-perplexity keeps only its base logits; needs reference_metrics: in_actor and no centroid)",
            "all",
        ),
    ]


def _measure_keys() -> list[Key]:
    """What is measured beside the axes (published files, engine options), and against which centroid."""
    return [
        Key(
            "candidates",
            {
                "type": "array",
                "items": {"type": "object", "properties": {k: {} for k in CANDIDATE}, "additionalProperties": False},
            },
            "published files measured as they are",
            keys=tuple(Key(k, {}, a) for k, a in CANDIDATE.items()),
        ),
        Key(
            "options",
            {
                "type": "object",
                "properties": {k.name: one_or_list(k.json) for k in OPTIONS},
                "additionalProperties": False,
            },
            "engine options for every cell (include entries may set them per cell); a list of values "
            "is an axis: a cell for each, of every engine that takes the option",
            keys=OPTIONS,
        ),
        Key(
            "centroid",
            {
                "type": "object",
                "properties": {"definition": enum("mean_prob", "mean_logprob", "none"), "groups": {"type": "object"}},
                "additionalProperties": False,
            },
            "how the centroid of the stacks is formed",
            keys=(
                Key(
                    "definition",
                    enum("mean_prob", "mean_logprob", "none"),
                    "mean of probabilities, of log-probabilities renormalised, or no centroid and no pairwise tables",
                    "mean_prob",
                ),
                Key(
                    "groups",
                    {"type": "object"},
                    "name -> selector(s): stacks that share a centroid (default: one group per model)",
                ),
            ),
        ),
    ]


def _run_keys() -> list[Key]:
    """How the run places and retries cells, and how long it waits."""
    return [
        Key("replicas", POS_INT, "copies of each stack, each on its own node", 1),
        Key(
            "hosts",
            enum("shared", "per_cell"),
            "shared: cells of the same weights, engine build, device and threads run in turn in one "
            "host on one loaded model (where the engine can switch, e.g. HF's attention); per_cell: "
            "every cell loads in a host of its own",
            "shared",
        ),
        Key(
            "cells_per_gpu",
            POS_INT,
            "hosts of tp 1 cells that share one GPU at a time (each asks 1/N of it): for models small "
            "enough that N of them fit its memory together",
            1,
        ),
        Key("retries", {"type": "integer", "minimum": 0}, "restarts of a cell whose actor or node died", 2),
        Key("load_timeout_s", SECONDS, "seconds a cell may take to load (weights shipped, artefacts built)", 3600.0),
        Key("capture_timeout_s", SECONDS, "seconds a repeat may take (null: scaled by the tokens fed)"),
    ]


def by_name(keys: tuple[Key, ...]) -> dict[str, Key]:
    return {k.name: k for k in keys}


def default(key: str) -> Any:
    return by_name(top())[key].default


def allowed(key: str) -> tuple:
    return by_name(top())[key].allowed


def json_schema() -> dict:
    """The whole spec as a JSON Schema (draft 2020-12) document."""
    keys = top()
    props = {}
    for k in keys:
        props[k.name] = {**k.json, "description": k.about, **({"default": k.default} if k.default is not None else {})}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "logit-matrix sweep spec",
        "type": "object",
        "properties": props,
        "required": [k.name for k in keys if k.required],
        "additionalProperties": False,
    }


def _check() -> None:
    """Every key a nested parser accepts is described here, and nothing else is."""
    from matrix.spec import calibration, candidates

    for what, accepted, described in (
        ("positions", P.KEYS, POSITIONS),
        ("options.imatrix", calibration.KEYS, by_name(OPTIONS)["imatrix"].keys),
        ("candidates", candidates.CANDIDATE_KEYS, CANDIDATE),
    ):
        got = {k.name for k in described} if isinstance(described, tuple) else set(described)
        if got != set(accepted):
            raise AssertionError(
                f"matrix/spec/schema.py: {what} keys {sorted(set(accepted) ^ got)} are accepted or described, not both"
            )
    for x in extras.registered():
        if not x.about or not x.json_schema:
            raise AssertionError(f"extra {x.key}: no about or json_schema for the spec reference")
