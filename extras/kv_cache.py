"""`kv_cache: q8_0` (or {k: q8_0, v: q4_0}): llama.cpp's KV cache type, an engine option graded
against a partner cell, the same stack on llama.cpp's default f16 cache.

The value rides in the cell's engine options (llama.cpp reads it as -ctk / -ctv do: type_k,
type_v; common/kv_cache.py), so it is set where options are: `options:` (a list is an axis),
include entries, reference selectors, a candidate's entry and `matrix kld --kv-cache`. An engine
that takes no option kv_cache skips the cell, saying so. Each cell not on f16 is measured row by row
against its partner (cells.kv_cache_of: the stack with `kv_cache: f16`, else the stack without the
option where only that one is in the sweep) into kv_cache_metrics; the kv_cache_drift view sums it
(analysis/kv_cache_drift.py).
"""

from __future__ import annotations

import json
from typing import Any

from common import kv_cache as KV
from extras import PartnerGraded

_TYPE = {"enum": list(KV.TYPES)}
_ANY = "|".join(KV.TYPES)
_PARTS = {"type": "object", "properties": {p: _TYPE for p in KV.PARTS}, "additionalProperties": False}


class KvCache(PartnerGraded):
    key = "kv_cache"
    grading = "analysis.kv_cache_drift"
    partner_about = "the stack id of the same stack on the f16 KV cache, what kv_cache_drift compares it with"
    option = True
    title = "KV cache"
    allowed = KV.TYPES
    default = KV.DEFAULT
    table = None
    rank = 70
    about = (
        "llama.cpp's KV cache type: one for K and V, or {k: TYPE, v: TYPE} (a part left out: f16), also "
        "written K,V; a quantised V needs flash attention (a cell of attention eager is skipped)"
    )
    json_schema = {
        "anyOf": [_TYPE, {"type": "string", "pattern": f"^({_ANY}),({_ANY})$"}, {**_PARTS, "minProperties": 1}]
    }
    schema_keys = tuple((p, _TYPE, f"the {p.upper()} cache's type", KV.DEFAULT) for p in KV.PARTS)
    flag = "--kv-cache"
    flag_metavar = "TYPE|K,V"
    flag_help = (
        "the KV cache type this invocation's candidates run with, for K and V or as K,V (llama.cpp's "
        f"-ctk / -ctv: {', '.join(KV.TYPES)}); the reference keeps f16, so the reference's own file "
        "is a candidate too (default: f16)"
    )

    # the spec
    def parse(self, value: Any, fail) -> str:
        return KV.parse(value, fail)

    def label(self, value: Any) -> str:
        return KV.KVCache.of(value).label  # K and V apart as --kv-cache takes them: q8_0,q4_0

    def from_flag(self, text: str, fail) -> str | None:
        parts = text.split(",")
        if len(parts) > 2 or any(p.strip() not in KV.TYPES for p in parts):
            raise fail(f"expected a type ({', '.join(KV.TYPES)}) for K and V, or K,V")
        kv = KV.parse(text, lambda msg, val=..., sub="": fail(msg))
        return None if KV.KVCache.of(kv).is_default else kv  # f16: the same cell as no flag

    def partner(self, value: Any) -> str | None:
        return None if KV.KVCache.of(value).is_default else KV.DEFAULT

    def unsupported(self, engine_cls, cell, value) -> str | None:
        return None  # an engine without the option skips the cell as for any option it does not take

    # the report (the cells column, table, analyze, views and card: PartnerGraded, from
    # analysis/kv_cache_drift.py)
    def model_report(self, data: dict, model: str, k: int) -> str:
        from analysis.kv_cache_drift import section

        return section(data, model, k)

    def disclose(self, cell_row: dict, ref_row: dict) -> dict:
        """Both stacks' K and V cache types where either is not llama.cpp's default, as their
        settings record what the engine ran."""
        mine, theirs = _ran(cell_row), _ran(ref_row)
        if (mine is None or mine.is_default) and (theirs is None or theirs.is_default):
            return {}

        def say(kv: KV.KVCache | None, c: dict) -> str:
            if kv is None:
                return f"none recorded ({c['engine']})"
            flash = _settings(c).get("flash_attn")
            return (
                f"K {kv.k}, V {kv.v}"
                + (" (llama.cpp's default)" if kv.is_default else "")
                + (f", attention {flash}" if flash else "")
            )

        return {"kv_cache": {"candidate": say(mine, cell_row), "reference": say(theirs, ref_row)}}


def _settings(cell: dict) -> dict:
    raw = cell.get("settings")
    return json.loads(raw) if isinstance(raw, str) and raw else (raw or {})


def _ran(cell: dict) -> KV.KVCache | None:
    """The KV cache a cell ran with, as its settings record it; None where the engine records none."""
    return KV.KVCache.ran(_settings(cell))


EXTRA = KvCache
