"""A spec's matrix expanded into cells (GitHub Actions semantics), with their ids and the
typed description each cell's backend is given. `load_spec` is parse (parse.py) + expand."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import extras
from common import ids, names
from common.errors import UserError
from common.stack import Cell, ModelCopy, StackDesc
from matrix.spec.calibration import option_identity
from matrix.spec.parse import OPTION_KEYS, Spec, field_error, parse_spec
from matrix.spec.references import reference_extras, references


@dataclass(frozen=True)
class Matrix:
    """A spec expanded: every runnable cell (unbound: each has a stack id, no cell id yet), the
    combinations it cannot run with the reason, and each model's reference stack."""

    spec: Spec
    cells: tuple[Cell, ...]
    skipped: tuple[dict, ...] = ()  # {axes..., "stack_id": the combination's stack id, "reason": ...}
    reference_stacks: dict[str, ids.StackId] = field(default_factory=dict)  # model -> its reference (replica 0)


def load_spec(spec_path: str | os.PathLike) -> Matrix:
    """Parse and validate a spec file, then expand it into cells."""
    return expand(parse_spec(spec_path))


def stack_desc(cell: Cell, model) -> StackDesc:
    """What the cell's backend is given: its stack, with what the run resolved for its model
    (model: matrix.spec.models.ResolvedModel)."""
    return cell.stack.replace(
        cell_id=cell.cell_id if cell.is_bound else "",  # a stack not bound yet (an engine-build probe) has none
        weights_sha256=model.weights_sha256,
        source_gguf=model.gguf_path,
        source_quant=model.gguf_quant,
        calibration_text=_calibration_text(cell),
        **_artifact(cell, model),
    )


def _calibration_text(cell: Cell) -> str | None:
    """An imatrix cell's calibration text, read on the driver and checked against the hash its id holds."""
    im = cell.opts.get("imatrix")
    if not im:
        return None
    from common.files import sha256_file

    if sha256_file(im["path"]) != im["sha256"]:
        raise UserError(f"{im['path']}: the calibration text changed since the spec was read (sha256 {im['sha256']})")
    with open(im["path"], encoding="utf-8") as f:
        return f.read()


def _artifact(cell: Cell, model) -> dict:
    """A candidate's file for its backend (`gguf: source`: the file the model came from)."""
    if cell.artifact is None:
        return {}
    from matrix.spec.candidates import file_of

    return dict(zip(("artifact", "artifact_sha256", "artifact_source"), file_of(cell, model)))


def model_copy(model) -> ModelCopy:
    """What a node is told about the cell's reference weights (model: matrix.spec.models.ResolvedModel)."""
    return ModelCopy(
        model.name,
        model.hf_dir,
        model.weights_sha256,
        model.gguf_path,
        model.source_sha256 if model.gguf_path else None,
    )


def _combos(spec: Spec) -> list[dict]:
    """GitHub Actions matrix semantics: product, minus exclude, plus include."""
    keys = list(names.CELL_AXES)
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(spec.axes[k] for k in keys))]
    combos = [c for c in combos if not any(all(c.get(k) == v for k, v in ex.items()) for ex in spec.exclude)]
    originals = [dict(c) for c in combos]  # the product's combinations only: as in GitHub Actions,
    for i, inc in enumerate(spec.include):  # an include never extends one an earlier include created
        added = False
        for c, orig in zip(combos, originals):
            # Extend a combination when no key overwrites one of its original values (a sweeping
            # extra counts as an axis whose value is the spec's: an entry with another adds its own cells).
            if all(orig.get(k, v) == v for k, v in inc.items() if k in names.CELL_AXES) and all(
                inc.get(x.key, spec.extras.get(x.key)) == spec.extras.get(x.key) for x in _sweeping()
            ):
                c.update(inc)
                added = True
        if not added:
            new = dict(inc, _include=i)  # a combination the spec asked for by name
            for k in keys:
                if k not in new:
                    if len(spec.axes[k]) != 1:
                        raise field_error(
                            spec.path,
                            f"include[{i}].{k}",
                            "a new combination must name this axis (it has several values)",
                        )
                    new[k] = spec.axes[k][0]
            combos.append(new)
    return combos


