"""The plug-ins: whatever varies a cell beyond model × engine × dtype × attention × TP × device, or
what a cell records beside its rows (batch, KV cache types, layers, decode, prefix cache, prefill
chunking), each in one module of this package (extras/_interface.py: the interface).

A plug-in is a spec key whose value rides on the cell and is part of its id: in `Cell.extras`, or,
for an engine option (`option`), in the cell's options; each module of this package holds one and
names its class in `EXTRA`. Its module declares all the core needs:

    key, parse            the spec key and its parser (None: off for that cell)
    about, json_schema    the key's line and JSON Schema in the spec reference
    sweeps, expand        an axis: one spec value is several cells (batch sizes), each its own id part
    partner               grading against a partner cell: the value of the cell it is measured against
    option, label, flag   an engine option: set where options are, its word in names, `matrix kld`'s flag
    hook                  the engine method that supports it: an engine implements it, no flag elsewhere
    table, paths          the side table its rows go to (layer_states, or the d<repeat> file with a path per row)
    resolve, side_rows    its checks against the model at plan time; its side rows per repeat
    capturer              what runs beside each prompt's forward in the capturing process
    record, cell_record   its part of the cells row: from each capture's manifest, and from the cell
    cell_columns, tables  the cells columns it records and its own tables (store.schema reads them)
    analysis, card        its metrics in `matrix analyze`, its block of the model card, its report section
    views, name_words     the SQL views that grade it (created after the core's: analysis.sql.all_views);
                          its words in a stack's readable name (analysis/stack_names.py)
    disclose              its entries of a card's disclosure (both sides' KV cache types)

The core (spec, plan, actor, run loop, verify, analyze, card, report) loops over `registered()`.
Extras are found through a lazy key -> "module:Class" map, as engines are (backends/__init__.py):
the modules of this package, then the entry points of the group ``logit_matrix.extras`` (name =
key, value = "package.module:Class") of the distributions installed; a built-in's key wins. An
outside extra is installed wherever its cells capture, as an outside engine is: a capturing
process that lacks one a cell asks for fails that cell, naming it (`require`).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import socket
from importlib.metadata import entry_points
from typing import Any, Callable

from extras._interface import Capturer, Extra, PartnerGraded, add_pairs, agreement, loads

__all__ = ["Capturer", "Extra", "PartnerGraded", "add_pairs", "agreement", "loads"]

GROUP = "logit_matrix.extras"


@functools.lru_cache(maxsize=1)
def _builtin() -> dict[str, str]:
    """key -> "extras.module:Class" of every module of this package, in the order the modules run
    (their `rank`: the order of a cell's extras in its row, card and report)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):  # the interface, not an extra
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        cls = module.EXTRA
        found.append((cls.rank, cls.key, f"{module.__name__}:{cls.__name__}"))
    return {key: target for _, key, target in sorted(found)}


@functools.lru_cache(maxsize=None)
def _load(target: str) -> "Extra":
    module, _, name = target.partition(":")
    extra = getattr(importlib.import_module(module), name)()
    extra.target = target
    return extra


@functools.cache
def _targets() -> dict[str, str]:
    """key -> "module:Class": the package's own, then the entry points (a built-in's key wins)."""
    found = dict(_builtin())
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        found.setdefault(ep.name, ep.value)
    return found


def refresh() -> None:
    """Read the entry points again (after a distribution was installed into this process's path)."""
    _targets.cache_clear()


def registered() -> list["Extra"]:
    """Every extra, built-ins first, in the order their rows and card blocks appear."""
    return [_load(t) for t in _targets().values()]


def get(key: str) -> "Extra":
    return next(x for x in registered() if x.key == key)


def keys() -> tuple[str, ...]:
    """The spec keys of the extras a cell carries (Cell.extras); an engine option's is among the options."""
    return tuple(x.key for x in registered() if not x.option)


def cell_extras() -> list["Extra"]:
    """The extras a cell carries (Cell.extras), every plug-in but the engine options."""
    return [x for x in registered() if not x.option]


def of(asking) -> list[tuple["Extra", Any]]:
    """(extra, value) for each extra a Cell, a StackDesc or a (key, value) tuple asks for, in
    registry order; an engine option's from the cell's options."""
    asked = dict(getattr(asking, "extras", asking))
    opts = getattr(asking, "opts", {})
    got = [(x, opts.get(x.key) if x.option else asked.get(x.key)) for x in registered()]
    return [(x, v) for x, v in got if v is not None]


def cell_records(cell) -> dict[str, Any]:
    """The cells columns the plug-ins fill from a cell (Extra.cell_record): each it asks for, and each
    that grades it against a partner on other hardware without being asked (Extra.partner_elsewhere)."""
    asked = of(cell)
    out = {k: v for x, value in asked for k, v in x.cell_record(cell, value).items()}
    for key, _ in getattr(cell, "partners", ()):
        if all(x.key != key for x, _ in asked):
            out.update(get(key).cell_record(cell, None))
    return out


def options() -> list["Extra"]:
    """The plug-ins that are engine options (Extra.option), in registry order."""
    return [x for x in registered() if x.option]


def _views() -> dict[str, tuple[str, str]]:
    """{view: (SQL, what it answers)} of every extra, in registry order. A name a core table or
    view has, or another extra's view, is refused: a plug-in never replaces what others read."""
    from analysis.sql import VIEWS
    from store import TABLES

    out: dict[str, tuple[str, str]] = {}
    owner: dict[str, str] = {}
    core = set(TABLES) - {name for x in registered() for name in x.tables()}
    for x in registered():
        for name, view in x.views().items():
            if name in VIEWS or name in core or name in out:
                taken = owner.get(name, "the core")
                raise ValueError(f"extra {x.key} ({x.target}) declares view {name}, which {taken} has already")
            out[name], owner[name] = view, f"extra {x.key}"
    return out


class _Provider:
    """What store and analysis, below this package, read of the plug-ins (common/plugins.py)."""

    installed = True

    def views(self) -> dict[str, tuple[str, str]]:
        return _views()

    def columns(self) -> list[tuple[str, object]]:
        from store.schema import CORE_TABLES

        out, owner = [], dict.fromkeys(CORE_TABLES["cells"].names, "the core")
        for x in registered():
            for name, kind, _ in x.cell_columns():
                if name in owner:
                    raise ValueError(f"extra {x.key} ({x.target}) declares cells column {name}, as {owner[name]} does")
                out.append((name, kind))
                owner[name] = f"extra {x.key}"
        return out

    def tables(self) -> dict[str, object]:
        from store.schema import CORE_TABLES

        out, owner = {}, dict.fromkeys(CORE_TABLES, "the core")
        for x in registered():
            for name, schema in x.tables().items():
                if name in owner:
                    raise ValueError(f"extra {x.key} ({x.target}) declares table {name}, as {owner[name]} does")
                out[name], owner[name] = schema, f"extra {x.key}"
        return out

    def name_words(self, cell_row: dict) -> list[str]:
        return [w for x in registered() for w in x.name_words(cell_row)]

    def option_word(self, key: str, value: Any) -> str | None:
        return next((x.label(value) for x in options() if x.key == key), None)

    def disclosures(self, cell_row: dict, ref_row: dict) -> dict:
        return {k: v for x in registered() for k, v in x.disclose(cell_row, ref_row).items()}


def _install() -> None:
    # store and analysis sit below this package and never import it: they read it through this provider
    from common import plugins

    plugins.provider = _Provider()


def require(stack_or_cell) -> None:
    """In a capturing process: every extra the cell asks for is installed here, or the cell fails
    naming it (an extra that is not found would otherwise be left out of the capture unsaid)."""
    asked = [k for k, v in dict(getattr(stack_or_cell, "extras", stack_or_cell)).items() if v is not None]
    missing = sorted(set(asked) - set(_targets()))
    if missing:
        raise RuntimeError(
            f"extra {', '.join(missing)} is not installed on {socket.gethostname()} "
            f"(no entry point of group {GROUP} names it): install its distribution on every node"
        )


def model_reports(data: dict, model: str, k: int) -> str:
    """Every extra's part of one model's section of the report (Extra.model_report), in registry order."""
    return "".join(x.model_report(data, model, k) for x in registered())


def side_tables(cell_row: dict) -> tuple[str, ...]:
    """The shard tables a done cell has beside its logits (for `matrix verify` and resume)."""
    return tuple(dict.fromkeys(x.table for x in registered() if x.table and x.active_in(cell_row)))


def analyses(skip_damaged: bool = False) -> list[tuple[str, Callable, Callable]]:
    """(name, analysis(wh, done, reference, force, log) -> summary or None, its one log line) for
    `matrix analyze`: each extra's own (skip_damaged: a damaged shard leaves its part out, saying
    so), then one pass over the d<repeat> file's paths of every extra that writes some (its
    decode_metrics table)."""

    def own(x):
        return lambda wh, done, reference, force, log: x.analyze(wh, done, reference, force, log, skip_damaged)

    out = [(x.key, own(x), x.analysis_line) for x in registered()]  # None from one with nothing to say
    rules = {p: r for x in registered() for p, r in x.path_rules().items()}
    if rules:
        from analysis.side_analysis import analyze_side

        def paths(wh, done, reference, force, log):
            if not any(r.active(c) for c in done for r in rules.values()):
                return None
            return analyze_side(wh, done, force, log, rules)

        out.append(
            (
                "decode",
                paths,
                lambda dc: (
                    f"decode metrics: {dc['cells']} cell(s), {dc['rows']} rows off the prefill path "
                    f"({dc['reused']} up to "
                    "date); the summary_by_path view compares them with the prefill"
                ),
            )
        )
    return out


_install()
