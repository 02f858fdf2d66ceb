"""`matrix cache list` and `matrix cache prune`: the engine artifacts this machine has built."""

from __future__ import annotations

import re
import time

from common.errors import UserError
from common.output import emit_json, human, log, table

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `2w` or seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m:
        raise UserError(f"--older-than: expected a duration like 30d, 12h or 90m, got {text!r}")
    return float(m[1]) * UNITS[m[2] or "s"]


def cmd_cache(args) -> int:
    from matrix import api

    if args.action == "list":
        result = api.cache(args.warehouse)
        if args.json:
            emit_json(result.to_dict())
            return 0
        _print_cache(result, bool(args.warehouse))
        return 0
    result = api.prune_cache(duration(args.older_than), args.keep_used_by)
    for a in result.removed:
        log(
            f"removed {a.kind} {a.file} ({human(a.bytes)}, "
            f"last used {(time.time() - a.last_used) / 86400:.1f} d ago): {a.dir}"
        )
    for a in result.in_use:
        log(f"kept {a.dir}: a running cell holds it")
    log(
        f"pruned {len(result.removed)} artifact(s), {human(sum(a.bytes for a in result.removed))}; "
        f"{len(result.in_use)} in use"
    )
    if args.json:
        emit_json(result.to_dict())
    return 0


def _print_cache(result, with_cells: bool) -> None:
    now = time.time()
    print(
        table(
            ["kind", "file", "tool", "size", "last used", "cells", "dir"],
            [
                [
                    a["kind"],
                    a["file"],
                    a["tool"] or "",
                    human(a["bytes"]),
                    f"{(now - a['last_used']) / 86400:.1f} d ago",
                    str(len(a["cells"])) if with_cells else "-",
                    a["dir"],
                ]
                for a in result.artifacts
            ],
        )
    )
    print(f"\n{len(result.artifacts)} artifact(s), {human(result.bytes)} in {result.root}")


def add_parsers(sub) -> None:
    c = sub.add_parser("cache", help="the engine artifacts (GGUF, MLX conversions, imatrices) built on this machine")
    csub = c.add_subparsers(dest="action", required=True)
    cl = csub.add_parser("list", help="each artifact: what it is, its size, its last use (and the cells that ran it)")
    cl.add_argument(
        "--warehouse", action="append", metavar="WH", help="name the cells of this warehouse that ran each one"
    )
    cl.add_argument("--json", action="store_true")
    cp = csub.add_parser("prune", help="remove artifacts not used lately; one a running cell holds is never removed")
    cp.add_argument(
        "--older-than", default="0", metavar="DURATION", help="only those unused this long (30d, 12h; default: all)"
    )
    cp.add_argument(
        "--keep-used-by", action="append", metavar="WH", help="keep every artifact a cell of this warehouse ran"
    )
    cp.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_cache)
