"""Sweep spec: strict YAML parsing and validation (matrix/spec/cells.py expands it into cells).

A spec is a GitHub-Actions-style matrix over the axes ``models``, ``engines``,
``dtypes``, ``attention``, ``tp`` and ``devices``, with ``include`` / ``exclude``
entries written with the singular cell keys (``model``, ``engine``, ...).
Every error names the file, the field and the value. The `models:` entries are parsed in
matrix/spec/model_entry.py (ModelRef is importable from here too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import extras
from common import names
from common import positions as P
from common.errors import UserError, read_text_file
from matrix.spec import schema as S
from matrix.spec.candidates import parse_candidates
from matrix.spec.model_entry import ModelRef, parse_models
from matrix.spec.validate import as_list, check_axis_value, check_threads, field_error, positive_int, retries, seconds

# Every key, its allowed values and its default come from the schema (matrix/spec/schema.py), which
# `matrix spec --schema` and docs/spec-reference.md are generated from.
TOP = S.by_name(S.top())
DEFAULT_STRIDE = TOP["stride"].default
BOS_POLICIES = TOP["bos"].allowed
# How rows are stored: native (lossless, the default) or bf16 (row max subtracted, rounded to bf16;
# each row's KL floor is measured as it is written: store/floors.py Storage)
STORES = TOP["store"].allowed
# Where each stack's metrics against its reference are computed: by `matrix analyze` (the default),
# or in the capturing actor as the rows come out, against the reference's rows already in the
# warehouse (a model's reference then runs before its other cells); analyze reuses them
REFERENCE_METRICS = TOP["reference_metrics"].allowed
KEEP_ROWS = TOP["keep_rows"].allowed
HOSTS = TOP["hosts"].allowed
TOP_KEYS = set(TOP) - set(extras.keys())  # the extras' keys are checked against the registry as it is then
# none: no centroid and no pairwise tables (a job that asks only for KL against the reference)
CENTROID = S.by_name(TOP["centroid"].keys)
CENTROID_DEFINITIONS = CENTROID["definition"].allowed
# Engine options that change the arithmetic. Defaults go under top-level `options:`;
# include entries may set them per cell. A backend lists the ones it takes.
# -> allowed values, int (a positive integer), bool, or dict (a mapping its own parser checks)
_KINDS = {"integer": int, "boolean": bool}
OPTION_KEYS = {k.name: k.allowed or _KINDS.get(k.json.get("type"), dict) for k in S.OPTIONS}
OPTION_KEYS.update({x.key: x.allowed for x in extras.options()})  # a plug-in's: its own parser (Extra.parse)
# `imatrix:` on a llama.cpp quant cell: quantise with an importance matrix computed on a calibration
# text (backends/gguf_imatrix.py); parsed and checked against the corpus in matrix/spec/calibration.py
# Non-axis keys an include entry may add to a cell.
# `calibration` describes the artefact (e.g. "imatrix from wiki.train, 512 chunks") for model
# cards; like the centroid group it is not part of the cell id.
# `replicas: N` runs the same stack on N distinct nodes of its device class (cross-host identity).
# The per-cell extras' keys (extras/, one module each) are spec keys too, at the
# top level (every cell) and in include entries; each extra parses its own.
CELL_EXTRA_KEYS = set(S.CELL_EXTRA) | set(OPTION_KEYS)


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the file's keys, validated, with their defaults. matrix.spec.cells.expand turns it
    into a Matrix (its cells)."""

    path: Path
    name: str
    models: dict[str, ModelRef]
    axes: dict[str, list]  # cell key -> values
    include: list[dict]
    exclude: list[dict]
    reference: dict
    stride: int
    repeats: int
    corpus: str  # "builtin" or an absolute path
    bos: str
    threads: int | None
    options: dict = field(default_factory=dict)
    max_tokens: int | None = None
    extras: dict = field(default_factory=dict)  # per-cell extra key -> its parsed value (every cell's default)
    replicas: int = 1  # default copies of each stack, each on its own node
    hosts: str = "shared"  # HOSTS: cells of one loaded model run in turn in one host, or each in its own
    cells_per_gpu: int = 1  # hosts of tp 1 cells that share one GPU at a time
    retries: int = 2  # a cell whose actor or node died is started again up to this many times
    load_timeout_s: float = 3600.0  # from the actor's start: weights shipped, artifacts built, engine loaded
    capture_timeout_s: float | None = None  # per repeat (None: matrix/run/retry.py scales it by tokens fed)
    centroid: str = "mean_prob"  # centroid definition
    centroid_groups: list = field(default_factory=list)  # [(name, [selector, ...])], first match wins
    positions: P.Positions = field(default_factory=P.Positions)  # which rows each prompt keeps
    store: str = "native"
    reference_metrics: str = "analyze"  # REFERENCE_METRICS
    keep_rows: str = "all"  # KEEP_ROWS: all, or references (the others' rows hashed, their values not stored)
    candidates: list[dict] = field(default_factory=list)  # published files measured as they are
    raw_text: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw_text.encode()).hexdigest()


