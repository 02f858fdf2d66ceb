"""llama.cpp's KV cache types as a spec names them: one type for both K and V (`kv_cache: q8_0`),
or each its own (`kv_cache: {k: q8_0, v: q4_0}`, written `q8_0,q4_0` on a command line and in
stack names).

A value is normalised once, where the spec is read: a plain type stays the string it is (so a
cell's id is what it was before K and V could differ), and a mapping whose K and V agree becomes
that string, so `{k: q8_0, v: q8_0}` and `q8_0` are one cell.
"""

from __future__ import annotations

from typing import Any, Callable

# llama.cpp's own list, in its order (common/arg.cpp kv_cache_types: what -ctk / -ctv accept)
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
DEFAULT = "f16"  # llama.cpp's default for both (common/common.h cache_type_k, cache_type_v)
FLOAT = frozenset({"f32", "f16", "bf16"})  # the rest are block-quantised (ggml_is_quantized)
PARTS = ("k", "v")


def parse(value: Any, fail: Callable[..., Exception]) -> str | dict:
    """A spec value -> its normal form: a type name, or {"k": TYPE, "v": TYPE} where they differ.
    A part left out of a mapping is llama.cpp's default. fail(message, value, sub): the spec's
    one-line error for the field (sub: the part, e.g. ".k")."""
    if isinstance(value, str) and "," in value:
        k, _, v = value.partition(",")
        value = {"k": k.strip(), "v": v.strip()}
    if isinstance(value, str):
        if value not in TYPES:
            raise fail(f"expected one of {', '.join(TYPES)}, or a mapping {{k: TYPE, v: TYPE}}", value)
        return value
    if not isinstance(value, dict) or not value:
        raise fail(f"expected one of {', '.join(TYPES)}, or a mapping {{k: TYPE, v: TYPE}}", value)
    for part, t in value.items():
        if part not in PARTS:
            raise fail("unknown key; expected k (the K cache's type) or v (the V cache's)", ..., f".{part}")
        if t not in TYPES:
            raise fail(f"expected one of {', '.join(TYPES)}", t, f".{part}")
    k, v = value.get("k", DEFAULT), value.get("v", DEFAULT)
    return k if k == v else {"k": k, "v": v}


def pair(value: str | dict | None) -> tuple[str, str]:
    """(K type, V type) of a normalised value; None: llama.cpp's default."""
    if value is None:
        return DEFAULT, DEFAULT
    if isinstance(value, str):
        return value, value
    return value["k"], value["v"]


def label(value: str | dict | None) -> str:
    """One word: the type, or `K,V` where they differ (what --kv-cache takes back)."""
    k, v = pair(value)
    return k if k == v else f"{k},{v}"


def quantised_v(value: str | dict | None) -> str | None:
    """The V cache's type where it is block-quantised (llama.cpp then needs flash attention), else None."""
    v = pair(value)[1]
    return None if v in FLOAT else v
