"""A spec's matrix expanded into cells (GitHub Actions semantics), with their ids and the
typed description each cell's backend is given. `load_spec` is parse (spec.py) + expand."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os

from common import ids, names
from common.errors import UserError
from common.stack import Cell, ModelCopy, StackDesc
from matrix.calibration import option_identity
from matrix.spec import OPTION_KEYS, Spec, field_error, parse_spec


def load_spec(spec_path: str | os.PathLike) -> Spec:
    """Parse and validate a spec file, then expand it into cells."""
    spec = parse_spec(spec_path)
    expand(spec)
    return spec


def stack_desc(cell: Cell, model) -> StackDesc:
    """What the cell's backend is given (model: matrix.models.ResolvedModel)."""
    return StackDesc(engine=cell.engine, dtype=cell.dtype, attention=cell.attention, device=cell.device,
                     tp=cell.tp, model=cell.model, cell_id=cell.cell_id, options=cell.options,
                     max_tokens=cell.max_tokens, weights_sha256=model.weights_sha256,
                     layers=cell.layers if isinstance(cell.layers, tuple) else (), decode=cell.decode,
                     prefix_cache=cell.prefix_cache, source_gguf=model.gguf_path, source_quant=model.gguf_quant,
                     build=cell.build,
                     calibration_text=_calibration_text(cell), **_artifact(cell, model))


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
    from matrix.candidates import file_of

    return dict(zip(("artifact", "artifact_sha256", "artifact_source"), file_of(cell, model)))


def model_copy(model) -> ModelCopy:
    """What a node is told about the cell's reference weights (model: matrix.models.ResolvedModel)."""
    return ModelCopy(model.name, model.hf_dir, model.weights_sha256, model.gguf_path,
                     model.source_sha256 if model.gguf_path else None)


def _combos(spec: Spec) -> list[dict]:
    """GitHub Actions matrix semantics: product, minus exclude, plus include."""
    keys = list(names.CELL_AXES)
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(spec.axes[k] for k in keys))]
    combos = [c for c in combos
              if not any(all(c.get(k) == v for k, v in ex.items()) for ex in spec.exclude)]
    originals = [dict(c) for c in combos]  # the product's combinations only: as in GitHub Actions,
    for i, inc in enumerate(spec.include):  # an include never extends one an earlier include created
        added = False
        for c, orig in zip(combos, originals):
            # Extend a combination when no key overwrites one of its original values.
            if all(orig.get(k, v) == v for k, v in inc.items() if k in names.CELL_AXES):
                c.update(inc)
                added = True
        if not added:
            new = dict(inc, _include=i)  # a combination the spec asked for by name
            for k in keys:
                if k not in new:
                    if len(spec.axes[k]) != 1:
                        raise field_error(spec.path, f"include[{i}].{k}",
                                   "a new combination must name this axis (it has several values)")
                    new[k] = spec.axes[k][0]
            combos.append(new)
    return combos


def corpus_fingerprint(spec: Spec) -> str:
    from matrix.corpus import corpus_files

    h = hashlib.sha256()
    for f in corpus_files(spec.corpus):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
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


def make_cell_id(spec: Spec, combo: dict, opts: dict, corpus_fp: str, replica: int = 0,
                 extra: dict | None = None) -> str:
    """Stable id: readable coordinates plus a hash of everything that changes the rows (extra:
    what else does, e.g. a candidate's file)."""
    key = {**(extra or {}), **{k: combo[k] for k in names.CELL_AXES}, "model": spec.models[combo["model"]].identity,
           "threads": combo.get("threads", spec.threads), "stride": spec.stride,
           "bos": spec.bos, "corpus": corpus_fp}
    if opts:  # only when set, so cells without options keep their ids
        key["options"] = option_identity(opts)
    if spec.store != "native":  # lossy storage is another row content
        key["store"] = spec.store
    if not spec.positions.is_plain:  # only then, so cells captured at a plain stride keep their ids
        key["positions"] = spec.positions.to_dict()
    if combo.get("max_tokens", spec.max_tokens):
        key["max_tokens"] = combo.get("max_tokens", spec.max_tokens)
    if _layers(spec, combo) is not None:  # the cell records more: another capture
        key["layers"] = _layers(spec, combo)
    if _decode(spec, combo) is not None:
        key["decode"] = _decode(spec, combo)
    if _prefix_cache(spec, combo):
        key["prefix_cache"] = "check"
    return ids.cell_id(combo, key, replica)


def _layers(spec: Spec, combo: dict):
    return combo["layers"] if "layers" in combo else spec.layers


def _decode(spec: Spec, combo: dict):
    return combo["decode"] if "decode" in combo else spec.decode


def _prefix_cache(spec: Spec, combo: dict) -> bool:
    return bool(combo["prefix_cache"] if "prefix_cache" in combo else spec.prefix_cache)


