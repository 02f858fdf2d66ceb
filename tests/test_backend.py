"""The HF backend in-process, on the full real SmolLM2 weights, and its oracle check."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from backends.base import LengthRefused, SkipCell
from backends.hf_backend import HFBackend
from common.errors import OracleError
from common.positions import Positions
from common.stack import StackDesc
from store.warehouse import widen
from tests.conftest import run_cli, write_spec

IDS = [1, 504, 3365, 8187, 418, 3732, 28, 564, 260, 9726, 5001, 15407, 1326, 1069, 9043, 31, 2] * 3


def backend(model_dir, dtype, attention, threads=1) -> HFBackend:
    be = HFBackend(StackDesc.of("hf", dtype, attention), str(model_dir), threads)
    be.load()
    return be


def test_the_fed_prefix_is_what_the_last_kept_position_needs():
    ids = list(range(100, 140))  # 40 tokens
    assert Positions.every(16).fed(ids) == (ids, [0, 16, 32, 39])
    assert Positions.every(16).fed(ids, max_tokens=20) == (ids[:17], [0, 16])
    assert Positions(stride=4, start=30, stop=35, last=False).fed(ids) == (ids[:35], [30, 34])
    assert Positions(stride=4, start=50, last=False).fed(ids) == ([], [])


def test_sampled_positions():
    assert Positions.every(32).of(1) == [0]
    assert Positions.every(32).of(32) == [0, 31]
    assert Positions.every(32).of(33) == [0, 32]
    assert Positions.every(32).of(100) == [0, 32, 64, 96, 99]


@pytest.mark.slow  # the 30-layer SmolLM2
def test_full_model_fp32_eager_vs_sdpa_within_1e5_and_repeatable(reference_model):
    pos = Positions.every(8).of(len(IDS))
    eager = backend(reference_model.hf_dir, "fp32", "eager")
    a1, a2 = eager.forward(IDS, pos), eager.forward(IDS, pos)  # (rows, vocab) float32
    sdpa = backend(reference_model.hf_dir, "fp32", "sdpa")
    b1, b2 = sdpa.forward(IDS, pos), sdpa.forward(IDS, pos)
    assert a1.shape == (len(pos), 49152) and a1.dtype == np.float32
    assert np.array_equal(a1, a2) and np.array_equal(b1, b2)  # bit-reproducible
    diff = float(np.max(np.abs(a1 - b1)))
    assert diff < 1e-4, diff
    # the logits are a real language model's: the BOS row predicts a plausible token
    assert np.isfinite(a1).all() and a1.std() > 1.0


@pytest.mark.slow  # the 30-layer SmolLM2
def test_each_sdpa_kernel_pinned_on_cpu(reference_model):
    """sdpa_math and sdpa_flash run on CPU (PyTorch builds both kernels there) and each is
    repeatable and close to eager; the CUDA-only kernels are skipped before anything loads."""
    pos = Positions.every(8).of(len(IDS))
    eager = backend(reference_model.hf_dir, "fp32", "eager").forward(IDS, pos)
    out = {}
    for attention in ("sdpa_math", "sdpa_flash"):
        be = backend(reference_model.hf_dir, "fp32", attention)
        assert be.settings()["sdpa_kernel"] == {"sdpa_math": "MATH", "sdpa_flash": "FLASH_ATTENTION"}[attention]
        out[attention] = be.forward(IDS, pos)
        assert np.array_equal(out[attention], be.forward(IDS, pos))
        assert float(np.max(np.abs(out[attention] - eager))) < 1e-4
    assert not np.array_equal(out["sdpa_math"], out["sdpa_flash"])  # two kernels, two arithmetics
    for attention in ("sdpa_efficient", "sdpa_cudnn"):
        cell = StackDesc.of("hf", "fp32", attention)
        assert (
            HFBackend.unsupported(cell) == f"attention {attention}: PyTorch has that SDPA kernel on CUDA devices only"
        )


@pytest.mark.slow  # the 30-layer SmolLM2
def test_full_model_bf16_returns_bits_that_widen_close_to_fp32(reference_model):
    pos = Positions.every(8).of(len(IDS))
    bf = backend(reference_model.hf_dir, "bf16", "sdpa").forward(IDS, pos)
    fp = backend(reference_model.hf_dir, "fp32", "sdpa").forward(IDS, pos)
    assert bf.dtype == np.uint16
    w = widen(bf)
    assert np.all((w.view(np.uint32) & 0xFFFF) == 0)
    # bf16 arithmetic moves the logits, but by bf16-sized amounts, not garbage
    assert 0 < float(np.max(np.abs(w - fp))) < 2.0
    assert np.mean(np.argmax(w, -1) == np.argmax(fp, -1)) >= 0.8


def _drop_tensor(src: Path, dst: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    del tensors[key]
    save_file(tensors, f, metadata={"format": "pt"})


def test_oracle_refuses_missing_weight_in_process(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    _drop_tensor(tiny_model, broken, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(OracleError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        backend(broken, "fp32", "eager")


@pytest.mark.slow  # `matrix run` on a Ray cluster
def test_oracle_refusal_through_the_cli_exits_2(tiny_model, short_corpus, tmp_path):
    broken = tmp_path / "broken"
    _drop_tensor(tiny_model, broken, "model.norm.weight")
    spec = write_spec(
        tmp_path / "spec.yaml",
        broken,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        repeats=1,
        reference={"dtype": "fp32"},
    )
    r = run_cli("run", str(spec), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("matrix: error:") and "model.norm.weight" in last and "refusing to run" in last
    assert not list((tmp_path / "wh" / "logits").rglob("*.parquet"))


def test_a_kernel_refusing_a_prompts_length_skips_the_cell_at_that_forward(tiny_model, monkeypatch):
    """PyTorch's SDPA kernels depend on the sequence length too: a kernel that ran load()'s four
    tokens and refuses a prompt (cuDNN's on an H200 did) raises LengthRefused with PyTorch's
    reason, a SkipCell: a caller other than a capture (which feeds a longer prefix or leaves the
    prompt's rows out: tests/test_sdpa_kernels.py) skips the cell, not fails it."""
    import torch

    real = torch.nn.functional.scaled_dot_product_attention

    def cudnn_like(q, *a, **k):  # (batch, heads, T, head_dim)
        if q.shape[-2] > 4:
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(q, *a, **k)

    be = backend(tiny_model, "fp32", "sdpa_math")  # load()'s probe: 4 tokens, before the stand-in
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cudnn_like)
    assert be.forward(IDS[:4], [3]).shape == (1, be.vocab_size())
    with pytest.raises(
        LengthRefused,
        match=rf"attention sdpa_math: PyTorch .* has no MATH SDPA kernel for this model "
        rf"on cpu \(float32\) at {len(IDS)} tokens: No available kernel",
    ) as e:
        be.forward(IDS, Positions.every(8).of(len(IDS)))
    assert isinstance(e.value, SkipCell) and e.value.tokens == len(IDS)
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory")),
    )
    with pytest.raises(RuntimeError, match="out of memory"):  # any other failure stays the cell's failure
        be.forward(IDS[:4], [3])
