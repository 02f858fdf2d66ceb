"""Sweep spec: strict YAML parsing and validation (matrix/spec/cells.py expands it into cells).

A spec is a GitHub-Actions-style matrix over the axes ``models``, ``engines``,
``dtypes``, ``attention``, ``tp`` and ``devices``, with ``include`` / ``exclude``
entries written with the singular cell keys (``model``, ``engine``, ...).
Every error names the file, the field and the value.

Each top-level key is one field of Spec below, declared with key(): its JSON Schema, the line that
documents it, its default, and the parser of a key with structure (matrix/spec/parsers.py).
matrix/spec/keys.py makes the parser, `matrix spec --schema` and docs/spec-reference.md from
these fields. The `models:` entries are parsed in matrix/spec/model_entry.py (ModelRef is
importable from here too).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

import backends
from backends.base import CHECKPOINT
from common import positions as P
from common.errors import UserError, read_text_file
from matrix.spec import parsers
from matrix.spec import tables as T
from matrix.spec.keys import Key, declared, derived, key, read, spec_keys
from matrix.spec.model_entry import ModelRef
from matrix.spec.parsers import CELL_EXTRA_KEYS, OPTION_KEYS, parse_extra
from matrix.spec.tables import POS_INT, SECONDS, enum, one_or_list
from matrix.spec.validate import field_error

__all__ = ["CELL_EXTRA_KEYS", "OPTION_KEYS", "ModelRef", "Spec", "field_error", "parse_extra", "parse_spec"]

_NULLABLE_POS_INT = {"type": ["integer", "null"], "minimum": 1}


def _axis(cell_key: str, default: list, about: str):
    """An axis key: a value or a list of the values its cell key takes (the registry's when asked)."""
    return key(lambda: one_or_list(T.axes()[cell_key]), about, default, parse=parsers.axis)


def _object(props: tuple[Key, ...] | dict) -> dict:
    """A mapping of the given keys and no other."""
    schema = {k.name: k.json for k in props} if isinstance(props, tuple) else props
    return {"type": "object", "properties": schema, "additionalProperties": False}


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the file's keys, validated, with their defaults. matrix.spec.cells.expand turns it
    into a Matrix (its cells). The fields in the order the spec reference lists the keys."""

    path: Path = derived(lambda r: r.path)
    # the matrix: its name, its axes, the cells added or left out, and each model's reference
    name: str = key({"type": "string"}, "the spec's name in runs (default: the file's stem)", parse=parsers.name)
    description: str | None = key({"type": "string"}, "free text, kept with the run")
    models: dict[str, ModelRef] = key(
        one_or_list({"anyOf": [{"type": "string"}, _object(T.MODEL)]}),
        "the model axis: catalog names, directories, GGUF files, hub ids, or mappings",
        required=True,
        keys=T.MODEL,
        parse=parsers.models,
    )
    engines: list = _axis("engine", [backends.default_engine(CHECKPOINT)], "the engine axis")
    dtypes: list = _axis("dtype", ["bf16"], "the dtype axis")
    attention: list = _axis("attention", ["default"], "the attention axis")
    tp: list = _axis("tp", [1], "the tensor-parallel axis")
    devices: list = _axis("device", ["cpu"], "the device axis")
    include: list[dict] = key(
        lambda: {"type": "array", "items": T.entry(True)},
        "cells to add, with the singular axis keys "
        "(model, engine, ...) and per-cell keys (threads, max_tokens, options, extras)",
        parse=parsers.include,
    )
    exclude: list[dict] = key(
        lambda: {"type": "array", "items": T.entry(False)},
        "combinations to leave out (axis keys only)",
        parse=parsers.exclude,
    )
    reference: dict = key(
        lambda: T.entry(False, options_ok=True),
        "the reference stack of each model, by axis keys and engine options (default: the first cell)",
        parse=parsers.reference,
    )
    # what each cell is fed and which of its rows are kept
    stride: int = key(POS_INT, "keep every stride-th position of each prompt, and its last", 32, parse=parsers.stride)
    positions: P.Positions = key(
        {
            "anyOf": [
                enum(*P.PRESETS),
                {"type": "object", "additionalProperties": False, "properties": {k.name: k.json for k in T.POSITIONS}},
            ]
        },
        "a window of positions instead of stride, or a preset (llama_perplexity: the scored half of each chunk)",
        keys=T.POSITIONS,
        parse=parsers.positions,
    )
    repeats: int = key(POS_INT, "captures of each cell (bit-reproducibility is checked across them)", 1)
    corpus: str = key({"type": "string"}, "builtin, or a corpus YAML file", "builtin", parse=parsers.corpus)
    bos: str = key(enum("tokenizer", "always", "never"), "BOS policy: the tokenizer's own, or forced", "tokenizer")
    threads: int | None = key(_NULLABLE_POS_INT, "CPU threads for every engine")
    max_tokens: int | None = key(_NULLABLE_POS_INT, "feed at most this many tokens of each prompt")
    # how rows are stored: native (lossless) or bf16 (row max subtracted, rounded to bf16; each row's
    # KL floor is measured as it is written: store/floors.py Storage)
    store: str = key(
        enum("native", "bf16"),
        "how rows are stored: lossless, or bf16 with each row's KL floor measured",
        "native",
    )
    # in_actor: against the reference's rows already in the warehouse, as the rows come out (a model's
    # reference then runs before its other cells); analyze reuses them
    reference_metrics: str = key(
        enum("analyze", "in_actor"),
        "where metrics against the reference are computed: by `matrix analyze`, or in the capturing process",
        "analyze",
    )
    keep_rows: str = key(
        enum("all", "references"),
        "whose rows keep their values: every stack's, or only each "
        "model's reference (the others' rows are measured and hashed where they are captured, as "
        "llama-perplexity keeps only its base logits; needs reference_metrics: in_actor and no centroid)",
        "all",
        parse=parsers.keep_rows,
    )
    # what is measured beside the axes (published files, engine options), and against which centroid
    candidates: list[dict] = key(
        {"type": "array", "items": _object({k: {} for k in T.CANDIDATE})},
        "published files measured as they are",
        keys=tuple(Key(k, {}, a) for k, a in T.CANDIDATE.items()),
        parse=parsers.candidates,
    )
    options: dict = key(
        _object({k.name: one_or_list(k.json) for k in T.OPTIONS}),
        "engine options for every cell (include entries may set them per cell); a list of values "
        "is an axis: a cell for each, of every engine that takes the option",
        keys=T.OPTIONS,
        parse=parsers.options,
    )
    centroid: str = key(  # its definition; its groups are centroid_groups
        _object(T.CENTROID),
        "how the centroid of the stacks is formed",
        keys=T.CENTROID,
        parse=parsers.centroid,
    )
    # how the run places and retries cells, and how long it waits
    replicas: int = key(POS_INT, "copies of each stack, each on its own node", 1)
    hosts: str = key(
        enum("shared", "per_cell"),
        "shared: cells of the same weights, engine build, device and threads run in turn in one "
        "host on one loaded model (where the engine can switch, e.g. HF's attention); per_cell: "
        "every cell loads in a host of its own",
        "shared",
    )
    cells_per_gpu: int = key(
        POS_INT,
        "hosts of tp 1 cells that share one GPU at a time (each asks 1/N of it): for models small "
        "enough that N of them fit its memory together",
        1,
    )
    retries: int = key({"type": "integer", "minimum": 0}, "restarts of a cell whose actor or node died", 2)
    # from the actor's start: weights shipped, artifacts built, engine loaded
    load_timeout_s: float = key(
        SECONDS, "seconds a cell may take to load (weights shipped, artefacts built)", 3600.0, unit="seconds"
    )
    # per repeat (None: matrix/run/retry.py scales it by tokens fed)
    capture_timeout_s: float | None = key(
        SECONDS, "seconds a repeat may take (null: scaled by the tokens fed)", unit="seconds"
    )
    # not keys: made from several keys' values, or from the file itself
    axes: dict[str, list] = derived(
        lambda r: {
            "model": list(r["models"]),
            "engine": r["engines"],
            "dtype": r["dtypes"],
            "attention": r["attention"],
            "tp": r["tp"],
            "device": r["devices"],
        }
    )  # cell key -> values
    # each plug-in's key (extras/) -> its parsed value, every cell's default (keys.spec_keys lists them)
    extras: dict = derived(lambda r: {k: r[k] for k in r.keys if k in r.plugins})
    centroid_groups: list = derived(parsers.centroid_groups)  # [(name, [selector, ...])], first match wins
    raw_text: str = derived(lambda r: r.text)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw_text.encode()).hexdigest()


# What each key takes and its default, as the declarations above say
TOP = {k.name: k for k in spec_keys(Spec)}
TOP_KEYS = {k.name for k in declared(Spec)}  # the plug-ins' are checked against the registry as it is then
DEFAULT_STRIDE = TOP["stride"].default
BOS_POLICIES = TOP["bos"].allowed
STORES = TOP["store"].allowed
REFERENCE_METRICS = TOP["reference_metrics"].allowed
KEEP_ROWS = TOP["keep_rows"].allowed
HOSTS = TOP["hosts"].allowed
CENTROID_DEFINITIONS = parsers.CENTROID["definition"].allowed


def _read_mapping(path: Path) -> tuple[str, dict]:
    if not path.is_file():
        raise UserError(f"{path}: spec file not found")
    text = read_text_file(path, "spec file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: malformed YAML: {where}{problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a spec must be a YAML mapping (got {type(data).__name__})")
    return text, data


def parse_spec(spec_path: str | os.PathLike, cls: type = Spec) -> Spec:
    """Parse and validate a spec file (matrix.spec.cells.load_spec also expands it into cells); cls:
    Spec or a subclass declaring more keys."""
    path = Path(spec_path)
    text, data = _read_mapping(path)
    return read(cls, path, text, data)
