"""Do two warehouses hold the same rows? For a refactor that must not change behaviour.

    python scripts/same_rows.py WAREHOUSE_A WAREHOUSE_B

Every table and summary view is read through the same DuckDB views `matrix sql` uses, ordered,
and compared row for row (full-vocabulary logits included). Columns that differ between any two
runs of one spec are left out: run ids, times, the driver's pid and argv, Ray node ids; so are
the timings inside a JSON column (a per-cell extra's `seconds` or `decode_seconds`).
Prints one line per table; exit 0 when every table is the same, 1 otherwise.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import extras  # noqa: E402,F401  (the plug-ins' views)
from analysis.sql import all_views, connect  # noqa: E402
from store import TABLES  # noqa: E402

VOLATILE = {"run_id", "started_at", "finished_at", "load_seconds", "capture_seconds", "pid", "argv", "node_id"}
VOLATILE_KEYS = {"seconds", "decode_seconds"}  # wall-clock times inside a JSON column


def steady(value):
    """A JSON object's text without its timings; any other value as it is."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            obj = json.loads(value)
        except ValueError:
            return value
        return json.dumps({k: v for k, v in obj.items() if k not in VOLATILE_KEYS}, sort_keys=True)
    return value


def rows(con, name: str) -> list[tuple]:
    cols = [c[0] for c in con.execute(f"SELECT * FROM {name} LIMIT 0").description if c[0] not in VOLATILE]
    got = con.execute(f"SELECT {', '.join(cols)} FROM {name} ORDER BY ALL").fetchall()
    # ordered again without the timings (they may have ordered two rows); arrays left out of the key
    return sorted(
        (tuple(steady(v) for v in r) for r in got),
        key=lambda r: repr(tuple(v for v in r if not isinstance(v, (list, bytes)))),
    )


def main(a: str, b: str) -> int:
    ca, cb = connect(a), connect(b)
    same = True
    for name in [*TABLES, *all_views()]:
        ra, rb = rows(ca, name), rows(cb, name)
        ok = ra == rb
        same &= ok
        first = (
            ""
            if ok
            else next(
                (f", first difference at row {i}" for i, (x, y) in enumerate(zip(ra, rb)) if x != y),
                f", {len(ra)} vs {len(rb)} rows",
            )
        )
        print(f"{name:18} {len(ra):7} rows  {'same' if ok else 'DIFFERENT' + first}")
    return 0 if same else 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    sys.exit(main(sys.argv[1], sys.argv[2]))
