"""A GGUF's vocabulary kept beside the checkpoint dequantised from it, and put back into every GGUF
llama.cpp's converter makes from that checkpoint, so a converted file tokenises as the source does.

transformers dequantises a GGUF into a checkpoint whose tokenizer is a tokenizers-library
tokenizer.json, with no SentencePiece tokenizer.model. From such a directory llama.cpp's
converter (convert_hf_to_gguf.py; Gemma 3's set_vocab in conversion/gemma.py) writes a BPE
vocabulary (`tokenizer.ggml.model` gpt2), so a SentencePiece source (`llama`) comes back as
another kind of vocabulary: for Gemma 3 270M the user-defined whitespace pieces (ids 138-167) are
written with SentencePiece's U+2581 instead of spaces and typed normal instead of user-defined,
byte pieces typed normal, and llama.cpp (src/llama-vocab.cpp) cuts a run of 40 spaces into other
ids than it does with the source. A tokenizer.model rebuilt from the GGUF does not bring it back
either: the converter (conversion/base.py _create_vocab_sentencepiece) takes user-defined types
only from added_tokens.json or tokenizer_config.json's added_tokens_decoder (transformers writes
added tokens into tokenizer.json instead), so Gemma 3's 165 user-defined pieces (runs of newlines
and of spaces among them) come back typed normal, and llama.cpp cuts text around them into other
ids (measured: 4 of 12 texts with runs of spaces). So the source's `tokenizer.ggml.*` fields are kept
byte for byte in a vocabulary-only GGUF beside the checkpoint (VOCAB_FILE, the form of llama.cpp's
models/ggml-vocab-*.gguf), and replace the converter's own in each converted file.

A `gpt2` (byte-level BPE) vocabulary comes back whole through tokenizer.json (SmolLM2-135M: every
`tokenizer.ggml.*` field the same but add_space_prefix, which llama.cpp's BPE tokenizer does not
read: src/llama-vocab.cpp), so none is kept for it.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
from pathlib import Path

from common.errors import UserError
from common.gguf_header import Layout, layout, read_header

VOCAB_FILE = "ggml-vocab.gguf"
PREFIX = "tokenizer.ggml."
ROUND_TRIPS = {"gpt2"}  # tokenizer.ggml.model values the dequantised checkpoint carries whole


def tokenizer_model(path: str | Path) -> str | None:
    """The file's tokenizer.ggml.model (llama: SentencePiece, gpt2: byte-level BPE, ...)."""
    return read_header(path, keep=lambda key: key == PREFIX + "model")[0].get(PREFIX + "model")


def keep_vocabulary(source: Path, hf_dir: Path) -> bool:
    """Write the source GGUF's vocabulary beside the checkpoint dequantised from it (hf_dir /
    VOCAB_FILE) unless the checkpoint carries it whole; -> whether the file is there."""
    out = Path(hf_dir) / VOCAB_FILE
    if out.is_file():
        return True
    kind = tokenizer_model(source)
    if kind is None or kind in ROUND_TRIPS:
        return False
    tmp = out.with_name(f".{VOCAB_FILE}.{os.getpid()}.tmp")
    try:
        _write_vocabulary(Path(source), tmp)
        os.replace(tmp, out)  # atomic: a reader sees the whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _write_vocabulary(source: Path, out: Path) -> None:
    """A vocabulary-only GGUF: the source's general.architecture and tokenizer.ggml.* fields, no tensors."""
    lay = layout(source)
    spans = [(s, e) for k, s, e in lay.fields if k == "general.architecture" or k.startswith(PREFIX)]
    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, open(out, "wb") as o:
        o.write(b"GGUF" + struct.pack("<IQQ", lay.version, 0, len(spans)))
        for s, e in spans:
            o.write(m[s:e])


def _token_count(path: Path, m: mmap.mmap, lay: Layout) -> int:
    """How many entries tokenizer.ggml.tokens has, read from its array header."""
    span = next((s for k, s, _ in lay.fields if k == PREFIX + "tokens"), None)
    if span is None:
        raise UserError(f"{path}: {PREFIX}tokens: missing")
    (n_key,) = struct.unpack_from("<Q", m, span)
    return struct.unpack_from("<Q", m, span + 8 + n_key + 4 + 4)[0]  # key, value type, element type, count


def with_vocabulary(converted: Path, vocab: Path, out: Path) -> None:
    """converted's fields and tensors, its tokenizer.ggml.* fields replaced by vocab's, written to
    out. Tensor offsets count from the start of the data section, so the tensor table and the data
    are copied as they are, behind the new fields and the padding to the file's alignment."""
    lay, voc = layout(converted), layout(vocab)
    with (
        open(converted, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
        open(vocab, "rb") as g,
        mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ) as v,
    ):
        have, want = _token_count(converted, m, lay), _token_count(vocab, v, voc)
        if have != want:
            raise UserError(
                f"{vocab}: {PREFIX}tokens: {want} tokens, but the model converted beside it ({converted}) has {have}"
            )
        kept = [(m, s, e) for k, s, e in lay.fields if not k.startswith(PREFIX)]
        added = [(v, s, e) for k, s, e in voc.fields if k.startswith(PREFIX)]
        with open(out, "wb") as o:
            o.write(b"GGUF" + struct.pack("<IQQ", lay.version, lay.n_tensors, len(kept) + len(added)))
            for src, s, e in kept + added:
                o.write(src[s:e])
            o.write(m[lay.tensor_infos[0] : lay.tensor_infos[1]])
            o.write(b"\0" * (-o.tell() % lay.alignment))
            f.seek(lay.data_offset)
            shutil.copyfileobj(f, o, 1 << 24)