def corpus_fingerprint(spec: Spec) -> str:
    """Every file the corpus names, hashed in chunks (a `vocab:` GGUF can be a whole model)."""
    from common.files import file_sha256
    from matrix.spec.corpus import corpus_files

    h = hashlib.sha256()
    for f in corpus_files(spec.corpus):
        h.update(f.name.encode() + b"\0" + bytes.fromhex(file_sha256(f)) + b"\0")
    return h.hexdigest()


def cell_options(spec: Spec, combo: dict) -> tuple[dict, list[str]]:
    """Options for this cell's engine: spec defaults the engine takes, plus include overrides.

    Returns (options, explicit options the engine does not take)."""
    from backends import backend_class

    cls = backend_class(combo["engine"])
    takes = getattr(cls, "options", frozenset()) if cls else frozenset()
    opts = {k: v for k, v in spec.options.items() if k in takes}
    foreign = []
    for k in OPTION_KEYS:
        if k in combo:
            if k in takes:
                opts[k] = combo[k]
            else:
                foreign.append(k)
    return dict(sorted(opts.items())), foreign


def option_sets(spec: Spec, combo: dict) -> list[tuple[dict, list[str]]]:
    """cell_options for each value of the options the spec lists several values of (an option axis,
    in the spec's order): one set per value for an engine that takes the option and whose
    combination does not set it itself, else the one set."""
    opts, foreign = cell_options(spec, combo)
    axes = [k for k, v in opts.items() if isinstance(v, list)]
    if not axes:
        return [(_plain(opts), foreign)]
    return [
        (_plain(dict(sorted({**opts, **dict(zip(axes, values))}.items()))), foreign)
        for values in itertools.product(*(opts[k] for k in axes))
    ]


def _plain(opts: dict) -> dict:
    """opts without the plug-in options at a default that is the cell without them (Extra.plain_default:
    cpu_path native sets no switch), so both spellings are one stack."""
    plain = {x.key for x in extras.options() if x.plain_default and opts.get(x.key) == x.default}
    return {k: v for k, v in opts.items() if k not in plain} if plain else opts


def make_cell_id(
    spec: Spec, combo: dict, opts: dict, corpus_fp: str, replica: int = 0, extra: dict | None = None
) -> str:
    """Stable id: readable coordinates plus a hash of everything that changes the rows (extra:
    what else does, e.g. a candidate's file)."""
    key = {
        **(extra or {}),
        **{k: combo[k] for k in names.CELL_AXES},
        "model": spec.models[combo["model"]].identity,
        "threads": combo.get("threads", spec.threads),
        "stride": spec.stride,
        "bos": spec.bos,
        "corpus": corpus_fp,
    }
    if opts:  # only when set, so cells without options keep their ids
        key["options"] = option_identity(opts)
    if _runs_gguf_file(spec, combo):  # not a conversion of the dequantised weights: another capture
        key["runs"] = "the model's GGUF file"
    if spec.store != "native":  # lossy storage is another row content
        key["store"] = spec.store
    if not spec.positions.is_plain:  # only then, so cells captured at a plain stride keep their ids
        key["positions"] = spec.positions.to_dict()
    if combo.get("max_tokens", spec.max_tokens):
        key["max_tokens"] = combo.get("max_tokens", spec.max_tokens)
    for x, value in extras.of(cell_extras(spec, combo)):  # the cell records more: another capture
        key[x.key] = x.id_part(value)
    return ids.stack_id(combo, key, replica)


def _runs_gguf_file(spec: Spec, combo: dict) -> bool:
    """A cell of a GGUF-file model's own quant type, on an engine that runs GGUF files, runs that file as it is."""
    import backends
    from backends.base import GGUF

    ref = spec.models[combo["model"]]
    if ref.kind != "gguf" or combo["engine"] not in backends.running(GGUF):
        return False
    from store.gguf_meta import read_info

    return combo["dtype"] == read_info(ref.location).declared


