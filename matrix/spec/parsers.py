"""The parsers of the spec keys that have structure, each named by its key's declaration in Spec
(matrix/spec/parse.py): parser(reading, key, raw value or ABSENT) -> the value. A key whose check
needs another's value asks the reading for it (keep_rows reads reference_metrics and centroid).
Every error names the file, the field and the value.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import extras
from common import names
from common import positions as P
from matrix.spec import tables as T
from matrix.spec.candidates import parse_candidates
from matrix.spec.keys import ABSENT, Key, Reading, check
from matrix.spec.model_entry import parse_models
from matrix.spec.validate import as_list, check_axis_value, check_threads, field_error, positive_int

# Engine options that change the arithmetic. Defaults go under top-level `options:`;
# include entries may set them per cell. A backend lists the ones it takes.
# -> allowed values, int (a positive integer), bool, or dict (a mapping its own parser checks)
_KINDS = {"integer": int, "boolean": bool}
OPTION_KEYS = {k.name: k.allowed or _KINDS.get(k.json.get("type"), dict) for k in T.OPTIONS}
OPTION_KEYS.update({x.key: x.allowed for x in extras.options()})  # a plug-in's: its own parser (Extra.parse)
# Non-axis keys an include entry may add to a cell: `calibration` describes the artefact for model
# cards (like the centroid group it is not part of the cell id), `replicas: N` runs the same stack on
# N distinct nodes of its device class; the per-cell extras' keys are checked against the registry.
CELL_EXTRA_KEYS = set(T.CELL_EXTRA) | set(OPTION_KEYS)
CENTROID = {k.name: k for k in T.CENTROID}


def parse_entry(path: Path, fld: str, entry: Any, models: dict, extra_ok: bool, options_ok: bool = False) -> dict:
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
            out[k] = check_option(path, f"{fld}.{k}", k, v)
        else:
            more = CELL_EXTRA_KEYS | set(extras.keys()) if extra_ok else set(OPTION_KEYS) if options_ok else set()
            keys = names.CELL_AXES + tuple(sorted(more))
            raise field_error(path, f"{fld}.{k}", f"unknown key; expected one of {', '.join(keys)}")
    return out


def check_option(path: Path, fld: str, key: str, v: Any) -> Any:
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


def name(r: Reading, k: Key, v: Any) -> str:
    """The spec's name: a string, or the file's stem."""
    return r.path.stem if v is ABSENT else check(r, k, v)


def models(r: Reading, k: Key, v: Any) -> dict:
    return parse_models(r.path, r.data)


def axis(r: Reading, k: Key, v: Any) -> list:
    """An axis's values: one or a list, each known (a model's by the spec's models), none twice."""
    values = as_list(r.path, k.name, k.default if v is ABSENT else v)
    cell_key = names.SPEC_AXES[k.name]
    checked = [check_axis_value(r.path, f"{k.name}[{i}]", cell_key, x, r["models"]) for i, x in enumerate(values)]
    if len(set(checked)) != len(checked):
        raise r.fail(k.name, "has duplicate values", values)
    return checked


def include(r: Reading, k: Key, v: Any) -> list[dict]:
    return _entries(r, k, v, extra_ok=True)


def exclude(r: Reading, k: Key, v: Any) -> list[dict]:
    return _entries(r, k, v, extra_ok=False)


def _entries(r: Reading, k: Key, v: Any, extra_ok: bool) -> list[dict]:
    v = (None if v is ABSENT else v) or []
    if not isinstance(v, list):
        raise r.fail(k.name, "must be a list of mappings", v)
    return [parse_entry(r.path, f"{k.name}[{i}]", e, r["models"], extra_ok) for i, e in enumerate(v)]


def reference(r: Reading, k: Key, v: Any) -> dict:
    if v is ABSENT or v is None:
        return {}
    return parse_entry(r.path, k.name, v, r["models"], False, options_ok=True)


def stride(r: Reading, k: Key, v: Any) -> int:
    return r["positions"].stride


def positions(r: Reading, k: Key, v: Any) -> P.Positions:
    """`stride: N` (every N-th position and the last) or `positions:` (a window or a preset), not both."""
    if v is ABSENT:
        return P.Positions.every(check(r, r.keys["stride"], r.data.get("stride", ABSENT)))
    if "stride" in r.data:
        raise r.fail(
            "stride", "give the step inside positions (positions.stride) when positions is set", r.data["stride"]
        )
    return P.parse(v, k.name, lambda f, m, val=...: r.fail(f, m, val))


