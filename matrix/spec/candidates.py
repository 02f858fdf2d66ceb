"""`candidates:` published artifacts measured as they are against their model's reference: GGUF
files (run by llama.cpp) and HF checkpoints, a local directory or a hub id (run by transformers).

A quant author's question is how far the file about to be uploaded is from the original. A
candidate is a cell of its model (same reference, same centroid group) whose engine runs the
given GGUF instead of building one. Its dtype is the quant type the file declares; its cell id
hashes the file's sha256, so another file is another cell. Before any capture the file's
architecture, sizes, vocabulary and special tokens are checked against the reference model
(matrix/spec/candidate_check.py): a file of another model is one line naming what differs, exit 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import backends
import extras
from backends.base import CHECKPOINT, GGUF
from common import ids
from common.errors import UserError
from common.files import file_sha256
from common.stack import Cell, StackDesc
from matrix.spec.validate import check_axis_value, check_threads, field_error
from store.gguf_meta import read_info

CANDIDATE_KEYS = (
    "model",
    "engine",
    "gguf",
    "path",
    "hub",
    "revision",
    "dtype",
    "attention",
    "name",
    "device",
    "threads",
    "calibration",
    *(x.key for x in extras.options()),  # an engine option a plug-in declares (kv_cache)
)
# what a candidate is given as -> the kind of file it is; the engines that run that kind as it is
# (Backend.runs_files) may run it, the kind's default engine (Backend.default_for) when it names none
CANDIDATE_KINDS = {"gguf": GGUF, "path": CHECKPOINT, "hub": CHECKPOINT}


def candidate_engine(kind: str, e: dict) -> str | None:
    return e.get("engine", backends.default_engine(CANDIDATE_KINDS[kind]))


def _candidate_file(path: Path, fld: str, e: dict, models: dict) -> tuple[str, str]:
    """(kind, location) of a candidate: gguf FILE | source, path DIR (an HF checkpoint), hub org/name."""
    given = [k for k in CANDIDATE_KINDS if k in e]
    if len(given) != 1:
        raise field_error(
            path,
            fld,
            "give exactly one of gguf (a GGUF file), path (an HF checkpoint directory) or hub (an HF hub id)",
            e,
        )
    kind = given[0]
    loc = e[kind]
    if not isinstance(loc, str) or not loc:
        raise field_error(path, f"{fld}.{kind}", "must be a non-empty string", loc)
    can = backends.running(CANDIDATE_KINDS[kind])
    if candidate_engine(kind, e) not in can:
        runs = f"runs on engine {' or '.join(can)}" if can else "runs on no registered engine"
        raise field_error(path, f"{fld}.engine", f"a {kind} candidate {runs}", e.get("engine"))
    if "revision" in e and kind != "hub":
        raise field_error(path, f"{fld}.revision", "only a hub candidate has a revision", e["revision"])
    if kind == "gguf" and loc == "source":
        if models[e["model"]].kind not in ("catalog", "gguf"):
            raise field_error(path, f"{fld}.gguf", f"model {e['model']} was not made from a GGUF file", loc)
    elif kind in ("gguf", "path"):
        full = str((path.parent / os.path.expanduser(loc)).resolve())
        ok = os.path.isfile(full) if kind == "gguf" else os.path.isfile(os.path.join(full, "config.json"))
        if not ok:
            raise field_error(
                path,
                f"{fld}.{kind}",
                "no such file" if kind == "gguf" else "not an HF checkpoint directory (no config.json)",
                loc,
            )
        loc = full
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", loc):
        raise field_error(path, f"{fld}.hub", "must be an HF hub id like org/name", loc)
    return kind, loc


def parse_candidates(path: Path, data: dict, models: dict) -> list[dict]:
    """`candidates:` published artifacts, each run as it is and measured against its model's
    reference: {model, gguf: FILE | source} (llama.cpp), or {model, path: DIR | hub: ID [revision],
    [dtype], [attention]} (HF), each with optional name, calibration, device, threads.
    `gguf: source` is the file the model's reference weights were dequantised from."""
    raw = data.get("candidates") or []
    if not isinstance(raw, list):
        raise field_error(path, "candidates", "must be a list of mappings", raw)
    out = []
    for i, e in enumerate(raw):
        fld = f"candidates[{i}]"
        if not isinstance(e, dict):
            raise field_error(path, fld, "must be a mapping with model and one of gguf, path, hub", e)
        for k in e:
            if k not in CANDIDATE_KEYS:
                raise field_error(path, f"{fld}.{k}", f"unknown key; expected one of {', '.join(CANDIDATE_KEYS)}")
        if e.get("model") not in models:
            raise field_error(
                path, f"{fld}.model", f"expected one of the spec's models ({', '.join(models)})", e.get("model")
            )
        kind, loc = _candidate_file(path, fld, e, models)
        for k in ("name", "calibration", "revision"):
            v = e.get(k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise field_error(path, f"{fld}.{k}", "must be a non-empty string", v)
        extra = {}
        for k in ("dtype", "attention"):
            if k in e:
                if kind == "gguf":
                    raise field_error(path, f"{fld}.{k}", "a GGUF candidate runs what its file declares", e[k])
                extra[k] = check_axis_value(path, f"{fld}.{k}", k, e[k], models)
        out.append(
            {
                "model": e["model"],
                "engine": candidate_engine(kind, e),
                "kind": kind,
                kind: loc,
                "revision": e.get("revision"),
                "name": e.get("name"),
                "calibration": e.get("calibration"),
                "device": check_axis_value(path, f"{fld}.device", "device", e["device"], models)
                if "device" in e
                else None,
                "threads": check_threads(path, f"{fld}.threads", e.get("threads")),
                **extra,
                **_options(path, fld, e),
            }
        )
    return out


def _options(path: Path, fld: str, e: dict) -> dict:
    """The plug-ins' engine options the candidate runs with, e.g. its KV cache (its engine takes the
    option, or it is skipped saying so)."""
    out = {}
    for x in extras.options():
        if e.get(x.key) is not None:
            out[x.key] = x.parse(
                e[x.key], lambda msg, val=..., sub="", k=x.key: field_error(path, f"{fld}.{k}{sub}", msg, val)
            )
    return out


def _source(spec, model: str) -> tuple[str | None, str]:
    """(the model's source GGUF on this machine if known yet, its declared quant type)."""
    from matrix.spec.models import CATALOG

    ref = spec.models[model]
    if ref.kind == "gguf":
        return ref.location, read_info(ref.location).declared
    return None, CATALOG[ref.location].source_quant  # fetched later; the catalog pins the file


def _what(spec, c: dict) -> tuple[str | None, str | None, dict, str, str]:
    """(path on the driver, sha256, what the cell id pins, dtype, attention) of one candidate."""
    kind = c["kind"]
    if kind == "gguf" and c["gguf"] == "source":
        path, declared = _source(spec, c["model"])
        return path, None, {"source": spec.models[c["model"]].identity}, declared, "default"
    if kind == "gguf":
        sha = file_sha256(Path(c["gguf"]))
        return c["gguf"], sha, {"sha256": sha}, read_info(c["gguf"]).declared, "default"
    attention = c.get("attention", backends.backend_class(c["engine"]).default_attention)  # an HF checkpoint
    if kind == "path":
        from common.files import weights_digest_cached

        sha = weights_digest_cached(Path(c["path"]))
        if not any(Path(c["path"]).glob("*.safetensors")):
            raise UserError(f"candidate {c['path']}: no *.safetensors files in this checkpoint directory")
        return c["path"], sha, {"weights_sha256": sha}, c.get("dtype") or _config_dtype(c["path"]), attention
    if not c.get("dtype"):
        raise UserError(
            f"{spec.path}: candidates: hub candidate {c['hub']}: give its dtype (its config is read "
            "only when the run starts)"
        )
    hub = ids.hub_artifact(c["hub"], c["revision"])
    return hub, None, {"hub": hub}, c["dtype"], attention


# quantization_config.quant_method -> the spec's dtype name (a checkpoint quantised that way)
CHECKPOINT_QUANT = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


def _config_dtype(d: str) -> str:
    """What a checkpoint directory holds: its quantisation format where its config declares one
    (ModelOpt's NVFP4 is nvfp4), else its torch_dtype."""
    import json

    cfg = json.loads((Path(d) / "config.json").read_text())
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt" and "FP4" in str(q.get("quant_algo", "")).upper():
        return "nvfp4"
    if method in CHECKPOINT_QUANT:
        return CHECKPOINT_QUANT[method]
    found = backends.for_files(CHECKPOINT).checkpoint_dtype(
        str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    )
    return found or "fp32"


def cells(spec, corpus_fp: str, make_cell_id, option_sets, cell_extras, partners) -> list[tuple[Cell, list[str]]]:
    """The spec's candidates as cells, each with the options it asks for that its engine does not
    take (matrix/spec/cells.py expand adds them to the sweep or skips them); each records the
    spec's per-cell extras, as its id says."""
    out = []
    for c in spec.candidates:
        path, sha, pin, dtype, attention = _what(spec, c)
        device = c["device"] or (spec.axes["device"][0] if len(spec.axes["device"]) == 1 else "cpu")
        combo = {
            "model": c["model"],
            "engine": c["engine"],
            "dtype": dtype,
            "attention": attention,
            "tp": 1,
            "device": device,
        }
        if c["threads"]:
            combo["threads"] = c["threads"]
        combo.update({x.key: c[x.key] for x in extras.options() if c.get(x.key) is not None})
        group = next(
            (
                g
                for g, sels in spec.centroid_groups
                if any(all(combo.get(k) == v for k, v in sel.items()) for sel in sels)
            ),
            None,
        )
        for opts, foreign in option_sets(spec, combo):
            cid = make_cell_id(spec, combo, opts, corpus_fp, extra={"candidate": pin})
            stack = StackDesc.of(
                **{k: combo[k] for k in ("model", "engine", "dtype", "attention", "tp", "device")},
                extras=cell_extras(spec, combo),
                max_tokens=spec.max_tokens,
                options=tuple(opts.items()),
                artifact=path or "source",
                artifact_sha256=sha,
            )
            label = c["name"] or (Path(path).name if path else f"{c['model']}'s source GGUF")
            cell = Cell(
                stack,
                stack_id=cid,
                threads=combo.get("threads", spec.threads),
                centroid_group=group,
                calibration=c["calibration"],
                label=label,
                partners=partners(spec, combo, opts, corpus_fp, extra={"candidate": pin}),
            )
            out.append((cell, foreign))
    return out


def file_of(cell: Cell, model) -> tuple[str, str | None, str]:
    """(path, sha256, where it came from) of a candidate's file; `gguf: source` is resolved once
    its model is fetched (model: matrix.spec.models.ResolvedModel)."""
    if cell.artifact == "source":
        return model.gguf_path, model.source_sha256, model.source
    return cell.artifact, cell.artifact_sha256, cell.artifact


def resolve(cell: Cell, model) -> Cell:
    """The candidate with its file and hash known."""
    path, sha, _ = file_of(cell, model)
    return cell.with_stack(artifact=path, artifact_sha256=sha)
