"""Per-layer states (the engines' side): the residual stream after each decoder
layer and the final norm's output at sampled positions, from HF (forward hooks) and llama.cpp (its
graph's l_out-N / result_norm tensors through the eval callback), on the real 2-layer cut."""

from __future__ import annotations

import numpy as np
import pytest

from common.stack import StackDesc
from store.warehouse import widen

pytest.importorskip("llama_cpp")

IDS = [(i * 7919) % 49000 + 100 for i in range(700)]  # 700 tokens: two of llama.cpp's 512-token ubatches
POS = [0, 31, 63, 400, 511, 512, 600, 699]  # both sides of the ubatch boundary, and the last


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = widen(a).astype(np.float64), widen(b).astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # (rows,)


def _load(cls, dtype, attention, model_dir):
    be = cls(StackDesc.of(cls.engine, dtype, attention), str(model_dir), 2)
    be.load()
    return be


def test_hf_and_llamacpp_layer_states_across_the_quant_ladder(tiny_model):
    from backends.hf_backend import HFBackend
    from backends.llamacpp_backend import LlamaCppBackend

    ref = _load(HFBackend, "fp32", "eager", tiny_model).layer_states(IDS, POS, [0, 1])
    assert set(ref) == {"layer.0", "layer.1", "final_norm"}
    assert all(v.shape == (len(POS), 576) and v.dtype == np.float32 for v in ref.values())
    bf16 = _load(HFBackend, "bf16", "eager", tiny_model).layer_states(IDS, POS, [0, 1])
    assert bf16["layer.0"].dtype == np.uint16  # raw bf16 bits, as logits rows are kept
    worst, mean = {}, {}
    for name, be in (("hf bf16", None), ("llamacpp f16", "f16"), ("llamacpp q8_0", "q8_0")):
        if be is None:
            got = bf16
        else:
            lb = _load(LlamaCppBackend, be, "default", tiny_model)
            got = lb.layer_states(IDS, POS, [0, 1])
            logits = lb.forward(IDS, POS)
            from backends.llama_binding import LayerTaps

            # reading the taps does not change the arithmetic of the prefill that makes the logits
            assert np.array_equal(lb.forward(IDS, POS, LayerTaps([0, 1], 2, POS)), logits)
        worst[name] = {k: float(_cos(ref[k], got[k]).min()) for k in ref}
        mean[name] = {k: float(_cos(ref[k], got[k]).mean()) for k in ref}
    # measured here: f16 ~1 - 1e-7, q8_0 ~1 - 1e-4, bf16 ~1 - 1e-5 at every layer
    for k in ref:
        assert worst["llamacpp f16"][k] > 0.99999 > worst["llamacpp q8_0"][k] > 0.999, worst
        assert 0.999 < worst["hf bf16"][k] < 1.0, worst
    # layer 0's mean agreement is at least the final norm's for each stack (drift accumulates)
    for name in worst:
        assert mean[name]["layer.0"] >= mean[name]["final_norm"], mean


def test_a_layer_past_the_models_depth_is_refused_and_mlx_says_it_cannot(tiny_model):
    from backends.base import Backend
    from backends.hf_backend import HFBackend

    hf = _load(HFBackend, "fp32", "eager", tiny_model)
    with pytest.raises(ValueError, match="the model has 2"):
        hf.layer_states(IDS[:40], [0, 39], [2])

    class NoLayers(Backend):
        engine = "nolayers"

    # an engine supports the extra by implementing its hook; one without it is told so at expansion
    import extras

    layers = extras.get("layers")
    cell = StackDesc.of("nolayers", "fp32", "default", extras=(("layers", (0,)),))
    assert layers.unsupported(HFBackend, cell, (0,)) is None
    assert (
        layers.unsupported(NoLayers, cell, (0,))
        == "engine nolayers cannot give per-layer states (the cell asks for layers)"
    )


def test_mlx_layer_states_match_hf_fp32(tiny_model):
    pytest.importorskip("mlx_lm")
    from backends.hf_backend import HFBackend
    from backends.mlx_backend import MLXBackend

    ids, pos = IDS[:100], [0, 50, 99]  # MLX's Linux CPU path is slow: a short prompt
    ref = _load(HFBackend, "fp32", "eager", tiny_model).layer_states(ids, pos, [0, 1])
    mb = _load(MLXBackend, "fp32", "default", tiny_model)
    before = mb.forward(ids, pos)
    got = mb.layer_states(ids, pos, [0, 1])
    assert set(got) == set(ref) and all(v.shape == (3, 576) for v in got.values())
    for k in ref:  # measured here: 1 - 5e-13, max |diff| 1e-4
        assert _cos(ref[k], got[k]).min() > 0.999999, k
    assert np.array_equal(mb.forward(ids, pos), before)  # the taps are gone again
    with pytest.raises(ValueError, match="the model has 2"):
        mb.layer_states(ids, pos, [5])


def test_a_rescaled_stack_passes_cosine_and_fails_the_norm_ratio(tiny_model):
    """The two gates: every activation x 1.05 keeps every cosine at 1 (scale-invariant), and only the
    norm ratio sees it; a real quant passes both at the thresholds of TensorRT-Edge-LLM's few-layer
    validation guide."""
    from analysis.layer_metrics import row_metrics, summarize, verdict
    from backends.hf_backend import HFBackend
    from backends.llamacpp_backend import LlamaCppBackend

    ref = _load(HFBackend, "fp32", "eager", tiny_model).layer_states(IDS, POS, [0, 1])
    keys = [("p", p) for p in POS]
    scaled = summarize({k: row_metrics(v, v * 1.05) for k, v in ref.items()}, keys)
    assert [r["layer"] for r in scaled] == ["layer.0", "layer.1", "final_norm"]
    assert all(
        r["cosine_min"] > 1 - 1e-12 and abs(r["norm_ratio_dev_max"] - 0.05) < 1e-6 for r in scaled
    )  # float32 x 1.05
    from analysis.gates import load_gates
    from tests.conftest import REPO

    gates = load_gates(str(REPO / "configs" / "gates.yaml"))["layers"]
    v = verdict(scaled, **gates["fp16"])
    assert not v["pass"] and v["first_failing_layer"] == "layer.0" and v["failed"] == ["norm_ratio_tol"]
    q8 = _load(LlamaCppBackend, "q8_0", "default", tiny_model).layer_states(IDS, POS, [0, 1])
    real = summarize({k: row_metrics(ref[k], q8[k]) for k in ref}, keys)
    assert verdict(real, **gates["8bit"])["pass"] and not verdict(scaled, **gates["8bit"])["pass"], real
    assert all(0 < r["rel_l2_max"] < 0.05 and r["cosine_worst_at"] in keys for r in real), real
