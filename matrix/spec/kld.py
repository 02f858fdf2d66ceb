"""`matrix kld`'s job as a spec: llama-perplexity --kl-divergence's measurement of candidate files
against a reference over one text, written next to the warehouse so it can be run again or extended.

llama-perplexity (tools/perplexity/perplexity.cpp) cuts the tokenised text into n_ctx-token chunks,
scores the second half of each (positions n_ctx/2 .. n_ctx-2, each predicting the next token) and
compares full-vocabulary distributions there. The spec says the same: `chunks: N_CTX` (and
`max_chunks: N` for its --chunks N), `positions: llama_perplexity`, llama.cpp's own tokenisation
(`vocab:`) when the reference is a GGUF, bf16 rows, no centroid, and each candidate measured in its
capturing process against the reference's stored rows.

A second call with more candidates against the same reference and text adds them to the spec: the
reference and the earlier candidates are complete cells, so only the new ones are captured.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

import extras
from common.errors import UserError, read_text_file

KINDS = ("gguf", "path", "catalog")


@dataclass(frozen=True)
class Source:
    """A reference or candidate as given: a GGUF file, an HF checkpoint directory, or a catalog model."""

    kind: str  # KINDS
    location: str  # absolute path, or the catalog name

    @property
    def label(self) -> str:
        return self.location if self.kind == "catalog" else Path(self.location).name


def classify(arg: str, flag: str) -> Source:
    """What a --reference / --candidate names; anything else is one line naming the flag and value."""
    from matrix.spec.models import CATALOG

    if arg in CATALOG:
        return Source("catalog", arg)
    p = Path(os.path.expanduser(arg)).resolve()
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return Source("gguf", str(p))
    if p.is_dir() and (p / "config.json").is_file():
        return Source("path", str(p))
    raise UserError(
        f"{flag} {arg}: not a GGUF file, a Hugging Face checkpoint directory (config.json) "
        f"or a catalog model ({', '.join(CATALOG)})"
    )


def model_name(ref: Source) -> str:
    """The spec's name for the reference model: its catalog name, else its file or directory name."""
    if ref.kind == "catalog":
        return ref.location
    stem = Path(ref.location).stem if ref.kind == "gguf" else Path(ref.location).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-") or "reference"


def catalog_gguf(name: str, log) -> str:
    """A catalog model's shipped GGUF on this machine (fetched once into the cache, not dequantised)."""
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    return str(Path(fetch(ModelRef(name, "catalog", name), log=log, dequantise=False).gguf_path).resolve())


def reference_stack(ref: Source, log) -> tuple[dict, dict, str | None]:
    """(the spec's model entry, the reference stack {engine, dtype, attention}, the GGUF whose
    llama.cpp tokenizer cuts the text, or None for an HF checkpoint's own tokenizer)."""
    import backends
    from backends.base import CHECKPOINT, GGUF
    from store.gguf_meta import read_info

    name = model_name(ref)
    if ref.kind == "path":  # the checkpoint's default engine at its reference dtype (transformers: fp32)
        cls = backends.backend_class(backends.default_engine(CHECKPOINT))
        stack = {"engine": cls.engine, "dtype": cls.reference_dtype, "attention": cls.default_attention}
        return {"name": name, "path": ref.location}, stack, None
    gguf = ref.location if ref.kind == "gguf" else catalog_gguf(ref.location, log)
    # a GGUF's default engine, at the file's declared type, runs the file itself (matrix/spec/models.py fetch)
    cls = backends.backend_class(backends.default_engine(GGUF))
    declared = read_info(gguf).declared
    if declared not in cls.dtypes:
        raise UserError(
            f"--reference {ref.location}: the file declares quant type {declared}, which {cls.engine} "
            f"cells here do not name (one of {', '.join(sorted(cls.dtypes))})"
        )
    entry = {"name": name, "gguf": ref.location} if ref.kind == "gguf" else {"name": name, "catalog": ref.location}
    return entry, {"engine": cls.engine, "dtype": declared, "attention": cls.default_attention}, gguf


def context_limit(ref: Source, gguf: str | None) -> tuple[int, str] | None:
    """(the longest context the reference declares, where it declares it), or None where it declares
    none: a GGUF's `<arch>.context_length` (llama.cpp's n_ctx_train, src/llama-model.cpp), an HF
    checkpoint's config.json max_position_embeddings (its text_config's in a multimodal config)."""
    if gguf is not None:
        from common.gguf_header import read_header

        fields, _ = read_header(gguf, keep=lambda k: k == "general.architecture" or k.endswith(".context_length"))
        key = f"{fields.get('general.architecture')}.context_length"
        return (int(fields[key]), f"its {key}") if fields.get(key) else None
    path = Path(ref.location) / "config.json"
    try:
        config = json.loads(read_text_file(path, "the reference's config.json"))
    except json.JSONDecodeError as e:
        raise UserError(f"--reference {ref.location}: {path} is not JSON ({e})") from None
    for prefix, part in (("", config), ("text_config.", config.get("text_config"))):
        n = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, f"its config.json {prefix}max_position_embeddings"
    return None


