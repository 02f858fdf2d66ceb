"""How a spec key is declared: once, as a field of the Spec dataclass (matrix/spec/parse.py) whose
metadata is its record (Key): JSON Schema, the line that documents it, its default, and its own
parser where the value has structure. A plug-in's key (extras/) is the same record, made from what
the plug-in declares. From these records come the spec file's parser (read), `matrix spec --schema`
and docs/spec-reference.md (matrix/spec/schema.py, matrix/spec/reference.py).

A key without a parser of its own is checked against its JSON Schema: one of an enum, or a string,
a boolean, an integer or a number within the schema's bounds, null where the schema allows it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import extras
from common.errors import UserError
from matrix.spec.validate import field_error

KEY = "spec_key"  # a field's metadata entry holding its Key
DERIVED = "spec_derived"  # a field that is no key: made from the reading (several keys, the path)


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()  # what a parser is given for a key the file leaves out


@dataclass(frozen=True)
class Key:
    name: str
    json: Any  # its JSON Schema, or a function making it when asked (values read from the registries)
    about: str
    default: Any = None  # None: absent means none / off
    required: bool = False
    keys: tuple["Key", ...] = field(default_factory=tuple)  # a mapping's own keys (documented below it)
    # (reading, this key, raw value or ABSENT) -> value; None: checked against the JSON Schema
    parse: Callable[["Reading", "Key", Any], Any] | None = None
    unit: str = ""  # what a number counts, for its error message ("seconds")

    @property
    def allowed(self) -> tuple:
        return tuple(self.json.get("enum", ()))


def key(json, about: str, default: Any = None, *, required=False, keys=(), parse=None, unit="") -> Any:
    """A spec key's field: `models: dict = key(...)` in the Spec dataclass declares the key."""
    return field(metadata={KEY: Key("", json, about, default, required, tuple(keys), parse, unit)})


def derived(make: Callable[["Reading"], Any]) -> Any:
    """A Spec field that is no spec key, made from the reading once every key is parsed."""
    return field(metadata={DERIVED: make})


def nullable(j: dict) -> dict:
    return {"anyOf": [j, {"type": "null"}]}


def plugin_key(x) -> Key:
    """A plug-in's key (extras.Extra: key, json_schema, about, parse) as the record a field's is;
    null or absent is off for every cell, and its parser makes the one-line errors."""

    def parse(r: Reading, k: Key, v: Any) -> Any:
        def fail(msg: str, value: Any = ..., sub: str = "") -> UserError:
            return r.fail(k.name + sub, msg, value)

        return x.parse(None if v is ABSENT else v, fail)

    return Key(x.key, nullable(x.json_schema), x.about, parse=parse)


def declared(cls) -> tuple[Key, ...]:
    """The keys cls's fields declare, in field order, each named after its field and with its JSON
    Schema made now (the engines registered at this moment)."""
    out = []
    for f in dataclasses.fields(cls):
        k = f.metadata.get(KEY)
        if k is not None:
            k = dataclasses.replace(k, name=f.name, json=k.json() if callable(k.json) else k.json)
            if k.parse is None and "enum" not in k.json and not _types(k.json):
                raise AssertionError(f"{cls.__name__}.{f.name}: a schema with no type or enum needs its own parse")
            out.append(k)
        elif DERIVED not in f.metadata:
            raise AssertionError(f"{cls.__name__}.{f.name}: neither a spec key (key()) nor derived (derived())")
    return tuple(out)


def spec_keys(cls) -> tuple[Key, ...]:
    """Every top-level key of a spec of class cls: its fields' keys, then the plug-ins' (as registered now)."""
    return declared(cls) + tuple(plugin_key(x) for x in extras.cell_extras())


def _types(j: dict) -> list[str]:
    t = j.get("type", [])
    return [t] if isinstance(t, str) else list(t)


def _must(k: Key) -> str:
    """What the value must be, in the words of its error message."""
    j, t = k.json, _types(k.json)
    null = "null" in t
    if "integer" in t:
        lo = j.get("minimum")
        what = "a positive integer" if lo == 1 else "a whole number" + (f", {lo} or more" if lo is not None else "")
        return what + (" or null" if null else "")
    if "number" in t:
        unit = f" of {k.unit}" if k.unit else ""
        lo = f" above {j['exclusiveMinimum']}" if "exclusiveMinimum" in j else ""
        lo = lo or (f", {j['minimum']} or more" if "minimum" in j else "")
        return f"a number{unit}{lo}" + (", or null" if null else "")
    word = {"boolean": "true or false", "string": "a string"}[t[0]]
    return word + (" or null" if null else "")


def _fits(j: dict, v: Any) -> bool:
    t = _types(j)
    if v is None:
        return "null" in t
    if isinstance(v, bool):
        return "boolean" in t
    if isinstance(v, str):
        return "string" in t
    if not (isinstance(v, int) and "integer" in t or isinstance(v, (int, float)) and "number" in t):
        return False
    return (
        v >= j.get("minimum", v)
        and v <= j.get("maximum", v)
        and ("exclusiveMinimum" not in j or v > j["exclusiveMinimum"])
    )


def check(r: Reading, k: Key, v: Any) -> Any:
    """A value against its key's JSON Schema (its default when absent); a number is a float."""
    if v is ABSENT:
        return k.default
    if "enum" in k.json:
        if v not in k.allowed:
            raise r.fail(k.name, f"expected one of {', '.join(map(str, k.allowed))}", v)
        return v
    if not _fits(k.json, v):
        raise r.fail(k.name, f"must be {_must(k)}", v)
    return float(v) if "number" in _types(k.json) and v is not None else v


class Reading:
    """One spec file being parsed: its keys' values, each parsed when first asked for (a key whose
    check needs another's value asks for it: r["centroid"])."""

    def __init__(self, cls, path: Path, text: str, data: dict):
        self.path, self.text, self.data = path, text, data
        self.keys = {k.name: k for k in spec_keys(cls)}
        self.plugins = tuple(x.key for x in extras.cell_extras())  # the keys no field declares
        self._values: dict[str, Any] = {}

    def fail(self, fld: str, msg: str, value: Any = ...) -> UserError:
        return field_error(self.path, fld, msg, value)

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            k, v = self.keys[name], self.data.get(name, ABSENT)
            self._values[name] = (k.parse or check)(self, k, v)
        return self._values[name]


def read(cls, path: Path, text: str, data: dict):
    """The spec of class cls from a file's mapping: unknown keys refused, required ones asked for,
    then every key parsed in the order declared, then the derived fields."""
    r = Reading(cls, path, text, data)
    known = sorted(r.keys)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise r.fail(unknown[0], f"unknown key; expected one of {', '.join(known)}")
    for k in r.keys.values():
        if k.required and k.name not in data:
            raise r.fail(k.name, "is required")
    for name in r.keys:
        r[name]
    made = {f.name: r[f.name] if KEY in f.metadata else f.metadata[DERIVED](r) for f in dataclasses.fields(cls)}
    return cls(**made)


def document(keys: tuple[Key, ...]) -> dict:
    """The keys as a JSON Schema (draft 2020-12) document: each key's schema with its line and default."""
    props = {
        k.name: {**k.json, "description": k.about, **({"default": k.default} if k.default is not None else {})}
        for k in keys
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "logit-matrix sweep spec",
        "type": "object",
        "properties": props,
        "required": [k.name for k in keys if k.required],
        "additionalProperties": False,
    }
