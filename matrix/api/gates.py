"""A cell or a stack held to its quant class's gates (configs/gates.yaml): `admit` against the
warehouse's reference, `layers` layer by layer, `fixture_check` against a fixture file. Each returns
a frozen verdict whose `to_dict()` is what the verb prints with `--json`; `ok` is its exit status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.errors import UserError
from common.output import log as stderr_log
from matrix.spec.corpus import CONFIGS

GATES = CONFIGS / "gates.yaml"


@dataclass(frozen=True)
class AdmitResult:
    """A cell against its reference: one row per gate (threshold, measured, pass, worst row)."""

    cell_id: str
    reference_cell_id: str
    quant_class: str
    gates_file: str
    rows: int
    gates: tuple[dict, ...]

    @property
    def ok(self) -> bool:
        return all(g["pass"] for g in self.gates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cell_id": self.cell_id,
            "reference_cell_id": self.reference_cell_id,
            "class": self.quant_class,
            "gates_file": self.gates_file,
            "rows": self.rows,
            "pass": self.ok,
            "gates": list(self.gates),
        }


@dataclass(frozen=True)
class LayersResult:
    """A `layers:` cell against its reference, layer by layer, and the first layer failing a gate."""

    cell_id: str
    reference_cell_id: str
    quant_class: str
    gates_file: str
    thresholds: dict  # cosine_min, norm_ratio_tol
    layers: tuple[dict, ...]
    verdict: dict  # analysis/layer_metrics.py verdict: pass, first_failing_layer, failed

    @property
    def ok(self) -> bool:
        return bool(self.verdict["pass"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "cell_id": self.cell_id,
            "reference_cell_id": self.reference_cell_id,
            "class": self.quant_class,
            "gates_file": self.gates_file,
            "gates": self.thresholds,
            "layers": list(self.layers),
            **self.verdict,
        }


@dataclass(frozen=True)
class FixtureCheckResult:
    """A stack run on a fixture's ids: its gates with the upper bound the fixture's top-k allows,
    what differs from the fixture's producer, and where it ran."""

    fixture: str
    engine: str
    model: str
    dtype: str
    quant_class: str
    rows: int
    truncation: dict
    gates: tuple[dict, ...]
    differences: tuple[dict, ...]
    header: dict  # the fixture's header (produced_by, k, vocab_size, header_checked)
    ran_on: dict

    @property
    def ok(self) -> bool:
        return all(g["pass"] for g in self.gates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixture": self.fixture,
            "engine": self.engine,
            "model": self.model,
            "dtype": self.dtype,
            "class": self.quant_class,
            "rows": self.rows,
            "pass": self.ok,
            "truncation": self.truncation,
            "gates": list(self.gates),
            "differences": list(self.differences),
            "header_checked": self.header["header_checked"],
            "ran_on": self.ran_on,
        }


def resolve_cell(warehouse: str, cell: str, what: str, cells: list[dict] | None = None) -> str:
    """A cell id, given as one or as (part of) a stack's readable name (analysis/stack_names.py);
    cells: the warehouse's cells rows where the caller has read them already."""
    from analysis.stack_names import resolve
    from store import Warehouse

    if cells is None:
        cells = Warehouse(warehouse).require().read_all("cells")
    return resolve(cells, cell, f"{what}: warehouse {warehouse}")


def admit(
    warehouse: str,
    cell: str,
    gates: str | None = None,
    quant_class: str | None = None,
    allow_tokenizer_mismatch: bool = False,
) -> AdmitResult:
    """cell: a cell id or a stack's name; gates: a gates file (default configs/gates.yaml);
    quant_class: the class to hold it to (default: from the cell's dtype)."""
    from analysis.gates import evaluate, load_gates, measured_from_warehouse, parity_gate, pick_class, worst_rows
    from analysis.sql import connect

    table = load_gates(str(gates or GATES))
    cell_id = resolve_cell(warehouse, cell, "admit")
    con = connect(warehouse)
    try:
        row = con.execute("SELECT dtype, status, tokenizer_parity FROM cells WHERE cell_id = ?", [cell_id]).fetchone()
        if row is None:
            raise UserError(f"admit: no cell {cell_id} in {warehouse}")
        measured, nonfinite, ref = measured_from_warehouse(con, cell_id)
        cls = pick_class(table, row[0], quant_class)
        rows = evaluate(measured, table["classes"][cls], nonfinite)
        rows.insert(1, parity_gate(row[2], allow_tokenizer_mismatch))
        worst_rows(con, cell_id, rows)
    finally:
        con.close()
    return AdmitResult(cell_id, ref, cls, table["path"], measured["rows"], tuple(rows))


