"""The plug-in interface (extras/__init__.py documents it and keeps the registry): what one
extra declares (Extra), what runs inside a capture (Capturer), and the helpers extras share."""

from __future__ import annotations

import importlib
import json
from typing import Any, Callable, ClassVar, Mapping

from common.positions import next_ids
from store.cell_rows import CellRow


class Capturer:
    """One extra inside one capture: called with each prompt as its rows come out."""

    taps_forward: ClassVar[bool] = False  # True: forward() replaces the engine's plain forward

    def start(self, prompts: list[tuple[str, list[int]]], max_tokens: int | None) -> None:
        """Before the first prompt: every prompt of the capture (id, token ids) and its max_tokens."""

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
    column: ClassVar[str | None] = None  # the cells column (JSON) its record goes to (None: none)
    column_about: ClassVar[str] = ""  # what that column holds, for docs/warehouse.md
    hook: ClassVar[str | None] = None  # the engine method an engine implements to support it
    requires: ClassVar[tuple[str, ...]] = ()  # other engine methods its capture calls
    table: ClassVar[str | None] = None  # the shard table its rows go to (store/warehouse.py SHARD_FILES); None: none
    # An axis: one spec value is several cells (expand), and an include entry with another value adds
    # its own cells rather than changing the combination's
    sweeps: ClassVar[bool] = False
    # False: the cell records its rows alone (it takes no other extra, and a reference that has it
    # records none for the others)
    shares: ClassVar[bool] = True
    # An engine option: the value rides in the cell's options (the engine reads it by this key, and
    # the id hashes it among them), set where options are (`options:`, include entries, reference
    # selectors, candidates); `allowed`: its plain values, `default`: what a cell without it runs,
    # `schema_keys`: its mapping form's keys (matrix.spec.schema.Key), `flag`: `matrix kld`'s flag
    option: ClassVar[bool] = False
    title: ClassVar[str] = ""  # what it is in a few words, for labels and docs ("KV cache"; default: its key)
    allowed: ClassVar[tuple] = ()
    default: ClassVar[Any] = None
    schema_keys: ClassVar[tuple] = ()
    flag: ClassVar[str | None] = None
    # its default is the cell without the option (nothing set): a cell given the default has no option, one id
    plain_default: ClassVar[bool] = False
    flag_metavar: ClassVar[str] = "VALUE"
    flag_help: ClassVar[str] = ""
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

    def expand(self, value: Any) -> list[Any]:
        """The cells' values one spec value sweeps (`sweeps`); [value] for an extra that is no axis."""
        return [value]

    def partner(self, value: Any) -> Any:
        """Graded against a partner cell: the value this key has in the cell it is measured against
        (the rest of the stack the same); None: no partner (graded on its own paths, or not at all)."""
        return None

    def partner_elsewhere(self, combo: dict, opts: dict, reference: dict) -> tuple[dict, dict] | None:
        """Graded against the same stack on other hardware, whether or not the cell asks for the key:
        (the partner's axes, its options), e.g. a GPU cell's stack on the reference's CPU; None: no
        such partner. reference: the spec's `reference:` selector (its device and options, if named)."""
        return None

    def check(self, cell, value: Any, fail: Callable[[str, Any], Exception]) -> None:
        """A spec error the engine's limits make of the value (fail(msg, value) names the field)."""

    def node_refusal(self, value: Any, node: dict) -> str | None:
        """Why a node cannot run a cell of this value (node: its probe's answer, matrix/run/builds.py:
        host, cpu_flags, libraries); None: it can. The run places the cell on the nodes that can."""
        return None

    def sequences(self, value: Any) -> int:
        """How many sequences each of the cell's forwards holds (its capture's time budget scales by it)."""
        return 1

    def for_reference(self, values: list[Any]) -> Any:
        """What a model's reference records so every cell of the model has its yardstick (None: its own)."""
        return None

    def describe(self, value: Any) -> Any:
        """How `matrix cells --json` shows it."""
        return value

    # engines
    def unsupported(self, engine_cls, cell, value: Any) -> str | None:
        if not all(callable(getattr(engine_cls, m, None)) for m in (self.hook, *self.requires) if m):
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
    def capturer(self, backend, value: Any, writer) -> Capturer | None:
        """What runs inside each capture (None: nothing, e.g. an engine option the engine applies)."""
        return None

    def settings(self, backend, value: Any) -> dict[str, Any]:
        """Entries of the cell's engine settings this extra adds (recorded with the cell)."""
        return {}

    # the outcome
    def record(self, parts: list[dict]) -> str | None:
        """The cells column from each capture's summary (JSON)."""
        return None

    def cell_record(self, cell, value: Any) -> dict[str, Any]:
        """Cells columns it fills from the cell itself (its value, its partner's stack id)."""
        return {}

    def cell_columns(self) -> list[tuple[str, Any, str]]:
        """[(name, pyarrow type, what it holds)]: the cells columns it records, after the core's."""
        import pyarrow as pa

        return [(self.column, pa.string(), self.column_about)] if self.column else []

    def tables(self) -> dict[str, Any]:
        """{name: pyarrow schema} of its own tables (its graded metrics)."""
        return {}

    def active_in(self, cell_row: Mapping | CellRow) -> bool:
        """Whether a cells row (a dict as read, or a CellRow) recorded this extra."""
        return bool(self.column and cell_row.get(self.column))

    # analysis, card, report
    def analyze(
        self, wh, done: list[CellRow], reference: str | None, force: bool, log, skip_damaged: bool = False
    ) -> dict | None:
        """Its own analysis of the cells that recorded it (None: nothing to do); done: every captured
        cell, as records (store/cell_rows.py)."""
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

    def card(self, db, cell_row: dict) -> Any:
        """Its block of the cell's card, plain values (None or empty: no block). db: the card's
        DuckDB connection to the warehouse, every view bound (analysis.card.query_rows reads it)."""
        return None

    def card_lines(self, block: dict) -> list[str]:
        return []

    def report(self, data: dict) -> str:
        """Its section of the HTML report (data: analysis.report.gather)."""
        return ""

    def model_report(self, data: dict, model: str, k: int) -> str:
        """Its part of model `model`'s section of the report (k: the section's index, for element ids)."""
        return ""

    def label(self, value: Any) -> str:
        """An engine option's value in one word, as a stack name and `flag` show it."""
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))

    def from_flag(self, text: str, fail: Callable[[str], Exception]) -> Any:
        """`flag`'s text -> the option's value; None: the engine's default (the same cell as no flag)."""
        raise NotImplementedError

    def disclose(self, cell_row: dict, ref_row: dict) -> dict:
        """Its entries of a card's disclosure for a cell and its reference ({}: nothing to say)."""
        return {}

    def name_words(self, cell_row: dict) -> list[str]:
        """Its words in the readable name of a cells row's stack, e.g. `batch8` ([]: none)."""
        return []

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

    from store.prompt_rows import PromptRows

    nxt = next_ids(whole, positions)
    n = len(positions)
    both = np.concatenate([prefill, other.astype(prefill.dtype)])
    writer.add(
        PromptRows(prompt_id, positions + positions, nxt + nxt, both, None, ["prefill"] * n + [path] * n, steps * 2)
    )
    return agreement(prefill, other)


