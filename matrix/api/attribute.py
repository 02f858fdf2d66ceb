"""`attribute()`: which tensors cost the KL of a quant recipe, and what each byte buys.

The recipe (a quant type, optionally an importance matrix) is quantised once from the reference: the
base. Each group of tensors (backends/gguf_groups.py: by kind, by depth) is then raised alone to a
higher type, and optionally lowered alone to a cheaper one, through llama.cpp's per-tensor type
overrides; every file is measured against the reference's rows by `kld()` calls into one job spec
(the reference's rows stored once, a candidate measured as it is captured), ranked
(analysis/attribution.py), and the raises are applied cumulatively in the ranking's order: each
frontier point a real file, measured.

Every file is a content-keyed artifact and the job's cells are kept, so a second call (or one after
an interruption) quantises and measures only what it has not.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from analysis import attribution as A
from backends.gguf_groups import flag_name
from common.errors import UserError, first_line
from common.output import log as stderr_log
from matrix.api.results import AttributeResult

RAISE_DEFAULT = "q8_0"
# the ggml types llama.cpp quantises a tensor to without an importance matrix (ggml_quantize_chunk;
# the IQ types want one, and a type it cannot make aborts the process)
TARGET_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "q3_k", "q2_k")


def attribute(
    reference: str,
    quant: str,
    text: str | os.PathLike,
    warehouse: str = "attribute-warehouse",
    *,
    imatrix: str | None = None,
    raise_to: str = RAISE_DEFAULT,
    lower_to: str | None = None,
    groups: tuple[str, ...] | None = None,
    frontier: int | None = None,
    n_ctx: int = 512,
    chunks: int | None = None,
    threads: int | None = None,
    address: str | None = None,
    executor: str | None = None,
    log: Callable[[str], None] | None = None,
) -> AttributeResult:
    """reference: an F16/BF16/F32 GGUF, an HF checkpoint directory or a catalog model (converted to
    F16); quant: the recipe's type (`q4_k_m`) and imatrix its imatrix GGUF; raise_to: a ggml type or
    `reference` (its own type); lower_to: also lower each group to this type; groups: only these
    (`attn_v`, `first_third`); frontier: at most this many cumulative steps (None: every raise that
    removes KL). n_ctx, chunks, threads, address, executor: as `kld()`."""
    from backends import gguf_build
    from matrix.api.kld import cell_threads

    log = log or stderr_log
    threads = cell_threads(threads, address)
    _check(quant, text, frontier, groups)
    ref = _reference(reference, threads, log)
    types = _directions(raise_to, lower_to, ref)
    im = _imatrix(imatrix)
    found = _groups(ref, groups, log)

    def build(lines: tuple[str, ...], label: str | None = None, planned: dict | None = None) -> dict:
        return gguf_build.quantize(ref, quant, threads, im, tensor_types=lines, label=label, planned=planned)

    def plan(lines: tuple[str, ...]) -> dict:
        return gguf_build.planned_types(ref["path"], quant, im, lines)

    job = {"text": text, "warehouse": warehouse, "n_ctx": n_ctx, "chunks": chunks, "threads": threads}
    job |= {"address": address, "executor": executor, "log": log}
    base, variants, measured = _base_and_variants(ref, (build, plan), found, types, job)
    variants = _ranked(warehouse, base, variants, measured, [d for d, _ in types])
    steps = _frontier(build, base, variants, frontier, types[0][1], log)
    measured = _measure(ref, steps[1:], job)
    points = [steps[0]] + [{**s, **measured[_key(s["path"])]} for s in steps[1:] if _key(s["path"]) in measured]
    failed = {v["path"] for v in variants if v["dropped"] == A.NOT_MEASURED}
    failed |= {s["path"] for s in steps[1:] if _key(s["path"]) not in measured}
    recipe = quant + (f" + imatrix {Path(imatrix).name}" if imatrix else "")
    return AttributeResult(
        ref["path"], ref["sha256"], recipe, str(text), n_ctx, warehouse, base, tuple(variants), tuple(points),
        tuple(sorted(failed)),
    )  # fmt: skip


def _groups(ref: dict, groups: tuple[str, ...] | None, log) -> list:
    """The reference's groups (those asked for), saying which tensors no kind group names."""
    from backends import gguf_groups

    found = gguf_groups.groups(ref["path"], groups)
    left = gguf_groups.uncovered(ref["path"], found) if groups is None else []
    if left:
        log(
            f"attribute: {len(left)} tensor(s) in no kind group ({', '.join(left[:3])}, ...): "
            "only the thirds reach them"
        )
    return found


def _base_and_variants(ref: dict, quantiser, found: list, types: list, job: dict) -> tuple[dict, list[dict], dict]:
    """(the base, measured; every variant; {file: measured} of the base and each variant that is not
    the base's file). quantiser: (build, plan). The variants are quantised while the reference's and
    the base's cells are captured: the quantiser takes the cores the capture leaves idle (its loads,
    hand-overs, waits)."""
    base = _file(quantiser[0](()), None)
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="quantise") as pool:
        pending = pool.submit(_quantise, quantiser, base, found, types, job["log"], stop)
        try:
            measured = _measure(ref, [base], job)
        except BaseException:
            stop.set()  # no more variants: the job ends here
            raise
        variants = pending.result()
    base = _measured_base(base, measured)
    measured |= _measure(ref, [v for v in variants if v["sha256"] != base["sha256"]], job)
    return base, variants, measured


