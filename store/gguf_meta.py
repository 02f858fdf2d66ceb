"""What a GGUF file says about itself, from its header: architecture, sizes, vocabulary, special
tokens, the quant type it declares, and the importance matrix llama-quantize recorded (if any).

Read with gguf-py's reader (a memory map; no tensor data is read), so a published file can be
checked against a model before any engine loads it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import UserError


@dataclass(frozen=True)
class GgufInfo:
    path: str
    architecture: str
    name: str | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    tokens: tuple[str, ...]  # the vocabulary, by id
    bos: int | None
    eos: int | None
    declared: str  # the quant type the file declares (general.file_type), in the spec's dtype names
    imatrix: dict[str, Any] = field(default_factory=dict)  # quantize.imatrix.* keys, when llama-quantize wrote them


def _value(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


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
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def read_info(path: str | Path) -> GgufInfo:
    """The header's facts; a file read again unchanged (same size and mtime) is not parsed again:
    the driver asks for a candidate's header at expand, at the check and for its cells row."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"{path}: not a readable GGUF file ({e})") from None
    return _read_info(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_info(path: str, _size: int, _mtime_ns: int) -> GgufInfo:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _value(reader, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise UserError(f"{path}: GGUF header has no {gguf.Keys.General.ARCHITECTURE}")
    llm = lambda k: _value(reader, k.format(arch=arch))  # noqa: E731
    return GgufInfo(
        path=str(path), architecture=arch, name=_value(reader, gguf.Keys.General.NAME),
        block_count=llm(gguf.Keys.LLM.BLOCK_COUNT), embedding_length=llm(gguf.Keys.LLM.EMBEDDING_LENGTH),
        head_count=llm(gguf.Keys.Attention.HEAD_COUNT),
        tokens=tuple(_value(reader, gguf.Keys.Tokenizer.LIST) or ()),
        bos=_value(reader, gguf.Keys.Tokenizer.BOS_ID), eos=_value(reader, gguf.Keys.Tokenizer.EOS_ID),
        declared=declared_quant(_value(reader, gguf.Keys.General.FILE_TYPE)),
        imatrix={k.removeprefix("quantize.imatrix."): f.contents() for k, f in reader.fields.items()
                 if k.startswith("quantize.imatrix.")})
