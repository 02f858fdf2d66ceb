"""llama-cpp-python helpers below the llama.cpp backend, for it and for the tools that build its
weights (backends/gguf_imatrix.py): quiet logs, a vocabulary-only load, llama.cpp's tokenizer."""

from __future__ import annotations

_LOG_CB = None  # keep the ctypes callback alive for the life of the process


def quiet_logs() -> None:
    """llama.cpp prints every tensor and graph node at load; keep only errors (to stderr)."""
    global _LOG_CB
    import ctypes
    import sys

    import llama_cpp

    if _LOG_CB is None:
        def cb(level, text, _user):
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode(errors="replace"))

        _LOG_CB = llama_cpp.llama_log_callback(cb)
        llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def load_vocab(path: str):
    """A vocab-only llama.cpp model (e.g. models/ggml-vocab-*.gguf): (model, vocab)."""
    import llama_cpp as lc

    quiet_logs()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        from common.errors import UserError

        raise UserError(f"{path}: llama.cpp could not load this GGUF")
    return model, lc.llama_model_get_vocab(model)


def tokenize_with(vocab, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama_tokenize; add_special adds BOS/EOS only where the GGUF says the model wants them."""
    import llama_cpp as lc

    raw = text.encode()
    buf = (lc.llama_token * (len(raw) + 8))()
    n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
    if n < 0:
        buf = (lc.llama_token * (-n))()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
    return list(buf[:n])


def gguf_tokenize(path: str, text: str) -> tuple[list[int], int | None]:
    """A text as llama-perplexity tokenises it (common_tokenize(ctx, text, true): add_special on,
    parse_special off), with only the GGUF's vocabulary loaded; -> (ids, the BOS it puts at the
    start of each chunk, or None where the GGUF says the model takes no BOS)."""
    import llama_cpp as lc

    quiet_logs()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        from common.errors import UserError

        raise UserError(f"{path}: llama.cpp could not read this GGUF's vocabulary")
    try:
        vocab = lc.llama_model_get_vocab(model)
        ids = tokenize_with(vocab, text, True, False)
        return ids, int(lc.llama_vocab_bos(vocab)) if lc.llama_vocab_get_add_bos(vocab) else None
    finally:
        lc.llama_model_free(model)
