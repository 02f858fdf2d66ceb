"""Sweep spec: strict YAML validation and expansion into cells.

A spec is a GitHub-Actions-style matrix over the axes ``models``, ``engines``,
``dtypes``, ``attention``, ``tp`` and ``devices``, with ``include`` / ``exclude``
entries written with the singular cell keys (``model``, ``engine``, ...).
Every error names the file, the field and the value.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from matrix import names
from matrix.errors import UserError

DEFAULT_STRIDE = 32
BOS_POLICIES = ("tokenizer", "always", "never")
TOP_KEYS = {"name", "description", "models", "engines", "dtypes", "attention", "tp",
            "devices", "include", "exclude", "reference", "stride", "repeats",
            "corpus", "bos", "threads", "options", "max_tokens", "centroid"}
CENTROID_DEFINITIONS = ("mean_prob", "mean_logprob")
MODEL_KEYS = {"name", "catalog", "path", "hub", "gguf", "revision"}
# Engine options that change the arithmetic. Defaults go under top-level `options:`;
# include entries may set them per cell. A backend lists the ones it takes.
OPTION_KEYS = {"kv_cache": ("f16", "f32", "q8_0"), "n_batch": int, "n_ubatch": int,
               "trt_backend": ("pytorch", "tensorrt"), "vllm_executor": ("mp", "ray")}
# Non-axis keys an include entry may add to a cell.
# `calibration` describes the artefact (e.g. "imatrix from wiki.train, 512 chunks") for model
# cards; like the centroid group it is not part of the cell id.
CELL_EXTRA_KEYS = {"threads", "max_tokens", "calibration"} | set(OPTION_KEYS)


@dataclass(frozen=True)
class ModelRef:
    """Where a model's reference weights come from."""

    name: str
    kind: str  # catalog | path | hub | gguf
    location: str  # catalog name, absolute path, or hub id
    revision: str | None = None

    @property
    def identity(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.kind}:{self.location}{rev}"


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
    cell_id: str
    # Feed only a prefix of each prompt (for slow stacks). Causal attention makes the
    # rows it keeps identical in meaning to the full run's rows at the same positions.
    max_tokens: int | None = None
    options: tuple = ()  # sorted (key, value) pairs the engine takes
    # Analysis only (not in the cell id): whose centroid this stack joins. None: its model's.
    centroid_group: str | None = None
    calibration: str | None = None  # declared in the spec; model cards disclose it

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def axes(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in names.CELL_AXES}

    def label(self) -> str:
        return f"{self.model} {self.engine} {self.dtype} {self.attention} tp{self.tp} {self.device}"


@dataclass
class Spec:
    path: Path
    name: str
    models: dict[str, ModelRef]
    axes: dict[str, list]  # cell key -> values
    include: list[dict]
    exclude: list[dict]
    reference: dict
    stride: int
    repeats: int
    corpus: str  # "builtin" or an absolute path
    bos: str
    threads: int | None
    options: dict = field(default_factory=dict)
    max_tokens: int | None = None
    centroid: str = "mean_prob"  # centroid definition
    centroid_groups: list = field(default_factory=list)  # [(name, [selector, ...])], first match wins
    raw_text: str = ""
    cells: list[Cell] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    reference_cells: dict[str, str] = field(default_factory=dict)  # model -> cell_id

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw_text.encode()).hexdigest()


def _err(path: Path, fld: str, msg: str, value: Any = ...) -> UserError:
    got = "" if value is ... else f" (got {value!r})"
    return UserError(f"{path}: {fld}: {msg}{got}")


def _as_list(path: Path, fld: str, value: Any) -> list:
    if isinstance(value, list):
        if not value:
            raise _err(path, fld, "must not be empty")
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return [value]
    raise _err(path, fld, "must be a list or a single value", value)


def _check_axis_value(path: Path, fld: str, key: str, value: Any, models: dict) -> Any:
    """Validate one cell-axis value; returns it normalised."""
    if key == "tp":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _err(path, fld, "tp must be a positive integer", value)
        return value
    if not isinstance(value, str):
        raise _err(path, fld, f"{key} must be a string", value)
    allowed = {"engine": names.ENGINES, "dtype": names.DTYPES, "attention": names.ATTENTION,
               "device": names.DEVICES, "model": tuple(models)}[key]
    if value not in allowed:
        raise _err(path, fld, f"unknown {key}; expected one of {', '.join(allowed)}", value)
    return value