def _add_candidates(spec: Spec, corpus_fp: str, seen: set) -> None:
    from backends import unsupported_reason
    from matrix import candidates

    for cell in candidates.cells(spec, corpus_fp, make_cell_id, cell_options):
        reason = unsupported_reason(cell)
        if reason:
            spec.skipped.append({**cell.axes(), "cell_id": cell.cell_id, "reason": reason})
        elif cell.cell_id not in seen:
            seen.add(cell.cell_id)
            spec.cells.append(cell)


def expand(spec: Spec) -> None:
    from backends import backend_class, unsupported_reason

    corpus_fp = corpus_fingerprint(spec)
    seen = set()
    for combo in _combos(spec):
        opts, foreign = cell_options(spec, combo)
        cid = make_cell_id(spec, combo, opts, corpus_fp)
        if cid in seen:
            continue
        seen.add(cid)
        group = next((g for g, sels in spec.centroid_groups
                      if any(all(combo[k] == v for k, v in sel.items()) for sel in sels)), None)
        cell = Cell(**{k: combo[k] for k in names.CELL_AXES},
                    threads=combo.get("threads", spec.threads), cell_id=cid, stack_id=cid,
                    max_tokens=combo.get("max_tokens", spec.max_tokens), layers=_layers(spec, combo),
                    decode=_decode(spec, combo), prefix_cache=_prefix_cache(spec, combo),
                    options=tuple(opts.items()), centroid_group=group, calibration=combo.get("calibration"))
        reason = unsupported_reason(cell)
        if "_include" in combo and "attention" in spec.include[combo["_include"]]:
            cls = backend_class(cell.engine)
            if cls is not None and cell.attention not in cls.attention:  # asked for by name: an error, not a skip
                raise field_error(spec.path, f"include[{combo['_include']}].attention",
                           f"engine {cell.engine} has no attention {cell.attention!r} "
                           f"(has: {', '.join(sorted(cls.attention))})", cell.attention)
        if reason is None and foreign:
            reason = f"engine {cell.engine} takes no option {foreign[0]}"
        if reason:
            spec.skipped.append({**cell.axes(), "cell_id": cid, "reason": reason})
            continue
        spec.cells.append(cell)
        for i in range(1, combo.get("replicas", spec.replicas)):  # the same stack on other nodes
            rid = make_cell_id(spec, combo, opts, corpus_fp, i)
            spec.cells.append(dataclasses.replace(cell, cell_id=rid, stack_id=rid, replica=i))
    _add_candidates(spec, corpus_fp, seen)
    if not spec.cells:
        raise UserError(f"{spec.path}: no runnable cell: "
                        + "; ".join(f"{s['cell_id']}: {s['reason']}" for s in spec.skipped[:3]))
    if spec.reference:
        for model in spec.models:
            sel = {"model": model, **spec.reference}
            if sel["model"] != model:
                continue
            hits = [c for c in spec.cells if c.replica == 0 and c.artifact is None  # a candidate is never the reference
                    and all(getattr(c, k) == v for k, v in sel.items())]
            skipped = [s for s in spec.skipped if all(s[k] == v for k, v in sel.items())]
            if not hits and skipped:
                raise field_error(spec.path, "reference", f"the reference stack cannot run: {skipped[0]['reason']}",
                           spec.reference)
            if len(hits) > 1:
                raise field_error(spec.path, "reference", "matches several cells ("
                           + ", ".join(c.cell_id for c in hits) + "); add keys to pick one", spec.reference)
            if hits:
                spec.reference_cells[model] = hits[0].cell_id
        if not spec.reference_cells:
            raise field_error(spec.path, "reference", "matches no cell of the sweep", spec.reference)
        _reference_layers(spec, corpus_fp)


def _reference_layers(spec: Spec, corpus_fp: str) -> None:
    """A model's reference records every layer (and decode row) any of its cells asks for, so each has its yardstick;
    the reference's id then says so (it is another capture than the plain reference's)."""
    from backends import backend_class
    from matrix.spec import union_decode, union_layers

    for model, ref_id in list(spec.reference_cells.items()):
        want, dec = None, None
        for c in spec.cells:
            if c.model == model:
                want, dec = union_layers(want, c.layers), union_decode(dec, c.decode)
        ref = next(c for c in spec.cells if c.cell_id == ref_id)
        cls = backend_class(ref.engine)  # a reference engine without them: analysis says so per cell
        want = want if getattr(cls, "gives_layers", False) else ref.layers
        dec = dec if getattr(cls, "gives_decode", False) else ref.decode
        if (want, dec) == (ref.layers, ref.decode):
            continue
        combo = {**ref.axes(), "threads": ref.threads, "max_tokens": ref.max_tokens, "layers": want, "decode": dec}
        for i, c in enumerate(spec.cells):  # the reference stack and its replicas
            if ids.split_cell_id(c.stack_id)[0] == ref.stack_id:
                cid = make_cell_id(spec, combo, ref.opts, corpus_fp, c.replica)
                spec.cells[i] = dataclasses.replace(c, cell_id=cid, stack_id=cid, layers=want, decode=dec)
        spec.reference_cells[model] = make_cell_id(spec, combo, ref.opts, corpus_fp)
