"""The spec's nested key tables and shared JSON Schema pieces: each model entry's keys, the engine
options, positions, candidates, the centroid and the per-cell keys of include entries. The top-level
keys are declared as fields of Spec (matrix/spec/parse.py) and use these; `_check` in
matrix/spec/schema.py holds each nested table to what its parser accepts.
"""

from __future__ import annotations

import backends
import extras
from backends.base import CHECKPOINT, GGUF
from matrix.spec.keys import Key, nullable, plugin_key


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


def entry(extra_ok: bool, options_ok: bool = False) -> dict:
    """JSON Schema of an include entry (extra_ok), a reference selector (options_ok: engine options
    too) or an exclude selector."""
    props = axes()
    if extra_ok:
        props.update({k: nullable(j) if k in ("threads", "max_tokens") else j for k, (j, _) in CELL_EXTRA.items()})
    if extra_ok or options_ok:
        props.update({k.name: k.json for k in OPTIONS})
    if extra_ok:
        props.update({k.name: k.json for k in map(plugin_key, extras.cell_extras())})  # null: off for this cell
    return {"type": "object", "properties": props, "additionalProperties": False, "minProperties": 1}


def one_or_list(item: dict) -> dict:
    """A value or a list of values (parsing takes `engines: hf` as `engines: [hf]`)."""
    return {"anyOf": [item, {"type": "array", "items": item}]}


CENTROID = (
    Key(
        "definition",
        enum("mean_prob", "mean_logprob", "none"),
        "mean of probabilities, of log-probabilities renormalised, or no centroid and no pairwise tables",
        "mean_prob",
    ),
    Key(
        "groups", {"type": "object"}, "name -> selector(s): stacks that share a centroid (default: one group per model)"
    ),
)
