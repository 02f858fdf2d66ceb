"""A GGUF whose tensors come from two files of one model: the header fields of the first as its bytes
are, each tensor's type and bytes from the second where asked, else from the first (GGUF layout:
github.com/ggml-org/ggml docs/gguf.md).

llama.cpp's quantiser copies a tensor already in the type it would give it, byte for byte
(src/llama-quant.cpp: `quantize = cur_type != new_type`). So a recipe's variant quantised from the
float reference spliced with the base's tensors that keep their type is the file a quantisation from
the reference alone writes, with only the changed tensors quantised.
"""

from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path

from common.gguf_header import nbytes, tensor_table


def splice(first: str | Path, second: str | Path, taken: set[str], out: str | Path) -> Path:
    """`first`'s header fields and tensor order; the tensors named in `taken` from `second` (type and
    bytes), every other from `first`; written to `out`."""
    lay, t1 = tensor_table(first)
    lay2, t2 = tensor_table(second)
    pad = lambda n: (-n) % lay.alignment  # noqa: E731 - GGUF pads the table and every tensor to it
    infos, spans, offset = [], [], 0
    for name, (shape, ttype, off) in t1.items():
        which, start, ttype = (
            (1, lay2.data_offset + t2[name][2], t2[name][1]) if name in taken else (0, lay.data_offset + off, ttype)
        )
        size = nbytes(math.prod(shape), ttype)
        raw = name.encode()
        infos.append(struct.pack(f"<Q{len(raw)}sI{len(shape)}QIQ", len(raw), raw, len(shape), *shape, ttype, offset))
        spans.append((which, start, size))
        offset += size + pad(size)
    with open(first, "rb") as f1, open(second, "rb") as f2, open(out, "wb", buffering=0) as o:
        o.write(f1.read(lay.tensor_infos[0]))  # magic, version, counts and every key/value pair, as they are
        table = b"".join(infos)
        o.write(table + b"\0" * pad(lay.tensor_infos[0] + len(table)))
        for which, start, size in spans:
            _copy((f1, f2)[which], o, start, size)
            o.write(b"\0" * pad(size))
    return Path(out)


def _copy(src, out, start: int, size: int) -> None:
    """size bytes of src from start onto out: file to file in the kernel on Linux (sendfile takes a
    file there; elsewhere it wants a socket), through a buffer elsewhere."""
    done = 0
    while done < size:
        if sys.platform.startswith("linux"):
            n = os.sendfile(out.fileno(), src.fileno(), start + done, size - done)
        else:
            src.seek(start + done)
            n = out.write(src.read(min(size - done, 1 << 24)))
        if n == 0:
            raise ValueError(f"{src.name}: a tensor's data runs past the end of the file")
        done += n