def agreement(a, b) -> tuple[int, float]:
    """Two (rows, vocab) arrays of the same native dtype: (rows byte-identical, max |a - b|)."""
    import numpy as np

    from store.values import widen

    n = len(a)
    same = (a.view(np.uint8).reshape(n, -1) == b.view(np.uint8).reshape(n, -1)).all(-1)
    return int(same.sum()), float(np.abs(widen(a) - widen(b)).max(initial=0.0))


class PartnerGraded(Extra):
    """A plug-in graded against a partner cell (batch, the KV cache). `grading` names its analysis
    module, which holds its Partnering (PARTNERING: table, partner column), its view (VIEW,
    VIEW_SQL, VIEW_ABOUT), the card's query (CARD_SQL, the card cell's id as its parameter) and
    card_lines; analysis/partner_drift.py measures the pairs."""

    grading: ClassVar[str]
    partner_about: ClassVar[str]  # what its partner column holds, for docs/warehouse.md

    def _module(self):
        return importlib.import_module(self.grading)

    def cell_columns(self) -> list[tuple[str, Any, str]]:
        import pyarrow as pa

        return [(self._module().PARTNERING.column, pa.string(), self.partner_about)]

    def cell_record(self, cell, value: Any) -> dict[str, Any]:
        return {self._module().PARTNERING.column: cell.partner_of(self.key)}

    def tables(self) -> dict[str, Any]:
        from store.schema import METRICS

        return {self._module().PARTNERING.table: METRICS}

    def active_in(self, cell_row: Mapping | CellRow) -> bool:
        return cell_row.get(self._module().PARTNERING.column) is not None

    def side_rows(self, value: Any, fed_positions, prompt_lengths) -> tuple[int, bool]:
        return 0, True  # its rows are the cell's own logits

    def analyze(self, wh, done, reference, force, log, skip_damaged: bool = False) -> dict | None:
        from analysis import partner_drift

        return partner_drift.analyze(self._module().PARTNERING, wh, done, force, log, skip_damaged)

    def analysis_line(self, got: dict) -> str:
        from analysis import partner_drift

        return partner_drift.line(self._module().PARTNERING, got)

    def views(self) -> dict[str, tuple[str, str]]:
        g = self._module()
        return {g.VIEW: (g.VIEW_SQL, g.VIEW_ABOUT)}

    def card(self, db, cell_row: dict) -> list[dict]:
        from analysis.card import query_rows

        return query_rows(db, self._module().CARD_SQL, [cell_row["cell_id"]])

    def card_lines(self, block: list[dict]) -> list[str]:
        return self._module().card_lines(block)
