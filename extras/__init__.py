"""Per-cell extras: what a cell records beside its rows, each in one module of this package.

An extra is a spec key whose value rides on the cell (`Cell.extras`, `StackDesc.extras`) and is
part of its id; each module of this package holds one and names its class in `EXTRA`. Its
module declares all the core needs:

    key, parse            the spec key and its parser (None: off for that cell)
    about, json_schema    the key's line and JSON Schema in the spec reference
    hook                  the engine method that supports it: an engine implements it, no flag elsewhere
    table, paths          the side table its rows go to (layer_states, or the d<repeat> file with a path per row)
    resolve, side_rows    its checks against the model at plan time; its side rows per repeat
    capturer              what runs beside each prompt's forward in the capturing process
    record                its part of the cells row (the column named `column`), from each capture's manifest
    analysis, card        its metrics in `matrix analyze`, its block of the model card, its report section
    views                 the SQL views that grade it (created after the core's: analysis.sql.all_views)

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
import json
import pkgutil
import socket
from importlib.metadata import entry_points
from typing import Any, Callable, ClassVar

from common.positions import next_ids

GROUP = "logit_matrix.extras"


@functools.lru_cache(maxsize=1)
def _builtin() -> dict[str, str]:
    """key -> "extras.module:Class" of every module of this package, in the order the modules run
    (their `rank`: the order of a cell's extras in its row, card and report)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
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
    return tuple(x.key for x in registered())


def of(asking) -> list[tuple["Extra", Any]]:
    """(extra, value) for each extra a Cell, a StackDesc or a (key, value) tuple asks for, in registry order."""
    asked = dict(getattr(asking, "extras", asking))
    return [(x, asked[x.key]) for x in registered() if asked.get(x.key) is not None]


def _views() -> dict[str, tuple[str, str]]:
    """{view: (SQL, what it answers)} of every extra, in registry order. A name a core table or
    view has, or another extra's view, is refused: a plug-in never replaces what others read."""
    from analysis.sql import VIEWS
    from store import TABLES

    out: dict[str, tuple[str, str]] = {}
    owner: dict[str, str] = {}
    for x in registered():
        for name, view in x.views().items():
            if name in VIEWS or name in TABLES or name in out:
                taken = owner.get(name, "the core")
                raise ValueError(f"extra {x.key} ({x.target}) declares view {name}, which {taken} has already")
            out[name], owner[name] = view, f"extra {x.key}"
    return out


def _install_views() -> None:
    # analysis sits below this package and never imports it: the views reach it through this provider
    from common import plugin_views

    plugin_views.provider = _views


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


def side_tables(cell_row: dict) -> tuple[str, ...]:
    """The shard tables a done cell has beside its logits (for `matrix verify` and resume)."""
    return tuple(dict.fromkeys(x.table for x in registered() if x.active_in(cell_row)))


def analyses() -> list[tuple[str, Callable, Callable]]:
    """(name, analysis(wh, done, reference, force, log) -> summary or None, its one log line) for
    `matrix analyze`: each extra's own, then one pass over the d<repeat> file's paths of every extra
    that writes some (its decode_metrics table)."""
    out = [(x.key, x.analyze, x.analysis_line) for x in registered()]  # None from one with nothing to say
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


class Capturer:
    """One extra inside one capture: called with each prompt as its rows come out."""

    taps_forward: ClassVar[bool] = False  # True: forward() replaces the engine's plain forward

    def forward(self, prompt_id: str, fed: list[int], positions: list[int]):
        raise NotImplementedError

    def after(self, prompt_id: str, whole: list[int], fed: list[int], positions: list[int], rows) -> None:
        """rows: (len(positions), vocab), the prompt's captured rows in the engine's native dtype."""

    def other_rank(self, fed: list[int], positions: list[int]) -> None:
        """On a tp > 1 cell's other ranks: join what rank 0 runs collectively (default: nothing)."""

    def summary(self) -> dict[str, Any] | None:
        """Its part of the capture's manifest (plain values: it travels back from an actor)."""
        return None


class Extra:
    """One per-cell extra. Subclasses set the class attributes and override what they record."""

    key: ClassVar[str]
    column: ClassVar[str | None] = None  # the cells column its record goes to (None: none)
    hook: ClassVar[str]  # the engine method an engine implements to support it
    requires: ClassVar[tuple[str, ...]] = ()  # other engine methods its capture calls
    table: ClassVar[str]  # the shard table its rows go to (store/warehouse.py SHARD_FILES)
    paths: ClassVar[tuple[str, ...]] = ()  # the d<repeat> file paths it writes beside 'prefill'
    rank: ClassVar[int] = 50  # where it comes among the built-in extras: rows, card blocks, report (low first)
    order: ClassVar[int] = 50  # where its capturer runs among the others (low first)
    tp1_only: ClassVar[str | None] = None  # why it runs at tp 1 only, when it does
    missing: ClassVar[str] = "engine {engine} cannot record it (the cell asks for {key})"  # no hook
    about: ClassVar[str] = ""  # its spec key in a line, for the spec reference (matrix/spec/schema.py)
    json_schema: ClassVar[dict] = {}  # its spec value as JSON Schema, for `matrix spec --schema`
    target = ""

    # the spec
    def parse(self, value: Any, fail: Callable[..., Exception]) -> Any:
        """The spec value -> a hashable value (None: off). fail(msg, value) makes the one-line error."""
        raise NotImplementedError

    def id_part(self, value: Any) -> Any:
        """What the cell id hashes of it (the value itself by default)."""
        return value

    def for_reference(self, values: list[Any]) -> Any:
        """What a model's reference records so every cell of the model has its yardstick (None: its own)."""
        return None

    def describe(self, value: Any) -> Any:
        """How `matrix cells --json` shows it."""
        return value

    # engines
    def unsupported(self, engine_cls, cell, value: Any) -> str | None:
        if not all(callable(getattr(engine_cls, m, None)) for m in (self.hook, *self.requires)):
            return self.missing.format(engine=engine_cls.engine, key=self.key)
        if self.tp1_only and cell.tp > 1:
            return self.tp1_only
        return None

    # the plan
    def resolve(self, value: Any, cell, facts: dict, prompts: list, fail: Callable[[str], Exception]) -> Any:
        """Checked against the model (facts: depth, hidden) and its prompts before anything runs."""
        return value

    def side_rows(self, value: Any, fed_positions: list[list[int]], prompt_lengths: list[int]) -> tuple[int, bool]:
        """Rows one repeat adds to its side table, and whether that count is exact."""
        raise NotImplementedError

    # the capture
    def capturer(self, backend, value: Any, writer) -> Capturer:
        raise NotImplementedError

    def settings(self, backend, value: Any) -> dict[str, Any]:
        """Entries of the cell's engine settings this extra adds (recorded with the cell)."""
        return {}

    # the outcome
    def record(self, parts: list[dict]) -> str | None:
        """The cells column from each capture's summary (JSON)."""
        return None

    def active_in(self, cell_row: dict) -> bool:
        """Whether a cells row recorded this extra."""
        return bool(self.column and cell_row.get(self.column))

    # analysis, card, report
    def analyze(self, wh, done: list[dict], reference: str | None, force: bool, log) -> dict | None:
        """Its own analysis of the cells that recorded it (None: nothing to do)."""
        return None

    def analysis_line(self, part: dict) -> str:
        return f"{self.key}: {part}"

    def path_rules(self) -> dict:
        """{path: analysis.side_analysis.PathRule} for each side-file path it writes."""
        return {}

    def views(self) -> dict[str, tuple[str, str]]:
        """{view: (SQL, what it answers in one line)}: its graded views, aggregates through
        analysis.aggregates.agg; `matrix sql`, the card and the report read them as the core's."""
        return {}

    def card(self, warehouse: str, cell_row: dict) -> dict | None:
        return None

    def card_lines(self, block: dict) -> list[str]:
        return []

    def report(self, data: dict) -> str:
        """Its section of the HTML report (data: analysis.report.gather)."""
        return ""

    def brief(self, value: Any) -> list[str]:
        """Words for `matrix cells`' table (value: describe()'s)."""
        return []


def loads(text: str | None) -> dict:
    return json.loads(text) if text else {}


def add_pairs(
    writer, prompt_id: str, whole: list[int], positions: list[int], prefill, other, path: str, steps: list[int]
) -> tuple[int, float]:
    """Each row `other` recomputed at `positions` into a side file beside the same position's prefill
    row (path 'prefill'), both with the whole prompt's next token; steps: each pair's step.
    -> agreement(prefill, other): (rows byte-identical, max |prefill - other|)."""
    import numpy as np

    nxt = next_ids(whole, positions)
    n = len(positions)
    writer.add(
        prompt_id,
        positions + positions,
        nxt + nxt,
        np.concatenate([prefill, other.astype(prefill.dtype)]),
        None,
        ["prefill"] * n + [path] * n,
        steps * 2,
    )
    return agreement(prefill, other)


def agreement(a, b) -> tuple[int, float]:
    """Two (rows, vocab) arrays of the same native dtype: (rows byte-identical, max |a - b|)."""
    import numpy as np

    from store.values import widen

    n = len(a)
    same = (a.view(np.uint8).reshape(n, -1) == b.view(np.uint8).reshape(n, -1)).all(-1)
    return int(same.sum()), float(np.abs(widen(a) - widen(b)).max(initial=0.0))


_install_views()