def corpus(r: Reading, k: Key, v: Any) -> str:
    """builtin, or a corpus file's absolute path (relative to the spec's directory)."""
    c = k.default if v is ABSENT else v
    if not isinstance(c, str) or not c:
        raise r.fail(k.name, "must be 'builtin' or a path to a corpus YAML file", c)
    if c != "builtin":
        cp = (r.path.parent / os.path.expanduser(c)).resolve()
        if not cp.is_file():
            raise r.fail(k.name, "corpus file not found", str(cp))
        c = str(cp)
    return c


def keep_rows(r: Reading, k: Key, v: Any) -> str:
    """keep_rows: references stores only the references' values: every other row must be measured
    where it is captured, and nothing else may need its values (a centroid)."""
    where, centroid = r["reference_metrics"], r["centroid"]
    keep = check(r, k, v)
    if keep == "references" and where != "in_actor":
        raise r.fail(
            k.name,
            "references needs reference_metrics: in_actor (the rows are "
            f"measured where they are captured), not {where}",
            keep,
        )
    if keep == "references" and centroid != "none":
        raise r.fail(
            k.name,
            f"references needs centroid: {{definition: none}} (a centroid reads every stack's values), not {centroid}",
            keep,
        )
    return keep


def candidates(r: Reading, k: Key, v: Any) -> list[dict]:
    return parse_candidates(r.path, r.data, r["models"])


def options(r: Reading, k: Key, v: Any) -> dict:
    raw_opts = (None if v is ABSENT else v) or {}
    if not isinstance(raw_opts, dict):
        raise r.fail("options", "must be a mapping", raw_opts)
    out = {}
    for o, given in raw_opts.items():
        if o not in OPTION_KEYS:
            raise r.fail(f"options.{o}", f"unknown option; expected one of {', '.join(sorted(OPTION_KEYS))}")
        if not isinstance(given, list):
            out[o] = check_option(r.path, f"options.{o}", o, given)
            continue
        # several values: an axis of the cells whose engine takes the option (matrix/spec/cells.py option_sets)
        if not given:
            raise r.fail(f"options.{o}", "must not be empty")
        values = [check_option(r.path, f"options.{o}[{i}]", o, x) for i, x in enumerate(given)]
        for i, x in enumerate(values):  # a plug-in's value that is itself an axis (cpu_path: offered)
            if isinstance(x, list):
                raise r.fail(f"options.{o}[{i}]", "is several values (an axis of its own): give it alone", given[i])
        if len({json.dumps(x, sort_keys=True) for x in values}) != len(values):
            raise r.fail(f"options.{o}", "has duplicate values", given)
        out[o] = values if len(values) > 1 else values[0]
    return out


def centroid(r: Reading, k: Key, v: Any) -> str:
    """centroid: {definition: mean_prob|mean_logprob|none, groups: ...} -> the definition (the groups:
    centroid_groups)."""
    definition = CENTROID["definition"]
    if v is ABSENT or v is None:
        return definition.default
    if not isinstance(v, dict):
        raise r.fail(k.name, "must be a mapping with keys definition, groups", v)
    for sub in v:
        if sub not in CENTROID:
            raise r.fail(f"centroid.{sub}", "unknown key; expected one of definition, groups")
    d = v.get("definition", definition.default)
    if d not in definition.allowed:
        raise r.fail("centroid.definition", f"expected one of {', '.join(definition.allowed)}", d)
    return d


def centroid_groups(r: Reading) -> list:
    """centroid.groups: {NAME: SELECTOR or [SELECTOR, ...]} -> [(name, [selector, ...])].

    A selector is a mapping of cell axes (like an exclude entry). A stack joins the first group
    it matches; stacks that match none form their model's default group. Groups never mix
    models (their vocabularies differ), so a group spanning two models has one centroid per model."""
    raw = r.data.get("centroid")
    graw = (raw or {}).get("groups") or {}
    if not isinstance(graw, dict):
        raise r.fail("centroid.groups", "must be a mapping of group name to selector(s)", graw)
    groups = []
    for gname, sel in graw.items():
        if not isinstance(gname, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", gname):
            raise r.fail("centroid.groups", "a group name must be letters, digits, _ or -", gname)
        sels = sel if isinstance(sel, list) else [sel]
        groups.append(
            (
                gname,
                [
                    parse_entry(r.path, f"centroid.groups.{gname}[{i}]", e, r["models"], False)
                    for i, e in enumerate(sels)
                ],
            )
        )
    return groups
