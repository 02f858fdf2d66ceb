"""The spec's keys as rows for a reader: `matrix spec`, its --json and docs/spec-reference.md are
these rows (from the declarations matrix/spec/schema.py gathers), nested keys as parent.key."""

from __future__ import annotations

import json

import extras


def kind(j: dict) -> str:
    """A JSON Schema fragment in a few words: `integer >= 1`, `list of string`, `mapping`."""
    if "enum" in j:
        return "one of " + ", ".join(json.dumps(v) if not isinstance(v, str) else v for v in j["enum"])
    if "anyOf" in j:
        return " or ".join(kind(x) for x in j["anyOf"])
    if j.get("type") == "null":
        return "null"
    t = j.get("type")
    if isinstance(t, list):
        t = " or ".join(t)
    if t == "array":
        return f"list of {kind(j.get('items', {}))}"
    if t == "object":
        return "mapping"
    bound = next((f" {op} {j[k]}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">")) if k in j), "")
    return f"{t}{bound}" if t else "see below"


def rows(keys: tuple | None = None) -> list[dict]:
    """Every key (of keys: schema.top() of a Spec subclass; default: the spec's), nested ones as
    parent.key, in the order declared."""
    from matrix.spec import schema as S

    out = []

    def walk(keys, prefix=""):
        for k in keys:
            out.append(
                {
                    "key": prefix + k.name,
                    "type": kind(k.json) if k.json else "",
                    "default": k.default,
                    "required": k.required,
                    "about": k.about,
                }
            )
            walk(k.keys, f"{prefix}{k.name}.")

    walk(S.top() if keys is None else keys)
    entry = [S.Key(a, j, S.AXIS_ABOUT[a]) for a, j in S.axes().items()]
    entry += [S.Key(k, j, about) for k, (j, about) in S.CELL_EXTRA.items()]
    entry += [S.Key(k.name, k.json, "as under options, for this cell") for k in S.OPTIONS]
    entry += [S.Key(x.key, x.json_schema, x.about + " (this cell)") for x in extras.cell_extras()]
    walk(entry, "include[].")
    return out


def shown(v) -> str:
    return "" if v is None else json.dumps(v) if not isinstance(v, str) else v
