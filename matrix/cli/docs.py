"""`matrix docs`: the reference pages generated from the code, so they cannot drift from it.

    docs/cli.md        every command and option, from the argument parsers (here)
    docs/warehouse.md  every table's columns (store/schema.py, with its comments) and every
                       view's columns (analysis/sql.py, as DuckDB derives them)
    docs/spec-reference.md every spec key: type, default, allowed values (matrix/spec/reference.py)
    docs/benchmarks.md the scoreboard: every run the benchmark scripts recorded (benchmarks/results/)

The other pages than cli.md are made by matrix.api.docs (matrix/api/pages.py).

`matrix docs --check` exits 1 naming each page that differs from what the code generates
(tests/test_docs.py runs it); `matrix docs` writes them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.output import emit_json
from matrix.api.pages import DOCS, HEADER, REPO
from matrix.api.pages import cell as _cell


def _parsers(p: argparse.ArgumentParser, prefix: str = "matrix"):
    """(command line, its help, its parser) for every leaf command, in the order they were added."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, p.description or "", p
        return
    helps = {a.dest: a.help or "" for a in subs[0]._choices_actions}
    for name, child in subs[0].choices.items():
        for line, about, leaf in _parsers(child, f"{prefix} {name}"):
            yield line, about or helps.get(name, ""), leaf


def _option(a: argparse.Action) -> tuple[str, str, str]:
    names = ", ".join(a.option_strings) if a.option_strings else a.dest.upper()
    if not a.option_strings:
        takes = (
            "positional"
            + (", repeatable" if a.nargs in ("*", "+") else "")
            + (", optional" if a.nargs in ("?", "*") else "")
        )
    elif a.choices:
        takes = " \\| ".join(map(str, a.choices))
    elif a.nargs == 0:
        takes = "flag"
    else:
        takes = (a.metavar or a.dest).upper() + (" ..." if a.nargs in ("*", "+") else "")
    shown = str(a.default)
    if shown.startswith(str(REPO) + "/") or shown == str(REPO):  # a path of this checkout: as the repository names it
        shown = shown[len(str(REPO)) + 1 :] or "."
    default = "" if a.default in (None, False, argparse.SUPPRESS) or a.required else f"`{shown}`"
    return names, takes, default


def cli_page(build_parser) -> str:
    out = [
        HEADER.format(src="matrix/cli/*.py (the argument parsers)"),
        "# The `matrix` command\n",
        "Every command, its arguments and their defaults. Bad input is one line naming the file, field and "
        "value, exit 2; an operational failure one line, exit 1; `--debug` anywhere on the line shows the "
        "traceback.\n",
    ]
    for line, about, p in _parsers(build_parser()):
        out.append(f"## `{line}`\n")
        if about:
            out.append(f"{_cell(about)}\n")
        rows = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
        if rows:
            out.append("| argument | takes | default | what |\n| --- | --- | --- | --- |")
            for a in rows:
                names, takes, default = _option(a)
                out.append(f"| `{names}` | {takes} | {default} | {_cell(a.help or '')} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def cmd_docs(args) -> int:
    from matrix import api

    result = api.docs(args.out, check=args.check, pages={"cli.md": lambda: cli_page(args.build_parser)})
    if args.json:
        emit_json(result.to_dict())
    elif args.check and result.pages:
        print(
            f"matrix docs: {', '.join(str(Path(result.out) / n) for n in result.pages)} differ from what the code "
            "generates; run `matrix docs`"
        )
    return 0 if result.ok else 1


def add_parser(sub, build_parser) -> None:
    """build_parser: the whole command line's (matrix/cli/main.py), whose parsers docs/cli.md shows."""
    d = sub.add_parser(
        "docs",
        help="write the pages generated from the code (docs/cli.md, docs/warehouse.md, "
        "docs/spec-reference.md, docs/benchmarks.md)",
    )
    d.add_argument("--out", default=str(DOCS), help="where the pages go (default: this checkout's docs/)")
    d.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from the code's")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_docs, build_parser=build_parser)