def _parse_model(path: Path, idx: int, entry: Any) -> ModelRef:
    from matrix import models as catalog  # local: catalog imports nothing heavy either

    fld = f"models[{idx}]"
    if isinstance(entry, str):
        if entry in catalog.CATALOG:
            return ModelRef(entry, "catalog", entry)
        p = (path.parent / os.path.expanduser(entry))
        if entry.endswith(".gguf"):
            entry = {"gguf": entry}
        elif p.is_dir() or entry.startswith((".", "/", "~")):
            entry = {"path": entry}
        elif "/" in entry:
            entry = {"hub": entry}
        else:
            raise _err(path, fld, "not a catalog model, local directory, GGUF file or hub id "
                       f"(catalog: {', '.join(catalog.CATALOG)})", entry)
    if not isinstance(entry, dict):
        raise _err(path, fld, "must be a name or a mapping", entry)
    unknown = set(entry) - MODEL_KEYS
    if unknown:
        raise _err(path, f"{fld}.{sorted(unknown)[0]}",
                   f"unknown key; expected one of {', '.join(sorted(MODEL_KEYS))}")
    sources = [k for k in ("catalog", "path", "hub", "gguf") if k in entry]
    if len(sources) != 1:
        raise _err(path, fld, "needs exactly one of catalog, path, hub, gguf", entry)
    kind = sources[0]
    loc = entry[kind]
    if not isinstance(loc, str) or not loc:
        raise _err(path, f"{fld}.{kind}", "must be a non-empty string", loc)
    if kind == "catalog" and loc not in catalog.CATALOG:
        raise _err(path, f"{fld}.catalog", f"unknown catalog model; known: {', '.join(catalog.CATALOG)}", loc)
    if kind in ("path", "gguf"):
        p = (path.parent / os.path.expanduser(loc)).resolve()
        if not p.exists():
            raise _err(path, f"{fld}.{kind}", "does not exist", str(p))
        if kind == "path" and not p.is_dir():
            raise _err(path, f"{fld}.path", "must be a directory with config.json", str(p))
        if kind == "path" and not (p / "config.json").exists():
            raise _err(path, f"{fld}.path", "has no config.json (not a Hugging Face model directory)", str(p))
        if kind == "gguf" and not p.is_file():
            raise _err(path, f"{fld}.gguf", "must be a file", str(p))
        loc = str(p)
    name = entry.get("name") or (loc if kind == "catalog" else Path(loc).stem if kind == "gguf"
                                 else Path(loc).name if kind == "path" else loc.split("/")[-1])
    if not isinstance(name, str) or not name or any(c in name for c in "/\\ \t"):
        raise _err(path, f"{fld}.name", "must be a name without slashes or spaces", name)
    revision = entry.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise _err(path, f"{fld}.revision", "must be a string", revision)
    return ModelRef(name, kind, loc, revision)


def _parse_entry(path: Path, fld: str, entry: Any, models: dict, extra_ok: bool) -> dict:
    if not isinstance(entry, dict) or not entry:
        raise _err(path, fld, "must be a non-empty mapping of cell keys", entry)
    out = {}
    for k, v in entry.items():
        if k in names.CELL_AXES:
            out[k] = _check_axis_value(path, f"{fld}.{k}", k, v, models)
        elif extra_ok and k in ("threads", "max_tokens"):
            out[k] = _check_threads(path, f"{fld}.{k}", v)
        elif extra_ok and k == "calibration":
            if not isinstance(v, str) or not v.strip():
                raise _err(path, f"{fld}.{k}", "must be a non-empty string describing the calibration data", v)
            out[k] = v.strip()
        elif extra_ok and k in OPTION_KEYS:
            out[k] = _check_option(path, f"{fld}.{k}", k, v)
        else:
            keys = names.CELL_AXES + (tuple(sorted(CELL_EXTRA_KEYS)) if extra_ok else ())
            raise _err(path, f"{fld}.{k}", f"unknown key; expected one of {', '.join(keys)}")
    return out