def _quantise(
    quantiser, base: dict, found: list, types: list[tuple[str, str]], log, stop: threading.Event
) -> list[dict]:
    """Each group's variant in each direction, with progress; none more once stop is set. A variant in
    which llama.cpp's dry run gives every tensor the base's type is the base's file, not quantised
    again: the same types from the same weights are the same bytes."""
    from backends.gguf_build import types_held

    build, plan = quantiser
    progress = _Progress("quantised the variants:", len(found) * len(types), log)
    held = types_held(base["path"])
    variants = []
    for g in found:
        for direction, t in types:
            if stop.is_set():
                return variants
            line = g.line(t)
            planned = plan((line,))
            if planned == held:
                log(f"attribute: {g.name} at {t} leaves every tensor's type as the base has it: the base's file")
                art = {"path": base["path"], "sha256": base["sha256"], "recipe": {"tensor_types": [line]}}
            else:
                art = build((line,), f"{flag_name(g.name)}={t}", planned)
            variants.append({"group": g.name, "direction": direction, "type": t, **_file(art, base, g)})
            progress.tick()
    return variants


def _reference(reference: str, threads: int, log) -> dict:
    """{path, sha256, type} of the float GGUF the recipe quantises: the file given, or a checkpoint
    (or catalog model's) converted to F16 by llama.cpp's converter."""
    from backends import gguf_build
    from common.files import file_sha256, weights_digest_cached
    from matrix.spec import kld as job
    from store.gguf_meta import read_info

    src = job.classify(reference, "--reference")
    if src.kind == "gguf":
        declared = read_info(src.location).declared
        if declared not in gguf_build.FLOAT_TYPES:
            raise UserError(
                f"--reference {reference}: the file declares {declared}; attribution quantises from an F16, "
                "BF16 or F32 file"
            )
        return {"path": src.location, "sha256": file_sha256(Path(src.location)), "type": declared}
    if src.kind == "catalog":
        from matrix.spec.models import fetch
        from matrix.spec.parse import ModelRef

        m = fetch(ModelRef(src.location, "catalog", src.location), log=log)
        hf_dir, sha = m.hf_dir, m.weights_sha256
    else:
        hf_dir, sha = src.location, weights_digest_cached(Path(src.location))
    art = gguf_build.build_for("f16", hf_dir, sha, threads)
    return {"path": art["path"], "sha256": art["sha256"], "type": "f16"}


def _check(quant: str, text, frontier: int | None, groups: tuple[str, ...] | None) -> None:
    """What can be refused before anything is converted or quantised."""
    from backends.gguf_build import QUANT_TYPES

    if quant not in QUANT_TYPES:
        raise UserError(f"--quant {quant}: not a quant type here (one of {', '.join(QUANT_TYPES)})")
    if not Path(os.path.expanduser(str(text))).is_file():
        raise UserError(f"--text {text}: no such file")
    if frontier is not None and frontier < 0:
        raise UserError(f"--frontier {frontier}: must be >= 0")
    if groups is not None and (not groups or len(set(map(flag_name, groups))) < len(groups)):
        raise UserError(f"--groups {','.join(groups)}: name each group once, at least one")


def _directions(raise_to: str, lower_to: str | None, ref: dict) -> list[tuple[str, str]]:
    """[("raise", type), ("lower", type) where asked]."""
    types = [("raise", _ggml_type(raise_to, "--raise-to", ref))]
    if lower_to is not None:
        types.append(("lower", _ggml_type(lower_to, "--lower-to", ref)))
    return types


def _ggml_type(name: str, flag: str, ref: dict) -> str:
    from backends.gguf_build import FLOAT_TYPES

    if name == "reference":
        return FLOAT_TYPES[ref["type"]]
    if name.lower() not in TARGET_TYPES:
        raise UserError(f"{flag} {name}: not a type a group is quantised to here (one of {', '.join(TARGET_TYPES)})")
    return name.lower()


def _imatrix(path: str | None) -> dict | None:
    """An imatrix GGUF (llama-imatrix's or this project's) as quantize() takes it."""
    if path is None:
        return None
    from backends.gguf_imatrix import read
    from common.files import file_sha256

    p = Path(os.path.expanduser(path)).resolve()
    if not p.is_file():
        raise UserError(f"--imatrix {path}: no such file")
    try:
        datasets = read(str(p))["datasets"]
    except (ValueError, KeyError, OSError) as e:  # a legacy .dat, or not a GGUF at all
        raise UserError(f"--imatrix {path}: not an imatrix GGUF ({first_line(str(e), type(e).__name__)})") from None
    return {"path": str(p), "sha256": file_sha256(p), "recipe": {"calibration": datasets[0] if datasets else p.name}}


