"""Every spec key with its type, default, allowed values and meaning, from where each is declared:
the top-level keys as fields of Spec (matrix/spec/parse.py, through matrix/spec/keys.py), the
plug-ins' keys as the same record, the nested keys in matrix/spec/tables.py.

`matrix spec --schema` prints them as JSON Schema (for editors: yaml-language-server), and
`matrix docs` writes them out as docs/spec-reference.md. The nested parsers (positions, the
imatrix option, candidates, the per-cell extras) keep their own key lists; `_check` (run by
`matrix docs` and the tests) fails when one is accepted without being described, or described
without being accepted.
"""

from __future__ import annotations

from typing import Any

import extras
from common import positions as P
from matrix.spec.keys import Key, document, nullable, spec_keys
from matrix.spec.parse import Spec
from matrix.spec.tables import (
    AXIS_ABOUT,
    CANDIDATE,
    CELL_EXTRA,
    MODEL,
    OPTIONS,
    POS_INT,
    POSITIONS,
    SECONDS,
    axes,
    enum,
    one_or_list,
)

__all__ = [
    "AXIS_ABOUT",
    "CANDIDATE",
    "CELL_EXTRA",
    "MODEL",
    "OPTIONS",
    "POSITIONS",
    "POS_INT",
    "SECONDS",
    "Key",
    "axes",
    "enum",
    "nullable",
    "one_or_list",
]


def top(cls: type = Spec) -> tuple[Key, ...]:
    """The spec's top-level keys: those cls's fields declare, then the plug-ins'."""
    return spec_keys(cls)


def by_name(keys: tuple[Key, ...]) -> dict[str, Key]:
    return {k.name: k for k in keys}


def default(key: str) -> Any:
    return by_name(top())[key].default


def allowed(key: str) -> tuple:
    return by_name(top())[key].allowed


def json_schema(keys: tuple[Key, ...] | None = None) -> dict:
    """The whole spec (or the given keys: top(a Spec subclass)) as a JSON Schema (draft 2020-12) document."""
    return document(top() if keys is None else keys)


def _check() -> None:
    """Every Spec field is a key or derived, and every key a nested parser accepts is described in
    matrix/spec/tables.py, and nothing else is."""
    from matrix.spec import calibration, candidates

    top()  # keys.declared refuses a field that is neither

    for what, accepted, described in (
        ("positions", P.KEYS, POSITIONS),
        ("options.imatrix", calibration.KEYS, by_name(OPTIONS)["imatrix"].keys),
        ("candidates", candidates.CANDIDATE_KEYS, CANDIDATE),
    ):
        got = {k.name for k in described} if isinstance(described, tuple) else set(described)
        if got != set(accepted):
            raise AssertionError(
                f"matrix/spec/tables.py: {what} keys {sorted(set(accepted) ^ got)} are accepted or described, not both"
            )
    for x in extras.registered():
        if not x.about or not x.json_schema:
            raise AssertionError(f"extra {x.key}: no about or json_schema for the spec reference")