def _parse_entry(path: Path, fld: str, entry: Any, models: dict, extra_ok: bool, options_ok: bool = False) -> dict:
    """An include entry (extra_ok: every per-cell key), a reference selector (options_ok: the axis
    keys and the engine options) or an exclude / centroid selector (the axis keys)."""
    if not isinstance(entry, dict) or not entry:
        raise field_error(path, fld, "must be a non-empty mapping of cell keys", entry)
    out = {}
    for k, v in entry.items():
        if k in names.CELL_AXES:
            out[k] = check_axis_value(path, f"{fld}.{k}", k, v, models)
        elif extra_ok and k in ("threads", "max_tokens"):
            out[k] = check_threads(path, f"{fld}.{k}", v)
        elif extra_ok and k in extras.keys():
            out[k] = parse_extra(path, f"{fld}.{k}", k, v)
        elif extra_ok and k == "replicas":
            out[k] = positive_int(path, entry, k, 1, fld=f"{fld}.{k}")
        elif extra_ok and k == "calibration":
            if not isinstance(v, str) or not v.strip():
                raise field_error(path, f"{fld}.{k}", "must be a non-empty string describing the calibration data", v)
            out[k] = v.strip()
        elif (extra_ok or options_ok) and k in OPTION_KEYS:
            out[k] = _check_option(path, f"{fld}.{k}", k, v)
        else:
            more = CELL_EXTRA_KEYS | set(extras.keys()) if extra_ok else set(OPTION_KEYS) if options_ok else set()
            keys = names.CELL_AXES + tuple(sorted(more))
            raise field_error(path, f"{fld}.{k}", f"unknown key; expected one of {', '.join(keys)}")
    return out


def _parse_keep_rows(path: Path, data: dict, where: str, centroid: str) -> str:
    """keep_rows: references stores only the references' values: every other row must be measured
    where it is captured, and nothing else may need its values (a centroid)."""
    keep = data.get("keep_rows", TOP["keep_rows"].default)
    if keep not in KEEP_ROWS:
        raise field_error(path, "keep_rows", f"expected one of {', '.join(KEEP_ROWS)}", keep)
    if keep == "references" and where != "in_actor":
        raise field_error(
            path,
            "keep_rows",
            "references needs reference_metrics: in_actor (the rows are "
            f"measured where they are captured), not {where}",
            keep,
        )
    if keep == "references" and centroid != "none":
        raise field_error(
            path,
            "keep_rows",
            f"references needs centroid: {{definition: none}} (a centroid reads every stack's values), not {centroid}",
            keep,
        )
    return keep


