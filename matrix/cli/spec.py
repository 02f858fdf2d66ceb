"""`matrix spec`: the spec's keys from their declarations (matrix/spec/schema.py gathers them: the
Spec fields, the plug-ins' keys, the nested tables), which parsing takes its keys, allowed values
and defaults from.

    matrix spec             every key: type, default, allowed values, meaning
    matrix spec --json      the same as JSON
    matrix spec --schema    JSON Schema, for an editor: `# yaml-language-server: $schema=spec.schema.json`

docs/spec-reference.md is the same rows (matrix/api/pages.py spec_page; `matrix docs --check` fails
when a key changes and the page was not regenerated).
"""

from __future__ import annotations

import json

from common.output import emit_json, table


def cmd_spec(args) -> int:
    from matrix import api
    from matrix.spec.reference import shown

    result = api.spec()
    if args.schema:
        print(json.dumps(result.schema, indent=1))
        return 0
    got = result.keys
    if args.json:
        emit_json(result.to_dict())
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