def _file(art: dict, base: dict | None, group=None) -> dict:
    """A quantised file as the ranking reads it: path, sha256, size, its lines, the types its group's
    tensors really have, and how many tensors outside the group changed against the base."""
    from backends.gguf_build import tensor_layout
    from backends.gguf_groups import quantisable

    counts_all, size = tensor_layout(art["path"])
    types = dict(quantisable(art["path"]))
    out = {
        "path": art["path"],
        "sha256": art["sha256"],
        "size": size,
        "type_counts": counts_all,
        "lines": art["recipe"].get("tensor_types", []),
    }
    if base is None:
        return {**out, "tensor_types": types}
    mine = set(group.tensors)
    counts: dict[str, int] = {}
    for name in group.tensors:
        counts[types[name]] = counts.get(types[name], 0) + 1
    outside = sorted(n for n, t in types.items() if n not in mine and base["tensor_types"].get(n) != t)
    return {
        **out,
        "types": counts,
        "changed_outside": outside,
        "delta_bytes": size["file_bytes"] - base["size"]["file_bytes"],
    }


def _measured_base(base: dict, measured: dict) -> dict:
    if _key(base["path"]) not in measured:
        raise RuntimeError(f"the base file {base['path']} was not measured: its cell did not complete (see above)")
    return {**base, **measured[_key(base["path"])]}


def _measure(ref: dict, files: list[dict], job: dict) -> dict[str, dict]:
    """{file: {cell_id, summary}} of each file measured by one kld() job (job: kld()'s arguments)."""
    from matrix.api.kld import kld

    log = job["log"]
    paths = list(dict.fromkeys(f["path"] for f in files))
    if not paths:
        return {}
    seen = {"done": 0, "base": None, "t0": time.perf_counter()}

    def watch(line: str) -> None:  # the run's own "[cells a/b ..." lines, as this stage's progress
        log(line)
        m = re.match(r"\[cells (\d+)/(\d+)", line)
        if m and int(m.group(1)) > seen["done"]:
            done, total = int(m.group(1)), int(m.group(2))
            if seen["base"] is None:  # cells complete before this call count in the run's figures
                seen["base"] = done - 1
            seen["done"], el = done, time.perf_counter() - seen["t0"]
            eta = el / (done - seen["base"]) * (total - done)
            log(f"attribute: measured {done}/{total} cells of the job | ETA {eta:.0f}s")

    r = kld(ref["path"], paths, **{**job, "log": watch})
    if r.refused is not None and not r.results:
        raise UserError(r.refused)
    # kld() names each file by its resolved path: the results are keyed the same way here
    return {_key(c.candidate): {"cell_id": c.cell_id, "summary": A.summary(c.statistics)} for c in r.results}


def _key(path: str) -> str:
    return str(Path(path).resolve())


def _ranked(warehouse: str, base: dict, variants: list[dict], measured: dict, directions: list[str]) -> list[dict]:
    from analysis.sql import connect

    con = connect(warehouse)
    try:
        out = []
        for v in variants:
            m = measured.get(_key(v["path"]))
            if v["sha256"] == base["sha256"] or m is None:  # the base's file, or its cell failed: rank() drops it
                out.append({**v, "cell_id": None, "summary": None, "delta_kl": None, "score": None})
            else:
                d = A.paired_delta(con, base["cell_id"], m["cell_id"])
                out.append({**v, **m, "delta_kl": d, "score": A.score(d[0], v["delta_bytes"])})
    finally:
        con.close()
    return [r for d in directions for r in A.rank([v for v in out if v["direction"] == d], d, base["sha256"])]


def _frontier(build, base: dict, variants: list[dict], limit: int | None, raise_type: str, log) -> list[dict]:
    """Step 0 the base, step k the first k raises of the ranking applied together: each a file,
    skipped where it has the bytes of the step before (its group already covered)."""
    order = A.frontier_order([v for v in variants if v["direction"] == "raise"])
    steps = [{**base, "step": 0, "groups": []}]
    lines: list[str] = []
    names: list[str] = []
    for v in order:
        if limit is not None and len(steps) > limit:
            break
        lines += v["lines"]
        names.append(v["group"])
        if len(names) == 1:  # the first step is the ranking's first variant, measured already
            f = {k: x for k, x in v.items() if k in ("path", "sha256", "size", "type_counts", "lines")}
        else:
            art = build(tuple(lines), f"{','.join(map(flag_name, names))}={raise_type}")
            f = {k: x for k, x in _file(art, None).items() if k != "tensor_types"}
        if f["sha256"] == steps[-1]["sha256"]:
            log(f"frontier: raising {v['group']} after {', '.join(names[:-1])} changes no byte; no step of its own")
            continue
        steps.append({**f, "step": len(steps), "groups": list(names)})
    return steps


class _Progress:
    """done/total, rate and ETA of one stage, logged at each step."""

    def __init__(self, what: str, total: int, log) -> None:
        self.what, self.total, self.done, self.log, self.t0 = what, total, 0, log, time.perf_counter()

    def tick(self) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        rate = self.done / max(el, 1e-9)
        eta = (self.total - self.done) / rate
        self.log(f"attribute: {self.what} {self.done}/{self.total} files | {rate:.2f}/s | ETA {eta:.0f}s")
