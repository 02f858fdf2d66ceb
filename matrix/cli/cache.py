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


def _users(warehouses: list[str]) -> dict[str, list[str]]:
    """artifact sha256 -> the cells of these warehouses that ran it."""
    from store import Warehouse

    out: dict[str, list[str]] = {}
    for where in warehouses:
        for c in Warehouse(where).require().read_all("cells"):
            if c.get("artifact_sha256"):
                out.setdefault(c["artifact_sha256"], []).append(c["cell_id"])
    return out


def cmd_cache(args) -> int:
    from backends import artifacts

    if args.action == "list":
        users = _users(args.warehouse or [])
        items = [{**a.to_dict(), "cells": users.get(a.sha256, [])} for a in artifacts.listing()]
        if args.json:
            emit_json({"root": str(artifacts.root()), "artifacts": items, "bytes": sum(a["bytes"] for a in items)})
            return 0
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
                        str(len(a["cells"])) if args.warehouse else "-",
                        a["dir"],
                    ]
                    for a in items
                ],
            )
        )
        print(f"\n{len(items)} artifact(s), {human(sum(a['bytes'] for a in items))} in {artifacts.root()}")
        return 0
    keep = set(_users(args.keep_used_by or []))
    removed, busy = artifacts.prune(duration(args.older_than), keep)
    for a in removed:
        log(
            f"removed {a.kind} {a.file} ({human(a.bytes)}, "
            f"last used {(time.time() - a.last_used) / 86400:.1f} d ago): {a.dir}"
        )
    for a in busy:
        log(f"kept {a.dir}: a running cell holds it")
    log(f"pruned {len(removed)} artifact(s), {human(sum(a.bytes for a in removed))}; {len(busy)} in use")
    if args.json:
        emit_json({"removed": [a.to_dict() for a in removed], "in_use": [a.to_dict() for a in busy]})
    return 0


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
