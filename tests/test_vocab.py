"""One vocabulary, however a file writes it: the candidate check's comparison (a space written as
U+2581 or as a space is one token, any other difference refused by id), and the source GGUF's
vocabulary kept beside a dequantised checkpoint and put back into the GGUFs converted from it.
The Gemma 3 270M tests run the catalog's published Q4_K_M against the F16 converted here."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from backends.gguf_vocab import VOCAB_FILE, keep_vocabulary, with_vocabulary
from common.errors import UserError
from common.gguf_header import read_header
from matrix.spec.candidate_check import differences, first_difference

# raw texts llama.cpp tokenises: runs of spaces (40: past Gemma 3's longest whitespace piece, 31),
# digits after spaces, newlines, tabs, non-ASCII, and a special token's text read as plain text
TEXTS = (
    "Hello world",
    "a  b   c    d",
    "x" + " " * 40 + "y",
    "  leading and trailing   ",
    "in 2024 and  12 345, 6.78e-9",
    "line1\nline2\n\n\nline3\r\n",
    "\n\n  \n\t\tx",
    "naïve café — 東京 🙂 Ωμέγα ÅÄÖ",
    "def f(x):\n    return x  # two",
    "<start_of_turn>user",
)


def _gguf(path: Path, tokens: list[str], kind: str, **kv) -> Path:
    """A small GGUF written by gguf-py: a tokenizer, a few other fields and two tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    for key, value in kv.items():
        w.add_string(key, value)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.full(40, 0.5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_space_written_as_u2581_is_the_same_token_and_any_other_difference_is_named_by_id():
    ref = ["<bos>", "▁▁", "▁the", "<0x0A>", "\n\n"]
    assert first_difference(["<bos>", "  ", " the", "<0x0A>", "\n\n"], ref) is None
    assert first_difference(["<bos>", "  ", "▁tho", "<0x0A>", "\n\n"], ref) == 2
    assert (
        first_difference(["<bos>", "▁▁", "▁the", "Ċ", "\n\n"], ref) == 3
    )  # GPT-2's byte for 0x0A is another token here


def test_the_check_refuses_a_vocabulary_that_differs_in_one_id(tmp_path):
    from matrix.spec.gguf_model import load
    from store.gguf_meta import read_info

    ref = _gguf(tmp_path / "ref.gguf", ["<bos>", "▁▁", "▁the", "a"], "gpt2")
    tok, config = load(str(ref))
    same = _gguf(tmp_path / "same.gguf", ["<bos>", "  ", " the", "a"], "llama")
    assert differences(read_info(same), config, tok, len(tok)) == []
    other = _gguf(tmp_path / "other.gguf", ["<bos>", "  ", " the", "b"], "llama")
    assert differences(read_info(other), config, tok, len(tok)) == ["tokenizer: token 3 is 'b' (reference: 'a')"]


def test_a_vocabulary_written_byte_for_byte_as_the_references_is_equal_without_decoding(tmp_path):
    from matrix.spec.gguf_model import load
    from store.gguf_meta import read_info

    words = ["<bos>", "▁▁", "▁the", "a"]
    ref = _gguf(tmp_path / "ref.gguf", words, "gpt2")
    tok, config = load(str(ref))
    twin = read_info(_gguf(tmp_path / "twin.gguf", words, "gpt2"))
    assert differences(twin, config, tok, len(tok)) == []
    assert twin.tokens._decoded is None and tok.info.tokens._decoded is None  # neither decoded
    assert list(twin.tokens) == words and twin.tokens == tuple(words)  # and read as the strings they are


def test_a_sentencepiece_vocabulary_is_kept_beside_the_checkpoint_and_a_gpt2_one_is_not(tmp_path):
    spm = _gguf(tmp_path / "spm.gguf", ["<unk>", "▁a", "  "], "llama", **{"tokenizer.ggml.pre": "default"})
    bpe = _gguf(tmp_path / "bpe.gguf", ["<unk>", "Ġa"], "gpt2")
    (tmp_path / "hf-spm").mkdir()
    (tmp_path / "hf-bpe").mkdir()
    assert keep_vocabulary(spm, tmp_path / "hf-spm")
    assert not keep_vocabulary(bpe, tmp_path / "hf-bpe") and not list((tmp_path / "hf-bpe").iterdir())
    fields, tensors = read_header(tmp_path / "hf-spm" / VOCAB_FILE, tensors=True)
    assert tensors == [] and fields["general.architecture"] == "llama"
    assert {k for k in fields if k.startswith("tokenizer.")} == {
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.pre",
    }
    assert fields["tokenizer.ggml.tokens"] == ["<unk>", "▁a", "  "]
    assert not [p for p in (tmp_path / "hf-spm").iterdir() if p.name != VOCAB_FILE]  # no temporary file left


def test_a_converted_file_takes_the_kept_vocabulary_and_keeps_its_tensors_and_other_fields(tmp_path):
    import gguf

    conv = _gguf(tmp_path / "conv.gguf", ["<unk>", "▁▁", "x"], "gpt2", **{"tokenizer.ggml.pre": "granite"})
    src = _gguf(tmp_path / "src.gguf", ["<unk>", "  ", "x"], "llama", **{"general.name": "source"})
    keep_vocabulary(src, tmp_path)
    with_vocabulary(conv, tmp_path / VOCAB_FILE, tmp_path / "out.gguf")
    got, was = gguf.GGUFReader(tmp_path / "out.gguf"), gguf.GGUFReader(conv)
    assert [(t.name, t.data.tolist()) for t in got.tensors] == [(t.name, t.data.tolist()) for t in was.tensors]
    fields = {k: f.contents() for k, f in got.fields.items() if not k.startswith("GGUF.")}
    assert fields["tokenizer.ggml.tokens"] == ["<unk>", "  ", "x"] and fields["tokenizer.ggml.model"] == "llama"
    assert "tokenizer.ggml.pre" not in fields  # the converter's own tokenizer fields go with its vocabulary
    assert fields["llama.block_count"] == 1 and "general.name" not in fields  # the source's other fields stay out
    short = _gguf(tmp_path / "short.gguf", ["<unk>", "x"], "gpt2")
    with pytest.raises(
        UserError, match=r"tokenizer\.ggml\.tokens: 3 tokens, but the model converted beside it .* has 2"
    ):
        with_vocabulary(short, tmp_path / VOCAB_FILE, tmp_path / "bad.gguf")


# -- Gemma 3 270M: the catalog's published Q4_K_M and the F16 converted here ----------------------


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("llama_cpp")
    from matrix.spec.models import fetch
    from matrix.spec.parse import ModelRef

    return fetch(ModelRef("gemma3-270m", "catalog", "gemma3-270m"), log=lambda m: None)


@pytest.fixture(scope="module")
def gemma_f16(gemma) -> dict:
    from backends.gguf_build import build_for

    return build_for("f16", gemma.hf_dir, gemma.weights_sha256, 2)


@pytest.mark.slow  # fetches and dequantises Gemma 3 on a fresh cache, converts it to F16
def test_the_converted_f16_carries_the_published_files_vocabulary(gemma, gemma_f16):
    def tokenizer(path):
        return read_header(path, keep=lambda k: k.startswith("tokenizer."))[0]

    assert (Path(gemma.hf_dir) / VOCAB_FILE).is_file()
    assert gemma_f16["recipe"]["vocabulary"]["file"] == VOCAB_FILE
    published, converted = tokenizer(gemma.gguf_path), tokenizer(gemma_f16["path"])
    assert converted["tokenizer.ggml.model"] == "llama" and converted == published


@pytest.mark.slow
def test_llama_cpp_tokenises_raw_text_alike_with_the_converted_f16_and_the_published_file(gemma, gemma_f16):
    import llama_cpp

    def tokens(path: str) -> list[list[int]]:
        lm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        return [lm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS]

    got, want = tokens(gemma_f16["path"]), tokens(gemma.gguf_path)
    assert [(t, g) for t, g, w in zip(TEXTS, got, want) if g != w] == []
    assert want[2][1:] == [236781, 167, 145, 236762]  # 40 spaces: the 31-space piece, then the 9-space one


@pytest.mark.slow
def test_the_check_accepts_the_published_file_against_the_f16_and_the_dequantised_checkpoint(gemma, gemma_f16):
    import transformers

    from matrix.spec.gguf_model import load
    from store.gguf_meta import read_info

    published = read_info(gemma.gguf_path)
    tok, config = load(gemma_f16["path"])
    assert differences(published, config, tok, len(tok)) == []
    hf_tok = transformers.AutoTokenizer.from_pretrained(gemma.hf_dir)  # '▁▁' where the file has '  '
    hf_config = transformers.AutoConfig.from_pretrained(gemma.hf_dir)
    assert hf_tok.convert_ids_to_tokens(138) == "▁▁" and published.tokens[138] == "  "
    assert differences(published, hf_config, hf_tok, hf_config.vocab_size) == []
    tokens = list(published.tokens)
    tokens[1000] = "▁" + tokens[1000]  # a real difference: one id that means another text
    diff = differences(dataclasses.replace(published, tokens=tuple(tokens)), hf_config, hf_tok, hf_config.vocab_size)
    assert diff == [f"tokenizer: token 1000 is {tokens[1000]!r} (reference: {hf_tok.convert_ids_to_tokens(1000)!r})"]


@pytest.mark.slow
def test_matrix_kld_measures_the_published_file_against_the_converted_f16(gemma, gemma_f16, tmp_path):
    from tests.conftest import REPO, run_cli

    text = tmp_path / "text.txt"
    text.write_text((REPO / "configs/corpus/long_prose.txt").read_text()[:1500])
    r = run_cli(
        "kld",
        *("--reference", gemma_f16["path"], "--candidate", gemma.gguf_path),
        *("--text", str(text), "--n-ctx", "64", "--threads", "2", "--warehouse", str(tmp_path / "wh"), "--json"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (got,) = json.loads(r.stdout)["results"]
    assert got["candidate"] == gemma.gguf_path and got["statistics"]["rows"] > 0
    assert got["statistics"]["kld"][0] < 0.05  # the file dequantised into the reference: one model, ids aligned


@pytest.mark.slow
def test_a_cached_checkpoint_without_the_kept_vocabulary_gets_it_at_fetch(gemma, tmp_path):
    from matrix.spec.models import _from_gguf

    source = Path(gemma.gguf_path)
    sha = gemma.source_sha256
    hf = tmp_path / "gguf" / sha[:16] / "hf"
    hf.mkdir(parents=True)
    for f in Path(gemma.hf_dir).iterdir():
        if f.name != VOCAB_FILE:
            os.symlink(f, hf / f.name)
    shutil.copy(Path(gemma.hf_dir).parent / "manifest.json", hf.parent / "manifest.json")
    got = _from_gguf(source, "g", "g", "test", tmp_path, lambda m: None)
    assert got.hf_dir == str(hf) and (hf / VOCAB_FILE).is_file()
    assert (hf / VOCAB_FILE).read_bytes() == (Path(gemma.hf_dir) / VOCAB_FILE).read_bytes()
