"""Readable stack names: `llamacpp/q4_k_m`, `mlx/q8_g64/activations=fp32`, `hf/bf16/eager`,
`llamacpp/f16/kv_cache=q8_0,q4_0` (K and V caches apart), `hf/fp32/sdpa/batch8` (a `batch:` cell).

A cell id pins everything (`model.engine.dtype.attention.tpN.device-<hash>@<build>`), so two
stacks that differ only in an option differ only in that hash. A name is the facets that tell
the warehouse's stacks apart: engine and dtype always, then each of attention, tp, device and
model that varies among its stacks; stacks still alike get the options that differ between
them (key=value), then a candidate's label, then their stack hash.
Names are a function of the warehouse, so a new stack can
lengthen the others' names; a cell id never changes.

`resolve` turns what a user typed into one cell id: a cell id as it is, a whole name, or any
part of one (`q4_1`, `mlx/activations=fp32`): every '/'-separated word must be a facet of the
stack. Several stacks matching is an error that lists them; a stack run by several builds or
runs resolves to its latest completed cell.
"""

from __future__ import annotations

import json
from typing import Any

from common import plugins
from common.errors import UserError


def facets(cell: dict[str, Any]) -> dict[str, list[str]]:
    """A cells row -> {facet: its words}; options are one word each, `key=value`."""
    opts = json.loads(cell.get("options") or "{}")
    recipe = json.loads(cell.get("artifact_recipe") or "{}")
    label = recipe.get("label") if recipe.get("tool") == "published artifact" else None
    return {
        "engine": [cell["engine"]],
        "dtype": [cell["dtype"]],
        "attention": [cell["attention"]],
        "tp": [f"tp{cell['tp']}"],
        "device": [cell["device"]],
        "model": [cell["model"]],
        "options": [f"{k}={_word(k, v)}" for k, v in sorted(opts.items())],
        "candidate": [label] if label else [],
        "plugins": plugins.provider.name_words(cell),  # e.g. a batch cell's size (extras/: Extra.name_words)
    }


def _word(key: str, v: Any) -> str:
    word = plugins.provider.option_word(key, v)  # a plug-in's own word: kv_cache=q8_0,q4_0 (K, then V)
    if word is not None:
        return word
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, separators=(",", ":"))


def names(cells: list[dict[str, Any]]) -> dict[str, str]:
    """{stack_id: its name} for every stack of these cells rows, unique among them."""
    stacks = {c["stack_id"]: facets(c) for c in cells}
    varies = [f for f in ("attention", "tp", "device", "model") if len({tuple(v[f]) for v in stacks.values()}) > 1]
    out = {
        s: "/".join(
            w
            for f in ("engine", "dtype", *varies, "plugins")
            for w in v[f]
            if not (f == "attention" and w == "default")
        )
        for s, v in stacks.items()
    }  # "default": the engine's own attention, said by saying nothing
    for extra in (_options_apart, _candidates_apart, _hashes_apart):
        for same in _alike(out):
            for s, more in extra(same, stacks).items():
                out[s] = "/".join([out[s], *more]) if more else out[s]
    return out


def _alike(out: dict[str, str]) -> list[list[str]]:
    seen: dict[str, list[str]] = {}
    for s, n in out.items():
        seen.setdefault(n, []).append(s)
    return [same for same in seen.values() if len(same) > 1]


def _options_apart(same: list[str], stacks: dict) -> dict[str, list[str]]:
    """The options whose values differ among alike stacks, as key=value (an absent key shows nothing)."""
    opts = {s: dict(w.split("=", 1) for w in stacks[s]["options"]) for s in same}
    keys = sorted({k for o in opts.values() for k in o if len({o.get(k) for o in opts.values()}) > 1})
    return {s: [f"{k}={opts[s][k]}" for k in keys if k in opts[s]] for s in same}


def _candidates_apart(same: list[str], stacks: dict) -> dict[str, list[str]]:
    return {s: stacks[s]["candidate"] for s in same}


def _hashes_apart(same: list[str], stacks: dict) -> dict[str, list[str]]:
    return {s: [s.rsplit("-", 1)[-1]] for s in same}


def _matches(words: list[str], cell: dict[str, Any], name: str) -> bool:
    have = {w for ws in facets(cell).values() for w in ws} | set(name.split("/"))
    return all(w in have for w in words)


def resolve(cells: list[dict[str, Any]], asked: str, where: str = "cell") -> str:
    """A cell id, or a stack name or part of one -> the cell id (see the module docstring);
    where: what the error line starts with (the command and its warehouse)."""
    if any(c["cell_id"] == asked for c in cells):
        return asked
    by_stack = names(cells)
    words = [w for w in asked.split("/") if w]
    exact = [
        c for c in cells if by_stack[c["stack_id"]] == asked
    ]  # a whole name: that stack, whatever else shares its words
    hits = exact or [c for c in cells if words and _matches(words, c, by_stack[c["stack_id"]])]
    stacks = sorted({by_stack[c["stack_id"]] for c in hits})
    if not stacks:
        raise UserError(f"{where}: {asked!r} is no cell id or stack name there (`matrix stacks` lists them)")
    if len(stacks) > 1:
        raise UserError(f"{where}: {asked!r} matches {len(stacks)} stacks: {', '.join(stacks)}; name one of them")
    done = sorted((c for c in hits if c["status"] == "done"), key=lambda c: str(c["finished_at"]))
    if not done:
        raise UserError(f"{where}: {asked!r}: stack {stacks[0]} has no completed cell")
    return done[-1]["cell_id"]


def listing(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per stack: its name, its latest cell, the cells it has, whether it is a reference."""
    by_stack = names(cells)
    out = []
    for stack, name in sorted(by_stack.items(), key=lambda kv: kv[1]):
        mine = sorted((c for c in cells if c["stack_id"] == stack), key=lambda c: str(c["finished_at"]))
        done = [c for c in mine if c["status"] == "done"]
        latest = (done or mine)[-1]
        out.append(
            {
                "name": name,
                "cell_id": latest["cell_id"],
                "status": latest["status"],
                "cells": len(mine),
                "is_reference": any(c["is_reference"] for c in mine),
                "engine": latest["engine"],
                "dtype": latest["dtype"],
                "attention": latest["attention"],
                "model": latest["model"],
                "device": latest["device"],
            }
        )
    return out
