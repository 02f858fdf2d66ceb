"""The checks every spec field goes through: each error names the file, the field and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import backends
from common.errors import UserError


def field_error(path: Path, fld: str, msg: str, value: Any = ...) -> UserError:
    got = "" if value is ... else f" (got {value!r})"
    return UserError(f"{path}: {fld}: {msg}{got}")


def as_list(path: Path, fld: str, value: Any) -> list:
    if isinstance(value, list):
        if not value:
            raise field_error(path, fld, "must not be empty")
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return [value]
    raise field_error(path, fld, "must be a list or a single value", value)


def check_axis_value(path: Path, fld: str, key: str, value: Any, models: dict) -> Any:
    """Validate one cell-axis value; returns it normalised."""
    if key == "tp":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise field_error(path, fld, "tp must be a positive integer", value)
        return value
    if not isinstance(value, str):
        raise field_error(path, fld, f"{key} must be a string", value)
    allowed = {
        "engine": backends.engines,
        "dtype": backends.dtypes,
        "attention": backends.attentions,
        "device": backends.devices,
        "model": lambda: tuple(models),
    }[key]()
    if value not in allowed:
        raise field_error(path, fld, f"unknown {key}; expected one of {', '.join(allowed)}", value)
    return value


def check_threads(path: Path, fld: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise field_error(path, fld, "must be a positive integer or null", v)
    return v


def positive_int(path: Path, data: dict, key: str, default: int, fld: str | None = None) -> int:
    v = data.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise field_error(path, fld or key, "must be a positive integer", v)
    return v
