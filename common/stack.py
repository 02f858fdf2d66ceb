"""What a sweep is made of: a StackDesc (what a backend is given to build and run one stack) and
the Cell that holds it (the stack as the spec names it, plus what the run and the analysis need).
Both live here, below spec and backends alike, so neither has to import the other's package."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from common import ids, names


@dataclass(frozen=True)
class Settings:
    """What makes the stack: the coordinates, engine options, plug-ins and the file it measures.
    Two stacks of equal settings compute the same thing (their ids, common/ids.py, agree)."""

    engine: str
    dtype: str
    attention: str
    device: str = "cpu"
    tp: int = 1
    model: str = ""
    options: tuple = ()  # sorted (key, value) pairs the engine takes
    # Feed only a prefix of each prompt (for slow stacks). Causal attention makes the rows it keeps
    # identical in meaning to the full run's rows at the same positions.
    max_tokens: int | None = None
    # The plug-ins it asks for (extras/), e.g. `batch`, `decode`: sorted (key, value) pairs, values as
    # the plug-in's parser gives them; the plan resolves them against the model (Extra.resolve)
    extras: tuple = ()
    # `candidates:` a published file measured as it is: its sha256 (the cell id hashes it)
    artifact_sha256: str | None = None


@dataclass(frozen=True)
class Source:
    """Where the stack's weights come from on the machine that holds it: the same settings may read
    other paths on another node (matrix.spec.cells.stack_desc sets them on the driver, the actor its own)."""

    weights_sha256: str | None = None  # of the reference checkpoint the engine's weights are built from
    source_gguf: str | None = None  # the GGUF the reference weights were dequantised from, if any
    source_quant: str | None = None  # its quant type: a cell of that dtype runs the file itself
    artifact: str | None = None  # `candidates:` the published file's path (on the driver, then on this node)
    artifact_source: str | None = None  # where it came from: the driver's path, or the model's source
    # `imatrix:` the calibration text itself (a node may not have the driver's file; text is small)
    calibration_text: str | None = None


@dataclass(frozen=True)
class Build:
    """The engine build the run bound the stack to (common/builds.py), or the build of an earlier
    capture it reuses (None before, or for a capture that recorded none), and the cell id that makes."""

    build: str | None = None
    cell_id: str = ""  # set when the run hands the stack to its backend (matrix.spec.cells.stack_desc)


_PARTS = {"settings": Settings, "source": Source, "bound": Build}
_FIELD_PART = {f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class StackDesc:
    """The typed input of every backend: its settings (what makes the id), its source (where the
    weights came from) and its build. Built by matrix.spec.cells.stack_desc (tests build their own
    with `of`); frozen and plain, it is pickled into the cell's Ray actor as it is. Each part's
    fields read through (`stack.dtype`, `stack.weights_sha256`, `stack.build`)."""

    settings: Settings
    source: Source = Source()
    bound: Build = Build()

    @classmethod
    def of(cls, engine: str, dtype: str, attention: str, device: str = "cpu", tp: int = 1, model: str = "", **rest):
        """A stack from its fields, each put in its part (an unknown name is a TypeError)."""
        return cls(Settings(engine, dtype, attention, device, tp, model)).replace(**rest)

    def replace(self, **changes: Any) -> StackDesc:
        """This stack with some fields changed, whichever part holds each."""
        parts: dict[str, dict] = {}
        for name, value in changes.items():
            if name not in _FIELD_PART:
                raise TypeError(f"StackDesc has no field {name!r}")
            parts.setdefault(_FIELD_PART[name], {})[name] = value
        return dataclasses.replace(
            self, **{part: dataclasses.replace(getattr(self, part), **kw) for part, kw in parts.items()}
        )

    def __getattr__(self, name: str) -> Any:
        # only for names that are no attribute of the stack itself: a field of one of its parts
        part = _FIELD_PART.get(name)
        if part is None:
            raise AttributeError(f"StackDesc has no field {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.settings.options)

    def extra(self, key: str) -> Any:
        return dict(self.settings.extras).get(key)


@dataclass(frozen=True)
class Cell:
    """One stack of a sweep: what its backend is given (`stack`), the id the spec names it by, and
    what only the run and the analysis need (threads, its node pins, its centroid group...).

    The coordinates (model, engine, dtype, ...) live in `stack` alone; the properties below read
    them there. A cell is bound to an engine build by the run (`bound`): only then has it a cell id."""

    stack: StackDesc
    stack_id: ids.StackId  # the stack as the spec names it (common/ids.py)
    threads: int | None = None
    # Analysis only (not in the cell id): whose centroid this stack joins. None: its model's.
    centroid_group: str | None = None
    calibration: str | None = None  # declared in the spec; model cards disclose it
    # `replicas: N`: copy i of the stack, each on its own node (0: the stack itself)
    replica: int = 0
    pin: tuple[str, ...] = ()  # Ray node ids the cell may run on (empty: any that fits)
    label: str | None = None  # `candidates:` the spec's label for a published file
    # graded against partner cells (extras.Extra.partner): sorted (plug-in key, the partner's stack id);
    # while the spec is expanded, each key's candidate stack ids in order (matrix/spec/cells.py _settle)
    partners: tuple = ()
    is_bound: bool = False  # set by bound(): the run chose the engine build that captures it

    @property
    def cell_id(self) -> ids.CellId:
        """What the warehouse calls it: stack@build (a capture that recorded no build: the stack id).
        Only a cell the run bound to a build has one (`bound`)."""
        if not self.is_bound:
            raise ValueError(f"{self.stack_id} is not bound to an engine build yet: it has a stack id only")
        return ids.cell_id(self.stack_id, self.stack.build) if self.stack.build else ids.CellId(self.stack_id)

    def bound(self, build: str | None, pin: tuple[str, ...] | None = None) -> Cell:
        """This cell as captured by `build` (None: a capture that recorded no build), on the nodes
        `pin` names when given."""
        stack = self.stack.replace(build=build)
        return dataclasses.replace(self, stack=stack, is_bound=True, pin=self.pin if pin is None else pin)

    def with_stack(self, **changes: Any) -> Cell:
        """This cell with some of its stack's fields changed (its extras resolved, its file hashed...)."""
        return dataclasses.replace(self, stack=self.stack.replace(**changes))

    # the stack's coordinates, read where they live
    model = property(lambda self: self.stack.model)
    engine = property(lambda self: self.stack.engine)
    dtype = property(lambda self: self.stack.dtype)
    attention = property(lambda self: self.stack.attention)
    tp = property(lambda self: self.stack.tp)
    device = property(lambda self: self.stack.device)
    max_tokens = property(lambda self: self.stack.max_tokens)
    options = property(lambda self: self.stack.options)
    extras = property(lambda self: self.stack.extras)
    build = property(lambda self: self.stack.build)
    artifact = property(lambda self: self.stack.artifact)
    artifact_sha256 = property(lambda self: self.stack.artifact_sha256)

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.stack.options)

    def extra(self, key: str) -> Any:
        """The value of one per-cell extra (None: the cell does not ask for it)."""
        return self.stack.extra(key)

    def partner_of(self, key: str) -> ids.StackId | None:
        """The stack id of the cell that plug-in `key` grades this one against (None: none)."""
        return dict(self.partners).get(key)

    def axes(self) -> dict[str, Any]:
        return {k: getattr(self.stack.settings, k) for k in names.CELL_AXES}


@dataclass(frozen=True)
class ModelCopy:
    """What a node needs to get a cell's reference weights: the driver's paths and the hashes the
    driver recorded. The node uses its own copy only when the hashes match, else it is sent one."""

    name: str
    hf_dir: str  # on the driver (a hub id when weights_sha256 is None)
    weights_sha256: str | None  # of the safetensors files (common.files.weights_digest)
    source_gguf: str | None = None  # the GGUF the weights were dequantised from, on the driver
    source_sha256: str | None = None