def layers(warehouse: str, cell: str, gates: str | None = None, quant_class: str | None = None) -> LayersResult:
    """The per-layer table of a `layers:` cell against its reference and the first layer failing the
    cosine / norm-ratio gates of its class (the gates file must have a layers gate for it)."""
    from analysis.gates import load_gates, pick_class
    from analysis.layer_analysis import layer_table
    from analysis.layer_metrics import verdict
    from store import Warehouse

    wh = Warehouse(warehouse).require()
    cells = {c["cell_id"]: c for c in wh.read_all("cells")}
    cell_id = resolve_cell(warehouse, cell, "layers", list(cells.values()))
    table = load_gates(str(gates or GATES))
    cls = pick_class(table, cells[cell_id]["dtype"], quant_class)
    if cls not in table["layers"]:
        raise UserError(f"{table['path']}: layers: no gate for class {cls} (has: {', '.join(table['layers'])})")
    g = table["layers"][cls]
    rows, ref = layer_table(wh, cell_id)
    return LayersResult(
        cell_id, ref, cls, table["path"], g, tuple(rows), verdict(rows, g["cosine_min"], g["norm_ratio_tol"])
    )


def fixture_check(
    fixture: str,
    engine: str,
    model: str,
    dtype: str = "bf16",
    attention: str = "default",
    threads: int = 2,
    device: str = "cpu",
    address: str | None = None,
    gates: str | None = None,
    quant_class: str | None = None,
    allow_other_weights: bool = False,
    log: Callable[[str], None] | None = None,
) -> FixtureCheckResult:
    """Run the stack on the fixture's ids and gate it: in this process, or, given address or a device
    other than cpu, in a cell actor placed on the cluster the way `run` places one (a local cluster of
    this machine without address)."""
    from analysis.gates import evaluate, load_gates, pick_class
    from analysis.truncated import NOTE, gate_values

    table = load_gates(str(gates or GATES))  # a bad gates file fails before any model loads
    cls = pick_class(table, dtype, quant_class)
    res = _check(fixture, engine, model, dtype, attention, threads, device, address, log or stderr_log)
    measured, upper, tail = gate_values(res["metrics"])
    rows = evaluate(measured, table["classes"][cls], res["nonfinite"])
    rows.insert(1, _same_weights_gate(res, allow_other_weights))
    for r in rows:
        r["upper_bound"] = upper.get(r["gate"])
    header = res["header"]
    trunc = {"k": header["k"], "vocab_size": header["vocab_size"], **tail, "note": NOTE}
    return FixtureCheckResult(
        fixture,
        engine,
        model,
        dtype,
        cls,
        res["rows"],
        trunc,
        tuple(rows),
        tuple(res["differences"]),
        header,
        res["ran_on"],
    )


def _check(fixture, engine, model, dtype, attention, threads, device, address, log) -> dict:
    """check_fixture in this process, or on the cluster through a connection this call opens and
    closes (a caller's own connection is used as it is)."""
    from matrix.run.fixture_check import check_fixture

    if not address and device == "cpu":
        return check_fixture(fixture, engine, model, dtype, attention, threads, log=log)
    from matrix.run import cluster, placement

    owned = not cluster.connected()
    cluster.init_ray(address)
    try:
        nodes = placement.known_nodes(placement.cluster_nodes(), placement.default_cluster_config(address))
        return check_fixture(fixture, engine, model, dtype, attention, threads, log=log, device=device, nodes=nodes)
    finally:
        cluster.release(owned)


def _same_weights_gate(res: dict, allow_other_weights: bool) -> dict:
    """The gate row that says whether the stack was built from the weights the fixture was made from."""
    weights = next((d for d in res["differences"] if d["what"] in ("weights_sha256", "source_sha256")), None)
    return {
        "gate": "same_weights",
        "comparison": "==",
        "threshold": "the fixture's",
        "measured": f"other weights: {weights['stack']} (fixture: {weights['fixture']})" if weights else "same",
        "pass": weights is None or allow_other_weights,
        "meaning": "the stack is built from the weights the fixture was made from"
        + (" (other weights allowed)" if weights and allow_other_weights else ""),
    }
