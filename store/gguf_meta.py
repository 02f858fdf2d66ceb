"""What a GGUF file says about itself, from its header: architecture, sizes, vocabulary, special
tokens, the quant type it declares, and the importance matrix llama-quantize recorded (if any).

Read from the header bytes (common/gguf_header.py; no tensor data is read), so a published file can
be checked against a model before any engine loads it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.gguf_header import Strings


@dataclass(frozen=True)
class GgufInfo:
    path: str
    architecture: str
    name: str | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    tokens: Strings  # the vocabulary, by id (a sequence of str, decoded on first read)
    bos: int | None
    eos: int | None
    declared: str  # the quant type the file declares (general.file_type), in the spec's dtype names
    imatrix: dict[str, Any] = field(default_factory=dict)  # quantize.imatrix.* keys, when llama-quantize wrote them


def declared_quant(file_type: int | None) -> str:
    """general.file_type -> 'q4_k_m', 'f16', ... ('unknown' when absent; a guessed type is still named)."""
    import gguf

    if file_type is None:
        return "unknown"
    ft = int(file_type) & ~1024  # LLAMA_FTYPE_GUESSED: set when the converter inferred the type
    try:
        name = gguf.LlamaFileType(ft).name
    except ValueError:
        return f"file_type_{ft}"
    name = name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    return {"f32": "fp32"}.get(name, name)  # the spec's name for float32


def read_info(path: str | Path) -> GgufInfo:
    """The header's facts; a file read again unchanged (same size and mtime) is not parsed again:
    the driver asks for a candidate's header at expand, at the check and for its cells row."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"{path}: not a readable GGUF file ({e})") from None
    return _read_info(str(path), st.st_size, st.st_mtime_ns)


_ARCH_KEYS = (".block_count", ".embedding_length", ".attention.head_count")
_KEYS = {
    "general.architecture",
    "general.name",
    "general.file_type",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
}


@functools.lru_cache(maxsize=64)
def _read_info(path: str, _size: int, _mtime_ns: int) -> GgufInfo:
    from common.gguf_header import read_header

    def keep(k: str):
        if k == "tokenizer.ggml.tokens":
            return "bytes"  # decoded where a token is read, never for its length or a file's equal vocabulary
        return k in _KEYS or k.startswith("quantize.imatrix.") or k.endswith(_ARCH_KEYS)

    f, _ = read_header(path, keep=keep)
    arch = f.get("general.architecture")
    if not arch:
        raise UserError(f"{path}: GGUF header has no general.architecture")
    return GgufInfo(
        path=str(path),
        architecture=arch,
        name=f.get("general.name"),
        block_count=f.get(f"{arch}.block_count"),
        embedding_length=f.get(f"{arch}.embedding_length"),
        head_count=f.get(f"{arch}.attention.head_count"),
        tokens=f.get("tokenizer.ggml.tokens") or Strings(b"", 0),
        bos=f.get("tokenizer.ggml.bos_token_id"),
        eos=f.get("tokenizer.ggml.eos_token_id"),
        declared=declared_quant(f.get("general.file_type")),
        imatrix={k.removeprefix("quantize.imatrix."): v for k, v in f.items() if k.startswith("quantize.imatrix.")},
    )
