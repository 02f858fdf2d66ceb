"""A GGUF with only its first N blocks, the kept tensors' bytes copied as they are.

The cut keeps the source's own quantisation (no requantisation), so a model dequantised from it
has exactly the reference weights of those layers: a real model small enough to carry to a
machine without a model hub (a Q4_1 SmolLM2 cut to 1 block is 20 MB, its bf16 HF copy 56 MB).
"""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import UserError


def _block(name: str) -> int | None:
    """'blk.12.attn_q.weight' -> 12; None for tensors outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else None


def cut_gguf(src: Path, out: Path, layers: int) -> Path:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    blocks = reader.fields[count_key].contents()
    if not 1 <= layers <= blocks:
        raise UserError(f"{src}: --layers must be between 1 and {blocks}, got {layers}")
    tmp = out.with_name(f".tmp-{out.name}")
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if (_block(t.name) is None or _block(t.name) < layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, out)  # a reader sees the whole file or none
    return out
