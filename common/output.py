"""What commands print: aligned text tables and JSON on stdout, progress lines on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any


def table(cols: list[str], rows: list[list[Any]]) -> str:
    cells = [[("" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in cells]
    return "\n".join(lines)


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def log(msg: str) -> None:
    """Progress and notes go to stderr, so stdout stays the command's result (table or JSON)."""
    print(msg, file=sys.stderr, flush=True)


def human(n: float) -> str:
    """A byte count in decimal units (1.5 MB)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