def cell_extras(spec: Spec, combo: dict) -> tuple:
    """The per-cell extras a combination asks for: its include entry's value, else the spec's. A
    sweeping extra's is the one value the combination holds (`sweeps`: set by _combo_cells)."""
    asked = {
        x.key: combo[x.key] if x.key in combo else (None if x.sweeps else spec.extras.get(x.key))
        for x in extras.cell_extras()
    }
    return tuple(sorted((k, v) for k, v in asked.items() if v is not None))


def _sweeping() -> list:
    return [x for x in extras.registered() if x.sweeps]


def _sweeps(spec: Spec, combo: dict) -> list[dict]:
    """{key: one value} per cell the sweeping extras make of the combination (an include entry's
    value, else the spec's, expanded: batch sizes), [{}] where it asks for none."""
    axes = []
    for x in _sweeping():
        value = combo[x.key] if x.key in combo else spec.extras.get(x.key)
        axes.append([(x.key, v) for v in (x.expand(value) if value is not None else [None])])
    return [dict(pick) for pick in itertools.product(*axes)]


def partners(spec: Spec, one: dict, opts: dict, corpus_fp: str, extra: dict | None = None) -> tuple:
    """(key, (stack id, ...)) of each cell a plug-in grades this one against (Extra.partner): the
    stack with the plug-in's partner value; for an engine option whose partner value is the
    engine's default, then the stack without the option; or the stack on other hardware
    (Extra.partner_elsewhere). _settle keeps one."""
    out = []
    for x in extras.registered():  # a cell graded on other hardware: the same stack there
        moved = x.partner_elsewhere(one, opts, spec.reference or {})
        if moved is not None:
            out.append((x.key, (make_cell_id(spec, moved[0], moved[1], corpus_fp, extra=extra),)))
    for x, value in extras.of(SimpleNamespace(extras=cell_extras(spec, one), opts=opts)):
        other = x.partner(value)
        if other is None:
            continue
        if not x.option:
            out.append((x.key, (make_cell_id(spec, {**one, x.key: other}, opts, corpus_fp, extra=extra),)))
            continue
        got = [make_cell_id(spec, one, {**opts, x.key: other}, corpus_fp, extra=extra)]
        if x.label(other) == x.label(x.default):
            got.append(make_cell_id(spec, one, {k: v for k, v in opts.items() if k != x.key}, corpus_fp, extra=extra))
        out.append((x.key, tuple(got)))
    return tuple(sorted(out))


def _settle(cells: list[Cell], renamed: dict[str, str]) -> list[Cell]:
    """Each cell's partners, one stack id per plug-in: the first of its candidates the sweep has,
    else the last: for an engine option, the stack without it, as `matrix kld` adds a file's plain
    candidate in a later call (analyze says so while no capture of it exists). renamed: stack ids
    the reference took on when it records extra rows for its model (references.reference_extras)."""
    have = {ids.base_stack(c.stack_id) for c in cells}

    def pick(got: tuple) -> str:
        got = tuple(renamed.get(i, i) for i in got)
        return next((i for i in got if i in have), got[-1])

    return [dataclasses.replace(c, partners=tuple((k, pick(got)) for k, got in c.partners)) for c in cells]


def _check(spec: Spec, combo: dict, cell: Cell) -> None:
    """A value an engine's limits refuse is the spec's error (exit 2), naming the spec's key or the
    first include entry that gave the combination its value."""
    for x, value in extras.of(cell):
        fld = f"options.{x.key}" if x.option else x.key
        if x.key in combo:
            given = (f"include[{i}].{x.key}" for i, e in enumerate(spec.include) if e.get(x.key) == combo[x.key])
            fld = next(given, fld)
        x.check(cell, value, lambda msg, v, fld=fld: field_error(spec.path, fld, msg, v))


def unsupported(cell: Cell) -> str | None:
    """Why the cell's engine cannot run it: its coordinates (the backend says), or an extra it asks for."""
    from backends import backend_class, unsupported_reason

    reason = unsupported_reason(cell)
    cls = backend_class(cell.engine)
    if reason is None and cls is not None:
        reason = next((why for x, v in extras.of(cell) if (why := x.unsupported(cls, cell, v))), None)
    return reason