def _parse_centroid(path: Path, raw: Any, models: dict) -> tuple[str, list]:
    """centroid: {definition: mean_prob|mean_logprob, groups: {NAME: SELECTOR or [SELECTOR, ...]}}.

    A selector is a mapping of cell axes (like an exclude entry). A stack joins the first group
    it matches; stacks that match none form their model's default group. Groups never mix
    models (their vocabularies differ), so a group spanning two models has one centroid per model."""
    if raw is None:
        return CENTROID["definition"].default, []
    if not isinstance(raw, dict):
        raise field_error(path, "centroid", "must be a mapping with keys definition, groups", raw)
    for k in raw:
        if k not in ("definition", "groups"):
            raise field_error(path, f"centroid.{k}", "unknown key; expected one of definition, groups")
    definition = raw.get("definition", CENTROID["definition"].default)
    if definition not in CENTROID_DEFINITIONS:
        raise field_error(path, "centroid.definition", f"expected one of {', '.join(CENTROID_DEFINITIONS)}", definition)
    graw = raw.get("groups") or {}
    if not isinstance(graw, dict):
        raise field_error(path, "centroid.groups", "must be a mapping of group name to selector(s)", graw)
    groups = []
    for gname, sel in graw.items():
        if not isinstance(gname, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", gname):
            raise field_error(path, "centroid.groups", "a group name must be letters, digits, _ or -", gname)
        sels = sel if isinstance(sel, list) else [sel]
        groups.append(
            (gname, [_parse_entry(path, f"centroid.groups.{gname}[{i}]", e, models, False) for i, e in enumerate(sels)])
        )
    return definition, groups


def _check_option(path: Path, fld: str, key: str, v: Any) -> Any:
    kind = OPTION_KEYS[key]
    if key in {x.key for x in extras.options()}:
        return parse_extra(path, fld, key, v)
    if kind is dict:  # imatrix: {corpus, chunks, ctx, max_overlap}
        from matrix.spec.calibration import parse_option

        return parse_option(v, fld, path.parent, lambda f, m, val=...: field_error(path, f, m, val))
    if kind is bool:
        if not isinstance(v, bool):
            raise field_error(path, fld, "must be true or false", v)
    elif kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise field_error(path, fld, "must be a positive integer", v)
    elif v not in kind:
        raise field_error(path, fld, f"expected one of {', '.join(kind)}", v)
    return v


def parse_extra(path: Path, fld: str, key: str, v: Any) -> Any:
    """A per-cell extra's spec value, by its own parser (None: off)."""

    def fail(msg: str, value: Any = ..., sub: str = "") -> Exception:
        return field_error(path, fld + sub, msg, value)

    return extras.get(key).parse(v, fail)


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
    unknown = set(data) - TOP_KEYS - set(extras.keys())
    if unknown:
        k = sorted(unknown)[0]
        raise field_error(path, k, f"unknown key; expected one of {', '.join(sorted(TOP_KEYS | set(extras.keys())))}")
    if "models" not in data:
        raise field_error(path, "models", "is required")
    return text, data


AXIS_DEFAULTS = {k: TOP[k].default for k in names.SPEC_AXES if k != "models"}


def _parse_axes(path: Path, data: dict, models: dict) -> dict[str, list]:
    axes: dict[str, list] = {}
    for spec_key, cell_key in names.SPEC_AXES.items():
        if spec_key == "models":
            axes["model"] = list(models)
            continue
        values = as_list(path, spec_key, data.get(spec_key, AXIS_DEFAULTS[spec_key]))
        checked = [check_axis_value(path, f"{spec_key}[{i}]", cell_key, v, models) for i, v in enumerate(values)]
        if len(set(checked)) != len(checked):
            raise field_error(path, spec_key, "has duplicate values", values)
        axes[cell_key] = checked
    return axes


def _entries(path: Path, data: dict, key: str, models: dict, extra_ok: bool) -> list[dict]:
    v = data.get(key) or []
    if not isinstance(v, list):
        raise field_error(path, key, "must be a list of mappings", v)
    return [_parse_entry(path, f"{key}[{i}]", e, models, extra_ok) for i, e in enumerate(v)]


def _parse_corpus(path: Path, data: dict) -> str:
    corpus = data.get("corpus", TOP["corpus"].default)
    if not isinstance(corpus, str) or not corpus:
        raise field_error(path, "corpus", "must be 'builtin' or a path to a corpus YAML file", corpus)
    if corpus != "builtin":
        cp = (path.parent / os.path.expanduser(corpus)).resolve()
        if not cp.is_file():
            raise field_error(path, "corpus", "corpus file not found", str(cp))
        corpus = str(cp)
    return corpus


def _parse_options(path: Path, data: dict) -> dict:
    raw_opts = data.get("options") or {}
    if not isinstance(raw_opts, dict):
        raise field_error(path, "options", "must be a mapping", raw_opts)
    options = {}
    for k, v in raw_opts.items():
        if k not in OPTION_KEYS:
            raise field_error(path, f"options.{k}", f"unknown option; expected one of {', '.join(sorted(OPTION_KEYS))}")
        if not isinstance(v, list):
            options[k] = _check_option(path, f"options.{k}", k, v)
            continue
        # several values: an axis of the cells whose engine takes the option (matrix/spec/cells.py option_sets)
        if not v:
            raise field_error(path, f"options.{k}", "must not be empty")
        values = [_check_option(path, f"options.{k}[{i}]", k, x) for i, x in enumerate(v)]
        if len({json.dumps(x, sort_keys=True) for x in values}) != len(values):
            raise field_error(path, f"options.{k}", "has duplicate values", v)
        options[k] = values if len(values) > 1 else values[0]
    return options


def _parse_positions(path: Path, data: dict) -> P.Positions:
    """`stride: N` (every N-th position and the last) or `positions:` (a window or a preset), not both."""
    if "positions" not in data:
        return P.Positions.every(positive_int(path, data, "stride", DEFAULT_STRIDE))
    if "stride" in data:
        raise field_error(
            path, "stride", "give the step inside positions (positions.stride) when positions is set", data["stride"]
        )
    return P.parse(data["positions"], "positions", lambda f, m, v=...: field_error(path, f, m, v))


def _one_of(path: Path, data: dict, key: str, allowed) -> str:
    """A top-level key whose value is one of a few words (its default when absent)."""
    value = data.get(key, TOP[key].default)
    if value not in allowed:
        raise field_error(path, key, f"expected one of {', '.join(allowed)}", value)
    return value


def parse_spec(spec_path: str | os.PathLike) -> Spec:
    """Parse and validate a spec file (matrix.spec.cells.load_spec also expands it into cells)."""
    path = Path(spec_path)
    text, data = _read_mapping(path)
    models = parse_models(path, data)
    axes = _parse_axes(path, data, models)
    include, exclude = _entries(path, data, "include", models, True), _entries(path, data, "exclude", models, False)
    ref = data.get("reference")
    reference = _parse_entry(path, "reference", ref, models, False, options_ok=True) if ref is not None else {}
    corpus = _parse_corpus(path, data)
    bos = _one_of(path, data, "bos", BOS_POLICIES)
    options = _parse_options(path, data)
    store = _one_of(path, data, "store", STORES)
    where = _one_of(path, data, "reference_metrics", REFERENCE_METRICS)
    centroid, groups = _parse_centroid(path, data.get("centroid"), models)
    keep_rows = _parse_keep_rows(path, data, where, centroid)
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise field_error(path, "name", "must be a string", name)
    positions = _parse_positions(path, data)
    return Spec(
        path=path,
        name=name,
        models=models,
        axes=axes,
        include=include,
        exclude=exclude,
        reference=reference,
        stride=positions.stride,
        positions=positions,
        store=store,
        reference_metrics=where,
        keep_rows=keep_rows,
        candidates=parse_candidates(path, data, models),
        repeats=positive_int(path, data, "repeats", TOP["repeats"].default),
        corpus=corpus,
        bos=bos,
        threads=check_threads(path, "threads", data.get("threads")),
        options=options,
        max_tokens=check_threads(path, "max_tokens", data.get("max_tokens")),
        extras={k: parse_extra(path, k, k, data.get(k)) for k in extras.keys()},
        replicas=positive_int(path, data, "replicas", TOP["replicas"].default),
        hosts=_one_of(path, data, "hosts", HOSTS),
        cells_per_gpu=positive_int(path, data, "cells_per_gpu", TOP["cells_per_gpu"].default),
        retries=retries(path, data, TOP["retries"].default),
        load_timeout_s=seconds(path, data, "load_timeout_s", TOP["load_timeout_s"].default),
        capture_timeout_s=seconds(path, data, "capture_timeout_s", TOP["capture_timeout_s"].default),
        centroid=centroid,
        centroid_groups=groups,
        raw_text=text,
    )
