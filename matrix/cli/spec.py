"""`matrix spec`: the spec's keys from their declarations (matrix/spec/schema.py gathers them: the
Spec fields, the plug-ins' keys, the nested tables), which parsing takes its keys, allowed values
and defaults from.

    matrix spec             every key: type, default, allowed values, meaning
    matrix spec --json      the same as JSON
    matrix spec --schema    JSON Schema, for an editor: `# yaml-language-server: $schema=spec.schema.json`

docs/spec-reference.md is the same rows (matrix/cli/docs.py spec_page; `matrix docs --check` fails
when a key changes and the page was not regenerated).
"""

from __future__ import annotations

import json

import extras
from common.output import emit_json, table


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


def cmd_spec(args) -> int:
    from matrix.spec import schema as S

    if args.schema:
        print(json.dumps(S.json_schema(), indent=1))
        return 0
    got = rows()
    if args.json:
        emit_json({"keys": got})
        return 0
    short = lambda t: t if len(t) <= 48 else t[:47] + "…"  # noqa: E731 - --json and docs/spec-reference.md: whole
    print(
        table(
            ["key", "type", "default", "what"],
            [
                [r["key"], short(r["type"]), "required" if r["required"] else shown(r["default"]), r["about"]]
                for r in got
            ],
        )
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="the spec's keys: type, default, allowed values (--schema: as JSON Schema)")
    p.add_argument("--schema", action="store_true", help="print the spec's JSON Schema (for editors)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_spec)