def _candidate_cells(spec: Spec, corpus_fp: str, seen: set, cells: list, skipped: list) -> None:
    from matrix.spec import candidates

    for cell, foreign in candidates.cells(spec, corpus_fp, make_cell_id, option_sets, cell_extras, partners):
        reason = unsupported(cell) or (f"engine {cell.engine} takes no option {foreign[0]}" if foreign else None)
        if reason:
            skipped.append({**cell.axes(), "stack_id": cell.stack_id, "reason": reason})
        elif cell.stack_id not in seen:
            seen.add(cell.stack_id)
            cells.append(cell)


def _combo_cells(spec: Spec, corpus_fp: str, seen: set, cells: list, skipped: list) -> None:
    """The matrix's own cells (one per value of each option axis, and their replicas), each
    runnable or skipped with its reason."""
    for combo in _combos(spec):
        group = next(
            (g for g, sels in spec.centroid_groups if any(all(combo[k] == v for k, v in sel.items()) for sel in sels)),
            None,
        )
        for (opts, foreign), sweep in itertools.product(option_sets(spec, combo), _sweeps(spec, combo)):
            one = {**combo, **sweep}
            cid = make_cell_id(spec, one, opts, corpus_fp)
            if cid in seen:
                continue
            seen.add(cid)
            stack = StackDesc.of(
                **{k: combo[k] for k in names.CELL_AXES},
                max_tokens=combo.get("max_tokens", spec.max_tokens),
                extras=cell_extras(spec, one),
                options=tuple(opts.items()),
            )
            cell = Cell(
                stack,
                stack_id=cid,
                threads=combo.get("threads", spec.threads),
                centroid_group=group,
                calibration=combo.get("calibration"),
                partners=partners(spec, one, opts, corpus_fp),
            )
            _check(spec, combo, cell)
            reason = _combo_reason(spec, combo, cell, foreign)
            if reason:
                skipped.append({**cell.axes(), "stack_id": cid, "reason": reason})
                continue
            cells.append(cell)
            for i in range(1, combo.get("replicas", spec.replicas)):  # the same stack on other nodes
                rid = make_cell_id(spec, one, opts, corpus_fp, i)
                cells.append(dataclasses.replace(cell, stack_id=rid, replica=i))


def _combo_reason(spec: Spec, combo: dict, cell: Cell, foreign: list[str]) -> str | None:
    """Why a combination's cell cannot run (None: it can); an attention an include entry names and
    its engine lacks is the spec's error, not a skip."""
    from backends import backend_class

    reason = unsupported(cell)
    if "_include" in combo and "attention" in spec.include[combo["_include"]]:
        cls = backend_class(cell.engine)
        if cls is not None and cell.attention not in cls.attention:  # asked for by name: an error, not a skip
            raise field_error(
                spec.path,
                f"include[{combo['_include']}].attention",
                f"engine {cell.engine} has no attention {cell.attention!r} (has: {', '.join(sorted(cls.attention))})",
                cell.attention,
            )
    if reason is None and foreign:
        reason = f"engine {cell.engine} takes no option {foreign[0]}"
    return reason


def expand(spec: Spec) -> Matrix:
    """The spec with its cells, skipped combinations and each model's reference cell."""
    corpus_fp = corpus_fingerprint(spec)
    seen, cells, skipped = set(), [], []
    _combo_cells(spec, corpus_fp, seen, cells, skipped)
    _candidate_cells(spec, corpus_fp, seen, cells, skipped)
    if not cells:
        raise UserError(
            f"{spec.path}: no runnable cell: " + "; ".join(f"{s['stack_id']}: {s['reason']}" for s in skipped[:3])
        )
    refs = references(spec, cells, skipped)
    renamed: dict[str, str] = {}
    if refs:
        before = [c.stack_id for c in cells]
        cells, refs = reference_extras(spec, corpus_fp, cells, refs, make_cell_id)
        renamed = {old: c.stack_id for old, c in zip(before, cells) if old != c.stack_id}
    return Matrix(spec, tuple(_settle(cells, renamed)), tuple(skipped), refs)
