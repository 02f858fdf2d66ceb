"""Each model's reference cell: the stack the spec's `reference:` picks, and what it records so
that every cell of its model has its yardstick (matrix/spec/cells.py expand calls these)."""

from __future__ import annotations

import dataclasses

import extras
from common import ids, names
from common.stack import Cell
from matrix.spec.parse import Spec, field_error


def references(spec: Spec, cells: list[Cell], skipped: list[dict]) -> dict[str, str]:
    """model -> the stack id of the cell the spec's `reference:` picks for it."""
    if not spec.reference:
        return {}
    refs = {}
    for model in spec.models:
        sel = {"model": model, **spec.reference}
        if sel["model"] != model:
            continue
        hits = [
            c
            for c in cells
            if c.replica == 0
            and c.artifact is None  # a candidate is never the reference
            and all((getattr(c, k) if k in names.CELL_AXES else _option(c, k)) == v for k, v in sel.items())
        ]
        missed = [s for s in skipped if all(s.get(k) == v for k, v in sel.items())]
        if not hits and missed:
            raise field_error(
                spec.path, "reference", f"the reference stack cannot run: {missed[0]['reason']}", spec.reference
            )
        if len(hits) > 1 and len({_unswept(c) for c in hits}) == 1:
            # one stack at several values of a sweeping extra (batch sizes): the cell without it,
            # else the one that is its own partner (batch 1)
            hits = [c for c in hits if not _swept(c)] or [c for c in hits if _own_partner(c)] or hits
        if len(hits) > 1:
            raise field_error(
                spec.path,
                "reference",
                "matches several cells (" + ", ".join(c.stack_id for c in hits) + "); add keys to pick one",
                spec.reference,
            )
        if hits:
            refs[model] = hits[0].stack_id
    if not refs:
        raise field_error(spec.path, "reference", "matches no cell of the sweep", spec.reference)
    return refs


def _swept(c: Cell) -> list:
    return [(x, v) for x, v in extras.of(c) if x.sweeps]


def _unswept(c: Cell) -> str:
    """A cell's stack, its sweeping extras left out: what the cells of one stack at several of their values share."""
    return repr(c.with_stack(extras=tuple((k, v) for k, v in c.extras if not extras.get(k).sweeps)).stack)


def _own_partner(c: Cell) -> bool:
    """Whether the cell is its own partner (batch 1): the same id part as the value it is graded against."""
    return all(x.id_part(x.partner(v)) == x.id_part(v) for x, v in _swept(c))


def reference_extras(spec: Spec, corpus_fp: str, cells: list[Cell], refs: dict[str, str], make_cell_id):
    """A model's reference records every extra row any of its cells asks for (Extra.for_reference),
    so each has its yardstick; the reference's id then says so (it is another
    capture than the plain reference's). A reference engine without the extra keeps its own
    (analysis says so per cell). -> (cells, refs), new lists."""
    from backends import backend_class

    cells, refs = list(cells), dict(refs)
    for model, ref_id in list(refs.items()):
        ref = next(c for c in cells if c.stack_id == ref_id)
        if any(not x.shares for x, _ in extras.of(ref)):  # it records its rows alone (a batch cell)
            continue
        cls = backend_class(ref.engine)
        want = dict(ref.extras)
        for x in extras.cell_extras():
            union = x.for_reference([c.extra(x.key) for c in cells if c.model == model])
            if union is not None and cls is not None and x.unsupported(cls, ref, union) is None:
                want[x.key] = union
        want = tuple(sorted(want.items()))
        if want == ref.extras:
            continue
        combo = {
            **ref.axes(),
            "threads": ref.threads,
            "max_tokens": ref.max_tokens,
            **{k: None for k in extras.keys()},
            **dict(want),
        }
        for i, c in enumerate(cells):  # the reference stack and its replicas
            if ids.split_cell_id(c.stack_id)[0] == ref.stack_id:
                cid = make_cell_id(spec, combo, ref.opts, corpus_fp, c.replica)
                cells[i] = dataclasses.replace(c.with_stack(extras=want), stack_id=cid)
        refs[model] = make_cell_id(spec, combo, ref.opts, corpus_fp)
    return cells, refs


def _option(cell, key: str):
    """A cell's engine option as a selector names it: a plug-in's default that is the cell without
    the option (Extra.plain_default) where the cell has none."""
    if key in cell.opts:
        return cell.opts[key]
    x = extras.get(key) if key in {o.key for o in extras.options()} else None
    return x.default if x is not None and x.plain_default else None
