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


# GGUF value types (gguf-py's GGUFValueType) -> fixed size in bytes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_table(path: str | Path) -> list[tuple[str, int]]:
    """(name, ggml type id) of every tensor, from the header alone. gguf-py's reader builds a numpy
    view per vocabulary entry (~3 s per call on a 49k vocabulary); this walks the bytes once (~0.1 s)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise UserError(f"{path}: not a GGUF file (magic {bytes(m[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise UserError(f"{path}: GGUF version {version} (this reader reads 2 and later)")
        at = 24

        def skip(vtype: int, at: int) -> int:
            if vtype in _FIXED:
                return at + _FIXED[vtype]
            if vtype == 8:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if etype in _FIXED:
                    return at + count * _FIXED[etype]
                for _ in range(count):
                    at = skip(etype, at)
                return at
            raise UserError(f"{path}: GGUF value type {vtype} at byte {at} is not one GGUF defines")

        for _ in range(n_kv):
            at += 8 + struct.unpack_from("<Q", m, at)[0]  # the key
            (vtype,) = struct.unpack_from("<I", m, at)
            at = skip(vtype, at + 4)
        out = []
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", m, at)
            name = m[at + 8:at + 8 + n].decode()
            at += 8 + n
            (dims,) = struct.unpack_from("<I", m, at)
            at += 4 + 8 * dims
            (ttype,) = struct.unpack_from("<I", m, at)
            out.append((name, ttype))
            at += 4 + 8  # the type, then the data offset
        return out
