"""The tokenizer / BOS parity gate on real vocabularies.

llama.cpp's vocab-only test models (models/ggml-vocab-*.gguf in the
llama-cpp-python sdist) with their .inp/.out vectors, against HF tokenizers
built by transformers from the same files.
"""

from __future__ import annotations

import pytest

from actors.parity import diagnose

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def vocab_dir():
    from backends.gguf_build import tools_dir

    return tools_dir() / "models"


def vectors(vocab_dir, name):
    inp = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")[:-1]
    out = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")[: len(inp)]
    return list(zip(inp, ([int(x) for x in line.split()] for line in out)))


def llama_vocab(vocab_dir, name):
    from backends.llamacpp_backend import load_vocab

    return load_vocab(str(vocab_dir / f"ggml-vocab-{name}.gguf"))[1]


def hf_tokenizer(vocab_dir, name):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(vocab_dir, gguf_file=f"ggml-vocab-{name}.gguf")


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "gpt-2", "phi-3", "llama-spm"])
def test_llamacpp_tokenizer_reproduces_its_own_vectors(vocab_dir, name):
    from backends.llamacpp_backend import tokenize_with

    vocab = llama_vocab(vocab_dir, name)
    cases = vectors(vocab_dir, name)
    bad = [t for t, ids in cases if tokenize_with(vocab, t, add_special=False, parse_special=False) != ids]
    assert len(cases) > 30 and not bad, bad[:3]


@pytest.mark.parametrize("name, min_agree", [("llama-bpe", 45), ("qwen2", 46), ("gpt-2", 46), ("phi-3", 46)])
def test_hf_tokenizer_from_the_same_gguf_agrees_and_the_gate_names_each_miss(vocab_dir, name, min_agree):
    tok = hf_tokenizer(vocab_dir, name)
    cases = vectors(vocab_dir, name)
    verdicts = [
        diagnose(ids, tok(t, add_special_tokens=False).input_ids, tok.bos_token_id, len(tok)) for t, ids in cases
    ]
    assert sum(v.match for v in verdicts) >= min_agree
    # a miss is a real tokenisation difference, never mistaken for a BOS slip
    assert {v.diagnosis for v in verdicts if not v.match} <= {"different ids"}


def test_bos_asymmetry_is_detected(vocab_dir):
    """Engine defaults: llama.cpp adds BOS for llama-bpe, not for gpt-2 or qwen2."""
    from backends.llamacpp_backend import tokenize_with

    text = "Hello world, this is a test."
    got = {}
    for name in ("llama-bpe", "gpt-2", "qwen2"):
        tok = hf_tokenizer(vocab_dir, name)
        canonical = tok(text, add_special_tokens=False).input_ids
        engine = tokenize_with(llama_vocab(vocab_dir, name), text)  # llama.cpp default call
        got[name] = diagnose(canonical, engine, tok.bos_token_id, len(tok))
    assert got["llama-bpe"].diagnosis == "extra BOS" and got["llama-bpe"].first_diff == 0
    assert got["gpt-2"].diagnosis == "ok" and got["qwen2"].diagnosis == "ok"


def test_doubled_bos_is_caught(vocab_dir):
    """Text that already carries BOS (a chat template emits it) + an engine that adds one."""
    from backends.llamacpp_backend import tokenize_with

    tok = hf_tokenizer(vocab_dir, "llama-bpe")
    text = tok.bos_token + "The quick brown fox."
    canonical = tok(text, add_special_tokens=False).input_ids  # BOS once, from the text
    assert canonical[0] == tok.bos_token_id
    engine = tokenize_with(llama_vocab(vocab_dir, "llama-bpe"), text)
    v = diagnose(canonical, engine, tok.bos_token_id, len(tok))
    assert engine[:2] == [tok.bos_token_id] * 2
    assert (v.match, v.diagnosis, v.first_diff) == (False, "double BOS", 1)


def test_a_different_tokenizer_is_caught(vocab_dir):
    from backends.llamacpp_backend import tokenize_with

    gpt2 = hf_tokenizer(vocab_dir, "gpt-2")
    text = "Tokenizers differ: 日本語のテキスト and ünïcödé."
    canonical = gpt2(text, add_special_tokens=False).input_ids
    qwen = tokenize_with(llama_vocab(vocab_dir, "qwen2"), text)
    v = diagnose(canonical, qwen, gpt2.bos_token_id, len(gpt2))
    assert not v.match and v.diagnosis in {"vocab mismatch", "different ids"}
    v2 = diagnose(
        canonical,
        tokenize_with(llama_vocab(vocab_dir, "llama-bpe"), text, add_special=False),
        gpt2.bos_token_id,
        len(gpt2),
    )
    assert v2.diagnosis == "vocab mismatch"  # llama-bpe ids run past gpt-2's 50257


def test_diagnose_unit_cases():
    assert diagnose([1, 5, 6], [1, 5, 6], 1, 10).diagnosis == "ok"
    assert diagnose([1, 5, 6], [1, 1, 5, 6], 1, 10).diagnosis == "double BOS"
    assert diagnose([5, 6], [1, 5, 6], 1, 10).diagnosis == "extra BOS"
    assert diagnose([1, 5, 6], [5, 6], 1, 10).diagnosis == "missing BOS"
    assert diagnose([5, 6, 7], [5, 8, 7], 1, 10) == diagnose([5, 6, 7], [5, 8, 7], None, None)
    assert diagnose([5, 6, 7], [5, 8, 7], 1, 10).first_diff == 1
    assert diagnose([5, 6], [5, 60], 1, 10).diagnosis == "vocab mismatch"
