"""A GGUF-sourced model as the driver sees it, from the file's header alone, for a job that never
uses its Hugging Face tokenizer: every cell of the model runs llama.cpp, every text is tokenised by
llama.cpp (`vocab:`) or given as ids, and no imatrix text is tokenised. Such a job (llama-perplexity's,
`matrix kld`'s) then imports neither transformers nor torch in the driver.
"""

from __future__ import annotations

from types import SimpleNamespace

import backends
from backends.base import GGUF
from store.gguf_meta import GgufInfo, read_info


class GgufTokenizer:
    """The part of a transformers tokenizer the driver asks of a model, answered from the GGUF's
    vocabulary; tokenising goes through llama.cpp's own tokenizer."""

    chat_template = None  # a chat entry makes the job need the HF tokenizer (hf_free)

    def __init__(self, info: GgufInfo):
        self.info = info
        self.bos_token_id, self.eos_token_id = info.bos, info.eos

    def __len__(self) -> int:
        return len(self.info.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.info.tokens[i] for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.info.tokens)}

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids, bos = backends.for_files(GGUF).file_tokenize(self.info.path, text)
        if not add_special_tokens and bos is not None and ids[:1] == [bos]:
            ids = ids[1:]
        return SimpleNamespace(input_ids=ids)


def config(info: GgufInfo) -> SimpleNamespace:
    """The config fields the driver reads, in transformers' names (model_type is the GGUF architecture)."""
    return SimpleNamespace(
        model_type=info.architecture,
        num_hidden_layers=info.block_count,
        hidden_size=info.embedding_length,
        num_attention_heads=info.head_count,
        vocab_size=len(info.tokens),
        text_config=None,
    )


def hf_free(matrix, model: str) -> bool:
    """Whether this model's part of the job can be prepared from its GGUF header alone: the model
    comes from a GGUF (a file or a catalog entry), every cell runs llama.cpp on that file itself or
    on a candidate's file (no conversion from dequantised weights), and no text needs the HF tokenizer."""
    from matrix.spec.corpus import load_entries
    from matrix.spec.models import CATALOG

    ref = matrix.spec.models[model]
    if ref.kind == "gguf":
        own = read_info(ref.location).declared
    elif ref.kind == "catalog":
        own = CATALOG[ref.location].source_quant
    else:
        return False
    cells = [c for c in matrix.cells if c.model == model]
    runs_gguf = backends.running(GGUF)
    if not cells or any(
        c.engine not in runs_gguf or c.opts.get("imatrix") or (c.artifact is None and c.dtype != own) for c in cells
    ):
        return False
    _, entries = load_entries(matrix.spec.corpus)
    return all(e.chat is None and (e.vocab is not None or e.ids is not None) for e in entries)


def load(gguf_path: str) -> tuple[GgufTokenizer, SimpleNamespace]:
    info = read_info(gguf_path)
    return GgufTokenizer(info), config(info)