def check_n_ctx(ref: Source, gguf: str | None, n_ctx: int) -> None:
    """--n-ctx within the context the reference declares: llama-perplexity only warns past it
    (tools/perplexity/perplexity.cpp: "model was trained on only %d context tokens"), but positions
    the model was never trained on measure the model's extrapolation, not the quant."""
    found = context_limit(ref, gguf)
    if found is not None and n_ctx > found[0]:
        file = f"{ref.location} ({gguf})" if ref.kind == "catalog" else ref.location
        raise UserError(f"--n-ctx {n_ctx}: the reference {file} supports at most {found[0]} tokens ({found[1]})")


def flag_options(given: dict[str, str | None]) -> dict:
    """{plug-in key: its flag's text} (`--kv-cache q8_0`) -> the candidates' engine options, each by
    its plug-in's reader (extras.Extra.from_flag); an engine's default is left out: the same cell
    as no flag, which the reference runs with."""
    flagged = {x.key for x in extras.options() if x.flag}
    unknown = sorted(k for k, v in given.items() if v is not None and k not in flagged)
    if unknown:
        raise UserError(f"options {', '.join(unknown)}: no such engine option (known: {', '.join(sorted(flagged))})")
    out = {}
    for x in extras.options():
        text = given.get(x.key)
        if text is not None:
            value = x.from_flag(text, lambda msg, x=x, text=text: UserError(f"{x.flag} {text}: {msg}"))
            if value is not None:
                out[x.key] = value
    return out


def candidate_entry(model: str, c: Source, log, options: dict | None = None) -> dict:
    """A candidate of the job's spec; options: the plug-ins' engine options it runs with (flag_options)."""
    more = dict(options or {})
    if more and c.kind == "path":
        x = next(x for x in extras.options() if x.key in more)
        raise UserError(
            f"{x.flag}: --candidate {c.location} is an HF checkpoint, and engine hf takes no option {x.key}"
        )
    if c.kind == "path":
        return {"model": model, "path": c.location, "name": c.label}
    gguf = c.location if c.kind == "gguf" else catalog_gguf(c.location, log)
    return {"model": model, "gguf": gguf, "name": c.label if c.kind == "gguf" else Path(gguf).name, **more}


def file_of(entry: dict) -> str:
    """A candidate entry's file or directory."""
    return entry.get("gguf") or entry["path"]


def candidate_key(entry: dict) -> str:
    """What tells a job's candidates apart: the file, and each plug-in's engine option it runs with
    where that is not the engine's default (the same file with another KV cache is another candidate)."""
    more = [
        f" ({x.key} {x.label(v)})"
        for x in extras.options()
        if (v := entry.get(x.key)) is not None and x.label(v) != x.label(x.default)
    ]
    return file_of(entry) + "".join(more)


def job_files(warehouse: str) -> tuple[Path, Path]:
    """(spec, corpus) next to a directory warehouse; for an object-store one (s3://..., gs://...),
    in this directory, named after the warehouse's last path part and a hash of its whole URL."""
    if "://" in warehouse:
        import hashlib

        url = warehouse.rstrip("/")
        tag = hashlib.sha256(url.encode()).hexdigest()[:8]
        base = Path.cwd() / f"{url.rsplit('/', 1)[-1] or 'warehouse'}-{tag}"
    else:
        base = Path(warehouse).resolve()
    return base.with_name(base.name + ".kld.yaml"), base.with_name(base.name + ".kld-corpus.yaml")


def corpus(text: Path, n_ctx: int, vocab: str | None, chunks: int | None = None) -> dict:
    """The job's corpus: the text cut into n_ctx-token chunks, the first `chunks` of them (None: every one)."""
    return {
        "name": "kld-text",
        "prompts": [
            {
                "id": "text",
                "category": "long_context",
                "source": text.name,
                "file": str(text),
                "chunks": n_ctx,
                **({"max_chunks": chunks} if chunks is not None else {}),
                **({"vocab": vocab} if vocab else {}),
            }
        ],
    }


def _limit(c: dict | None) -> int | None:
    return (c or {}).get("prompts", [{}])[0].get("max_chunks")


def _uncut(c: dict | None) -> dict | None:
    """The corpus without its chunk limit (compared on its own, as --chunks)."""
    if c is None:
        return None
    return {**c, "prompts": [{k: v for k, v in e.items() if k != "max_chunks"} for e in c.get("prompts") or []]}


