"""What a sweep is made of: a Cell (one stack as the spec names it) and a StackDesc (what a
backend is given to build and run that stack). Both live here, below spec and backends alike,
so neither has to import the other's package to name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import ids, names


@dataclass(frozen=True)
class Cell:
    """One stack: a model run by one engine at one dtype / attention / TP / device."""

    model: str
    engine: str
    dtype: str
    attention: str
    tp: int
    device: str
    threads: int | None
    stack_id: ids.StackId  # the stack as the spec names it (common/ids.py)
    # Feed only a prefix of each prompt (for slow stacks). Causal attention makes the
    # rows it keeps identical in meaning to the full run's rows at the same positions.
    max_tokens: int | None = None
    options: tuple = ()  # sorted (key, value) pairs the engine takes
    # The per-cell extras it asks for (extras/): sorted (key, value) pairs, values as the extra's
    # parser gives them; the plan resolves them against the model (Extra.resolve)
    extras: tuple = ()
    # Analysis only (not in the cell id): whose centroid this stack joins. None: its model's.
    centroid_group: str | None = None
    calibration: str | None = None  # declared in the spec; model cards disclose it
    # `replicas: N`: copy i of the stack, each on its own node (0: the stack itself)
    replica: int = 0
    # Set when the run binds the stack to a node's engine build (matrix/run/builds.py), or to the
    # build of an earlier capture it reuses; None before, or for a capture that recorded none.
    build: str | None = None
    pin: tuple[str, ...] = ()  # Ray node ids the cell may run on (empty: any that fits)
    # `candidates:` a published file measured as it is, against the model's reference: its path on
    # the driver and its sha256 (the cell id hashes it), and the spec's label for it
    artifact: str | None = None
    artifact_sha256: str | None = None
    label: str | None = None

    @property
    def cell_id(self) -> ids.CellId | ids.StackId:
        """What the warehouse calls it: stack@build once bound to a build, the stack id before."""
        return ids.cell_id(self.stack_id, self.build) if self.build else self.stack_id

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def extra(self, key: str) -> Any:
        """The value of one per-cell extra (None: the cell does not ask for it)."""
        return dict(self.extras).get(key)

    def axes(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in names.CELL_AXES}


@dataclass(frozen=True)
class StackDesc:
    """The typed input of every backend: one cell's coordinates, engine options and where its
    reference weights came from. Built by matrix.spec.cells.stack_desc (tests build their own);
    frozen and plain, it is pickled into the cell's Ray actor as it is."""

    engine: str
    dtype: str
    attention: str
    device: str = "cpu"
    tp: int = 1
    model: str = ""
    cell_id: str = ""
    options: tuple = ()  # sorted (key, value) pairs, as Cell.options
    max_tokens: int | None = None
    extras: tuple = ()  # sorted (key, value) of the per-cell extras each capture records (Cell.extras)
    extra_targets: tuple = ()  # "key=module:Class" of those not built in (extras.targets)
    weights_sha256: str | None = None  # of the reference checkpoint the engine's weights are built from
    source_gguf: str | None = None  # the GGUF the reference weights were dequantised from, if any
    source_quant: str | None = None  # its quant type: a cell of that dtype runs the file itself
    build: str | None = None  # the engine build the driver bound the cell to (common/builds.py)
    artifact: str | None = None  # a published file to run as it is (`candidates:`), on this node
    artifact_sha256: str | None = None
    artifact_source: str | None = None  # where it came from: the driver's path, or the model's source
    # `imatrix:` the calibration text itself (a node may not have the driver's file; text is small)
    calibration_text: str | None = None

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def extra(self, key: str) -> Any:
        return dict(self.extras).get(key)


@dataclass(frozen=True)
class ModelCopy:
    """What a node needs to get a cell's reference weights: the driver's paths and the hashes the
    driver recorded. The node uses its own copy only when the hashes match, else it is sent one."""

    name: str
    hf_dir: str  # on the driver (a hub id when weights_sha256 is None)
    weights_sha256: str | None  # of the safetensors files (common.files.weights_digest)
    source_gguf: str | None = None  # the GGUF the weights were dequantised from, on the driver
    source_sha256: str | None = None
