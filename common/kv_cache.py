"""llama.cpp's KV cache types: one type for both K and V (`kv_cache: q8_0`), or each its own
(`kv_cache: {k: q8_0, v: q4_0}`, or `q8_0,q4_0` in a spec, on a command line and in stack names).

A value has one encoding in a cell's options (what its id hashes): its label, the type where K and
V agree (so `{k: q8_0, v: q8_0}` and `q8_0` are one cell) and `K,V` where they differ. The engine
reads it as a KVCache, and a cell's settings record what ran as kv_cache_k and kv_cache_v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# llama.cpp's own list, in its order (common/arg.cpp kv_cache_types: what -ctk / -ctv accept)
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
DEFAULT = "f16"  # llama.cpp's default for both (common/common.h cache_type_k, cache_type_v)
FLOAT = frozenset({"f32", "f16", "bf16"})  # the rest are block-quantised (ggml_is_quantized)
PARTS = ("k", "v")
EXPECTED = f"expected one of {', '.join(TYPES)}, or a mapping {{k: TYPE, v: TYPE}}"


@dataclass(frozen=True)
class KVCache:
    k: str = DEFAULT
    v: str = DEFAULT

    @classmethod
    def of(cls, value: Any) -> KVCache:
        """An option's value: its label (`q8_0`, `q8_0,q4_0`), the {k, v} mapping an older cell's
        options may hold, or None (llama.cpp's default)."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            return cls(value.get("k", DEFAULT), value.get("v", DEFAULT))
        k, _, v = str(value).partition(",")
        return cls(k.strip(), v.strip() or k.strip())

    @classmethod
    def ran(cls, settings: dict) -> KVCache | None:
        """What a cell's settings record it ran with (an older cell's: its one `kv_cache`); None
        where the engine records none."""
        if settings.get("kv_cache_k"):
            return cls(settings["kv_cache_k"], settings["kv_cache_v"])
        return cls.of(settings["kv_cache"]) if settings.get("kv_cache") else None

    @property
    def label(self) -> str:
        """One word: the type, or `K,V` where they differ (what --kv-cache takes back)."""
        return self.k if self.k == self.v else f"{self.k},{self.v}"

    @property
    def is_default(self) -> bool:
        return (self.k, self.v) == (DEFAULT, DEFAULT)

    @property
    def quantised_v(self) -> str | None:
        """The V cache's type where it is block-quantised (llama.cpp then needs flash attention)."""
        return None if self.v in FLOAT else self.v

    def settings(self) -> dict[str, str]:
        """What a cell's settings record of it."""
        return {"kv_cache_k": self.k, "kv_cache_v": self.v}


def parse(value: Any, fail: Callable[..., Exception]) -> str:
    """A spec value -> its label, the option's one encoding. A part left out of a mapping is
    llama.cpp's default. fail(message, value, sub): the spec's one-line error for the field (sub:
    the part, e.g. ".k")."""
    if isinstance(value, str) and "," in value:
        k, _, v = value.partition(",")
        value = {"k": k.strip(), "v": v.strip()}
    if isinstance(value, str):
        if value not in TYPES:
            raise fail(EXPECTED, value)
        return value
    if not isinstance(value, dict) or not value:
        raise fail(EXPECTED, value)
    for part, t in value.items():
        if part not in PARTS:
            raise fail("unknown key; expected k (the K cache's type) or v (the V cache's)", ..., f".{part}")
        if t not in TYPES:
            raise fail(f"expected one of {', '.join(TYPES)}", t, f".{part}")
    return KVCache.of(value).label