def _same_job(old: dict, new: dict, old_corpus: dict | None, new_corpus: dict, spec_path: Path) -> None:
    """A warehouse holds one job: one reference, one text cut one way (its chunk length and how many
    of its chunks), one thread count, one choice of whose rows keep their values. Another is refused,
    naming what differs."""

    def text(c: dict | None) -> str:
        e = (c or {}).get("prompts", [{}])[0]
        return f"text {e.get('file')} in chunks of {e.get('chunks')}"

    def limit(n: int | None) -> str:
        return "every chunk of the text" if n is None else f"the first {n} chunks of the text"

    for flag, key, have, want in (
        ("--reference", "models", old.get("models"), new["models"]),
        ("--reference", "reference", old.get("reference"), new["reference"]),
        ("--threads", "threads", old.get("threads"), new["threads"]),
        ("--keep-rows", "keep_rows", old.get("keep_rows", "all"), new["keep_rows"]),
        ("--text / --n-ctx", "corpus", _uncut(old_corpus), _uncut(new_corpus)),
        ("--chunks", "max_chunks", _limit(old_corpus), _limit(new_corpus)),
    ):
        if have != want:
            if key in ("corpus", "max_chunks"):
                show = text if key == "corpus" else limit
                have, want = show(have), show(want)
            fix = (
                f"{'add' if have == 'all' else 'leave out'} --keep-rows, or use another --warehouse"
                if key == "keep_rows"
                else "use another --warehouse for another job"
            )
            raise UserError(f"{spec_path}: {key}: this warehouse's job has {have}, not {want} ({flag}); {fix}")


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


def _job_spec(entry: dict, stack: dict, threads: int, corpus_path: Path, keep_rows: bool, asked: list[dict]) -> dict:
    """The job's sweep spec: the reference's one stack, llama-perplexity's positions over the
    corpus, and the candidates asked for (an existing job's others are added by write_job)."""
    return {
        "name": "kld",
        "description": "matrix kld: KL(reference || candidate) over the scored half of each "
        "chunk, as llama-perplexity --kl-divergence",
        "models": [entry],
        "engines": [stack["engine"]],
        "dtypes": [stack["dtype"]],
        "attention": [stack["attention"]],
        "reference": stack,
        "repeats": 1,
        "threads": threads,
        "corpus": str(corpus_path),
        "positions": "llama_perplexity",
        "store": "bf16",
        "centroid": {"definition": "none"},
        "reference_metrics": "in_actor",
        "keep_rows": "all" if keep_rows else "references",
        "candidates": list(asked),
    }


def write_job(
    ref: Source,
    candidates: list[Source],
    text: Path,
    n_ctx: int,
    threads: int,
    warehouse: str,
    log,
    keep_rows: bool = False,
    chunks: int | None = None,
    options: dict | None = None,
) -> tuple[Path, list[dict], bool]:
    """Write (or extend) the spec and corpus next to the warehouse; -> (spec path, the candidate
    entries asked for this time, whether the spec is new). keep_rows: the candidates' rows keep
    their values too (keep_rows: all), not only the reference's; chunks: only the text's first
    chunks (llama-perplexity's --chunks), None for every chunk; options: the engine options this
    time's candidates run with (flag_options; {}: the engines' defaults, as the reference)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 4 or n_ctx % 2:
        raise UserError(f"--n-ctx {n_ctx}: must be an even context length >= 4 (the second half is scored)")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise UserError(f"--chunks {chunks}: must be a number of chunks >= 1 (leave it out for every chunk)")
    spec_path, corpus_path = job_files(warehouse)
    entry, stack, vocab = reference_stack(ref, log)
    check_n_ctx(ref, vocab, n_ctx)
    asked = [candidate_entry(entry["name"], c, log, options) for c in candidates]
    spec = _job_spec(entry, stack, threads, corpus_path, keep_rows, asked)
    new_corpus = corpus(text, n_ctx, vocab, chunks)
    new = not spec_path.is_file()
    if not new:
        old = yaml.safe_load(spec_path.read_text()) or {}
        _same_job(
            old, spec, yaml.safe_load(corpus_path.read_text()) if corpus_path.is_file() else None, new_corpus, spec_path
        )
        known = {candidate_key(c) for c in asked}
        spec["candidates"] = [c for c in old.get("candidates") or [] if candidate_key(c) not in known] + asked
    if vocab:  # the run tokenises the text with it first: that starts now, beside what comes before it
        import backends
        from backends.base import GGUF

        backends.for_files(GGUF).file_tokenize_ahead(vocab, read_text_file(text, "--text"))
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    _write(corpus_path, new_corpus)
    _write(spec_path, spec)
    return spec_path, asked, new


def forget(warehouse: str, files: set[str], drop_job: bool) -> None:
    """Take candidates whose cells did not complete (files: their candidate_key) out of the
    warehouse's job, so a refused file does not come back with every later call; drop_job: remove
    the job's files altogether (its reference never ran, so nothing of it is in the warehouse)."""
    spec_path, corpus_path = job_files(warehouse)
    if drop_job:
        spec_path.unlink(missing_ok=True)
        corpus_path.unlink(missing_ok=True)
        return
    if files:
        spec = yaml.safe_load(spec_path.read_text())
        spec["candidates"] = [c for c in spec.get("candidates") or [] if candidate_key(c) not in files]
        _write(spec_path, spec)