def _parse_centroid(path: Path, raw: Any, models: dict) -> tuple[str, list]:
    """centroid: {definition: mean_prob|mean_logprob, groups: {NAME: SELECTOR or [SELECTOR, ...]}}.

    A selector is a mapping of cell axes (like an exclude entry). A stack joins the first group
    it matches; stacks that match none form their model's default group. Groups never mix
    models (their vocabularies differ), so a group spanning two models has one centroid per model."""
    if raw is None:
        return "mean_prob", []
    if not isinstance(raw, dict):
        raise _err(path, "centroid", "must be a mapping with keys definition, groups", raw)
    for k in raw:
        if k not in ("definition", "groups"):
            raise _err(path, f"centroid.{k}", "unknown key; expected one of definition, groups")
    definition = raw.get("definition", "mean_prob")
    if definition not in CENTROID_DEFINITIONS:
        raise _err(path, "centroid.definition", f"expected one of {', '.join(CENTROID_DEFINITIONS)}", definition)
    graw = raw.get("groups") or {}
    if not isinstance(graw, dict):
        raise _err(path, "centroid.groups", "must be a mapping of group name to selector(s)", graw)
    groups = []
    for gname, sel in graw.items():
        if not isinstance(gname, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", gname):
            raise _err(path, "centroid.groups", "a group name must be letters, digits, _ or -", gname)
        sels = sel if isinstance(sel, list) else [sel]
        groups.append((gname, [_parse_entry(path, f"centroid.groups.{gname}[{i}]", e, models, False)
                               for i, e in enumerate(sels)]))
    return definition, groups


def _check_option(path: Path, fld: str, key: str, v: Any) -> Any:
    kind = OPTION_KEYS[key]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _err(path, fld, "must be a positive integer", v)
    elif v not in kind:
        raise _err(path, fld, f"expected one of {', '.join(kind)}", v)
    return v


def _check_threads(path: Path, fld: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(path, fld, "must be a positive integer or null", v)
    return v


def _int(path: Path, data: dict, key: str, default: int) -> int:
    v = data.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(path, key, "must be a positive integer", v)
    return v


def load_spec(spec_path: str | os.PathLike) -> Spec:
    """Parse and validate a spec file, then expand it into cells."""
    path = Path(spec_path)
    if not path.is_file():
        raise UserError(f"{path}: spec file not found")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: malformed YAML: {where}{problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a spec must be a YAML mapping (got {type(data).__name__})")
    unknown = set(data) - TOP_KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise _err(path, k, f"unknown key; expected one of {', '.join(sorted(TOP_KEYS))}")
    if "models" not in data:
        raise _err(path, "models", "is required")

    models: dict[str, ModelRef] = {}
    for i, m in enumerate(_as_list(path, "models", data["models"])):
        ref = _parse_model(path, i, m)
        if ref.name in models:
            raise _err(path, f"models[{i}].name", "duplicate model name", ref.name)
        models[ref.name] = ref

    defaults = {"engines": ["hf"], "dtypes": ["bf16"], "attention": ["default"], "tp": [1],
                "devices": ["cpu"]}
    axes: dict[str, list] = {}
    for spec_key, cell_key in names.SPEC_AXES.items():
        if spec_key == "models":
            axes["model"] = list(models)
            continue
        values = _as_list(path, spec_key, data.get(spec_key, defaults[spec_key]))
        checked = [_check_axis_value(path, f"{spec_key}[{i}]", cell_key, v, models)
                   for i, v in enumerate(values)]
        if len(set(checked)) != len(checked):
            raise _err(path, spec_key, "has duplicate values", values)
        axes[cell_key] = checked

    def entries(key: str, extra_ok: bool) -> list[dict]:
        v = data.get(key) or []
        if not isinstance(v, list):
            raise _err(path, key, "must be a list of mappings", v)
        return [_parse_entry(path, f"{key}[{i}]", e, models, extra_ok) for i, e in enumerate(v)]

    include, exclude = entries("include", True), entries("exclude", False)
    reference = _parse_entry(path, "reference", data["reference"], models, False) \
        if data.get("reference") is not None else {}

    corpus = data.get("corpus", "builtin")
    if not isinstance(corpus, str) or not corpus:
        raise _err(path, "corpus", "must be 'builtin' or a path to a corpus YAML file", corpus)
    if corpus != "builtin":
        cp = (path.parent / os.path.expanduser(corpus)).resolve()
        if not cp.is_file():
            raise _err(path, "corpus", "corpus file not found", str(cp))
        corpus = str(cp)
    bos = data.get("bos", "tokenizer")
    if bos not in BOS_POLICIES:
        raise _err(path, "bos", f"expected one of {', '.join(BOS_POLICIES)}", bos)
    raw_opts = data.get("options") or {}
    if not isinstance(raw_opts, dict):
        raise _err(path, "options", "must be a mapping", raw_opts)
    options = {}
    for k, v in raw_opts.items():
        if k not in OPTION_KEYS:
            raise _err(path, f"options.{k}", f"unknown option; expected one of {', '.join(sorted(OPTION_KEYS))}")
        options[k] = _check_option(path, f"options.{k}", k, v)
    centroid, groups = _parse_centroid(path, data.get("centroid"), models)
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise _err(path, "name", "must be a string", name)

    spec = Spec(path=path, name=name, models=models, axes=axes, include=include,
                exclude=exclude, reference=reference, stride=_int(path, data, "stride", DEFAULT_STRIDE),
                repeats=_int(path, data, "repeats", 1), corpus=corpus, bos=bos,
                threads=_check_threads(path, "threads", data.get("threads")), options=options,
                max_tokens=_check_threads(path, "max_tokens", data.get("max_tokens")),
                centroid=centroid, centroid_groups=groups, raw_text=text)
    expand(spec)
    return spec


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
                        raise _err(spec.path, f"include[{i}].{k}",
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


def make_cell_id(spec: Spec, combo: dict, opts: dict, corpus_fp: str) -> str:
    """Stable id: readable coordinates plus a hash of everything that changes the rows."""
    key = {**{k: combo[k] for k in names.CELL_AXES}, "model": spec.models[combo["model"]].identity,
           "threads": combo.get("threads", spec.threads), "stride": spec.stride,
           "bos": spec.bos, "corpus": corpus_fp}
    if opts:  # only when set, so cells without options keep their ids
        key["options"] = opts
    if combo.get("max_tokens", spec.max_tokens):
        key["max_tokens"] = combo.get("max_tokens", spec.max_tokens)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return (f"{combo['model']}.{combo['engine']}.{combo['dtype']}.{combo['attention']}"
            f".tp{combo['tp']}.{combo['device']}-{digest}")


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
                    threads=combo.get("threads", spec.threads), cell_id=cid,
                    max_tokens=combo.get("max_tokens", spec.max_tokens),
                    options=tuple(opts.items()), centroid_group=group, calibration=combo.get("calibration"))
        reason = unsupported_reason(cell)
        if "_include" in combo and "attention" in spec.include[combo["_include"]]:
            cls = backend_class(cell.engine)
            if cls is not None and cell.attention not in cls.attention:  # asked for by name: an error, not a skip
                raise _err(spec.path, f"include[{combo['_include']}].attention",
                           f"engine {cell.engine} has no attention {cell.attention!r} "
                           f"(has: {', '.join(sorted(cls.attention))})", cell.attention)
        if reason is None and foreign:
            reason = f"engine {cell.engine} takes no option {foreign[0]}"
        if reason:
            spec.skipped.append({**cell.axes(), "cell_id": cid, "reason": reason})
        else:
            spec.cells.append(cell)
    if not spec.cells:
        raise UserError(f"{spec.path}: no runnable cell: "
                        + "; ".join(f"{s['cell_id']}: {s['reason']}" for s in spec.skipped[:3]))
    if spec.reference:
        for model in spec.models:
            sel = {"model": model, **spec.reference}
            if sel["model"] != model:
                continue
            hits = [c for c in spec.cells if all(getattr(c, k) == v for k, v in sel.items())]
            skipped = [s for s in spec.skipped if all(s[k] == v for k, v in sel.items())]
            if not hits and skipped:
                raise _err(spec.path, "reference", f"the reference stack cannot run: {skipped[0]['reason']}",
                           spec.reference)
            if len(hits) > 1:
                raise _err(spec.path, "reference", "matches several cells ("
                           + ", ".join(c.cell_id for c in hits) + "); add keys to pick one", spec.reference)
            if hits:
                spec.reference_cells[model] = hits[0].cell_id
        if not spec.reference_cells:
            raise _err(spec.path, "reference", "matches no cell of the sweep", spec.reference)
