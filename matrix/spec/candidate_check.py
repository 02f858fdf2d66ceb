"""A candidate's file checked against its reference model before anything runs, and what its
header declares for its cells row: a GGUF file (its architecture, sizes, vocabulary and special
tokens read by store/gguf_meta.py) or an HF checkpoint (its config and tokenizer). A file of
another model is one line naming what differs, exit 2.
"""

from __future__ import annotations

import functools

import backends
from backends.base import CHECKPOINT
from common import ids
from common.errors import UserError
from common.gguf_header import Strings
from common.stack import Cell
from matrix.spec.candidates import resolve
from store.gguf_meta import GgufInfo, read_info

# HF model_type -> the architecture name llama.cpp's converter writes, where they differ
GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}


@functools.lru_cache(maxsize=16)
def _hf_load(artifact: str):
    """(config, tokenizer) of an HF candidate, local or on the hub; read once per driver run (the
    check and the cells row both ask, and the directory is pinned by its digest at expand)."""
    import transformers

    where, kw = artifact, {}
    if artifact.startswith("hub:"):
        where, rev = ids.split_hub_artifact(artifact)
        kw = {"revision": rev}
    try:
        return (
            transformers.AutoConfig.from_pretrained(where, **kw),
            transformers.AutoTokenizer.from_pretrained(where, **kw),
        )
    except OSError as e:
        raise UserError(
            f"candidate {artifact}: cannot read its config and tokenizer: {str(e).splitlines()[0]}"
        ) from None


def _is_checkpoint(cell: Cell) -> bool:
    """An HF checkpoint (a directory or a hub id), not a GGUF file: what the cell's engine runs
    as given (Backend.runs_files) decides, so an HF checkpoint under vLLM is read as one too."""
    return CHECKPOINT in backends.backend_class(cell.engine).runs_files


def header_facts(cell: Cell, model) -> dict:
    """What the candidate's file declares, for its cells row's recipe."""
    if _is_checkpoint(cell):
        config, _ = _hf_load(resolve(cell, model).artifact)
        q = getattr(config, "quantization_config", None)
        return {
            "kind": "hf checkpoint",
            "model_type": config.model_type,
            "config_dtype": str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)),
            "quantization_config": q if isinstance(q, dict) else (q.to_dict() if q is not None else None),
        }
    path = resolve(cell, model).artifact
    info = read_info(path)
    facts = {"declared_quant": info.declared, "gguf_name": info.name, "imatrix": info.imatrix or None}
    # a file this machine's llama.cpp quantised with per-tensor types (matrix attribute): the
    # --tensor-type lines that rebuild it, from its recipe in the artifact cache
    lines = (backends.built_recipe(path) or {}).get("tensor_types")
    return {**facts, "tensor_types": lines} if lines else facts


# SentencePiece writes a space inside a piece as U+2581 (github.com/google/sentencepiece README,
# "Whitespace is treated as a basic symbol"). A GGUF of a SentencePiece vocabulary holds a normal
# piece that way, and a user-defined one with spaces: llama.cpp's converter turns its U+2581 into
# spaces (convert_hf_to_gguf.py _create_vocab_sentencepiece, "pre-normalize user-defined spaces"),
# and llama.cpp's detokenizer gives a space for both (src/llama-vocab.cpp token_to_piece:
# llama_unescape_whitespace on a normal piece, a user-defined one as written). So one id may be
# written both ways by two files of one model (Gemma 3: '  ' in the published file, '▁▁' in one
# converted through a tokenizer.json); the two are one token. Nothing else is taken as the same:
# a byte piece (<0x0A>) is written alike in both (measured on Gemma 3).
_SPACE = str.maketrans({"\u2581": " "})


def first_difference(tokens: list[str], reference: list[str]) -> int | None:
    """The first id whose token differs from the reference's once a space written as U+2581 and
    one written as a space count as one (None: every id the same)."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b and a.translate(_SPACE) != b.translate(_SPACE)),
        None,
    )


def hf_differences(cand_config, cand_tok, config, tok) -> list[str]:
    """What an HF candidate has that the reference model has not (empty: the same model)."""
    out = []
    if cand_config.model_type != config.model_type:
        out.append(f"architecture {cand_config.model_type} (reference: {config.model_type})")
    for what, attr in (
        ("layers", "num_hidden_layers"),
        ("hidden size", "hidden_size"),
        ("attention heads", "num_attention_heads"),
        ("vocab_size", "vocab_size"),
    ):
        got, want = getattr(cand_config, attr, None), getattr(config, attr, None)
        if got is not None and want is not None and int(got) != int(want):
            out.append(f"{what} {got} (reference: {want})")
    if len(cand_tok) != len(tok):
        out.append(f"tokenizer of {len(cand_tok)} tokens (reference: {len(tok)})")
    else:
        ids = list(range(len(tok)))
        got, want = cand_tok.convert_ids_to_tokens(ids), tok.convert_ids_to_tokens(ids)
        first = first_difference(got, want)
        if first is not None:
            out.append(f"tokenizer: token {first} is {got[first]!r} (reference: {want[first]!r})")
    for what, got, want in (
        ("BOS", cand_tok.bos_token_id, tok.bos_token_id),
        ("EOS", cand_tok.eos_token_id, tok.eos_token_id),
    ):
        if got != want:
            out.append(f"{what} id {got} (reference: {want})")
    return out


def differences(info: GgufInfo, config, tok, vocab: int) -> list[str]:
    """What the file has that the reference model has not (empty: the same model)."""
    out = []
    want_arch = GGUF_ARCH.get(config.model_type, config.model_type)
    if info.architecture != want_arch:
        out.append(f"architecture {info.architecture} (reference: {config.model_type})")
    for what, got, want in (
        ("layers", info.block_count, getattr(config, "num_hidden_layers", None)),
        ("hidden size", info.embedding_length, getattr(config, "hidden_size", None)),
        ("attention heads", info.head_count, getattr(config, "num_attention_heads", None)),
    ):
        if got is not None and want is not None and int(got) != int(want):
            out.append(f"{what} {got} (reference: {want})")
    if len(info.tokens) != vocab:
        out.append(f"vocabulary of {len(info.tokens)} tokens (reference: {vocab})")
    elif not _same_vocabulary(info, tok):
        ref_tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
        first = first_difference(list(info.tokens), ref_tokens)
        if first is not None:
            out.append(f"tokenizer: token {first} is {info.tokens[first]!r} (reference: {ref_tokens[first]!r})")
    for what, got, want in (("BOS", info.bos, tok.bos_token_id), ("EOS", info.eos, tok.eos_token_id)):
        if got is not None and want is not None and int(got) != int(want):
            out.append(f"{what} id {got} (reference: {want})")
    return out


def _same_vocabulary(info: GgufInfo, tok) -> bool:
    """Whether a GGUF reference's vocabulary is the candidate's byte for byte: then equal without
    decoding either (a file of another tokenizer's spelling goes through first_difference)."""
    ref = getattr(getattr(tok, "info", None), "tokens", None)
    return isinstance(ref, Strings) and ref == info.tokens


def check(cell: Cell, config, tok, vocab: int) -> None:
    """Refuse a candidate that is not a file of its reference model, before anything runs."""
    if _is_checkpoint(cell):
        diff = hf_differences(*_hf_load(cell.artifact), config, tok)
    else:
        diff = differences(read_info(cell.artifact), config, tok, vocab)
    if diff:
        raise UserError(f"candidate {cell.artifact}: not a file of model {cell.model}: " + "; ".join(diff))
