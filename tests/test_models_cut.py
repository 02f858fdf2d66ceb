"""`matrix models cut --gguf`: the source GGUF's own quantised bytes of the first N blocks,
which dequantise to exactly the reference weights of those layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli

gguf = pytest.importorskip("gguf")


def test_cut_gguf_keeps_the_source_bytes_and_dequantises_to_the_reference_layers(
    reference_model, tmp_path, monkeypatch
):
    from safetensors.numpy import load_file

    from matrix.spec.models import dequantise_gguf

    out = tmp_path / "cut2.gguf"
    r = run_cli("models", "cut", "smollm2-135m", "--layers", "2", "--gguf", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    src, cut = gguf.GGUFReader(reference_model.gguf_path), gguf.GGUFReader(out)
    assert cut.fields["llama.block_count"].contents() == 2
    names = [t.name for t in cut.tensors]
    assert "token_embd.weight" in names and "output_norm.weight" in names
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1"}
    by_name = {t.name: t for t in src.tensors}
    for t in cut.tensors:  # same quant type, same bytes
        assert t.tensor_type == by_name[t.name].tensor_type
        assert np.array_equal(t.data, by_name[t.name].data), t.name
    # dequantised, the cut is the reference model's first two layers, value for value; transformers'
    # tokenizer, config and weights loads share one reader of the file
    readers = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, _cls=gguf.GGUFReader: readers.append(a) or _cls(*a))
    dequantise_gguf(out, tmp_path / "hf", log=lambda m: None)
    assert readers == [(str(out), "r")], readers
    mine = load_file(tmp_path / "hf" / "model.safetensors")
    full = {}
    for f in Path(reference_model.hf_dir).glob("*.safetensors"):
        full.update(load_file(f))
    assert any(k.startswith("model.layers.1.") for k in mine)
    assert not any(k.startswith("model.layers.2.") for k in mine)
    for k, v in mine.items():
        assert np.array_equal(v, full[k]), k
    # refusals: one line, exit 2
    again = run_cli("models", "cut", "smollm2-135m", "--layers", "2", "--gguf", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    too_many = run_cli("models", "cut", "smollm2-135m", "--layers", "31", "--gguf", "--out", str(tmp_path / "x.gguf"))
    assert too_many.returncode == 2 and "between 1 and 30" in too_many.stderr, too_many.stderr
