"""llama.cpp and MLX stacks in-process against HF on the same weights: the 2-layer cut of SmolLM2
(its real embeddings, first two decoder layers, norm and head) for agreement, ordering and the
engines' mechanics; the full 30-layer model where its shipped Q4_1 file is measured."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from backends.base import SkipCell
from common.errors import OracleError, UserError
from common.positions import Positions
from common.stack import StackDesc

pytestmark = pytest.mark.slow  # converts and quantises with llama.cpp and MLX

llama_cpp = pytest.importorskip("llama_cpp")
mlx_lm = pytest.importorskip("mlx_lm")

STRIDE = 8


def kl_rows(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over rows of KL(P || Q), float64 log_softmax."""
    p = p_logits.astype(np.float64)
    q = q_logits.astype(np.float64)
    lp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)  # (rows, vocab)
    lq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


@pytest.fixture(scope="module")
def prompts(reference_model, short_corpus):
    import transformers

    from matrix.spec.corpus import tokenize

    tok = transformers.AutoTokenizer.from_pretrained(reference_model.hf_dir)
    return tokenize(str(short_corpus), "smollm2-135m", tok, "tokenizer")


def run_all(be, prompts) -> np.ndarray:
    rows = [be.forward(p.token_ids, Positions.every(STRIDE).of(len(p.token_ids))) for p in prompts]
    return np.concatenate(rows)  # (rows, vocab)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The 2-layer cut as the engines' helpers below take a model (no source GGUF: converted here)."""
    from common.files import weights_digest_cached

    return SimpleNamespace(
        hf_dir=str(tiny_model), weights_sha256=weights_digest_cached(tiny_model), gguf_path=None, gguf_quant=None
    )


def hf_rows(model, prompts) -> np.ndarray:
    from backends.hf_backend import HFBackend

    be = HFBackend(StackDesc.of("hf", "fp32", "sdpa"), model.hf_dir, 2)
    be.load()
    return run_all(be, prompts)


@pytest.fixture(scope="module")
def hf_fp32(tiny, prompts):
    return hf_rows(tiny, prompts)


def llama(model, dtype, **opts):
    from backends.llamacpp_backend import LlamaCppBackend

    be = LlamaCppBackend(
        StackDesc.of(
            "llamacpp",
            dtype,
            "default",
            options=tuple(sorted(opts.items())),
            weights_sha256=model.weights_sha256,
            source_gguf=model.gguf_path,
            source_quant=model.gguf_quant,
        ),
        model.hf_dir,
        2,
    )
    be.load()
    return be


def test_llamacpp_f32_matches_hf_fp32(tiny, prompts, hf_fp32):
    be = llama(tiny, "fp32", kv_cache="f32")
    got = run_all(be, prompts)
    assert got.shape == hf_fp32.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - hf_fp32)))
    assert diff < 0.1, diff  # ~2e-2 measured: different kernels, same weights
    assert np.array_equal(got.argmax(-1), hf_fp32.argmax(-1))  # top-1 agreement 100%
    assert np.array_equal(got, run_all(be, prompts))  # the KV cache cleared before each prompt: bit-reproducible
    assert be.settings()["gguf_tensor_types"] == {"F32": 2 * 9 + 2}  # 9 a layer, the embedding, the norm
    s = be.settings()
    assert s["kv_cache_k"] == s["kv_cache_v"] == "f32" and s["n_ubatch"] == 512 and "AVX2 = 1" in s["system_info"]
    assert len(s["artifact"]["sha256"]) == 64


def test_quant_ladder_is_ordered_by_kl(tiny, prompts, hf_fp32):
    kls = {d: kl_rows(hf_fp32, run_all(llama(tiny, d), prompts)) for d in ("f16", "q8_0", "q4_k_m", "q4_0")}
    assert kls["f16"] < kls["q8_0"] < kls["q4_k_m"] < kls["q4_0"], kls
    assert kls["f16"] < 1e-4 and kls["q4_0"] < 2.0, kls


@pytest.mark.parametrize("dtype, primary", [("q2_k", "Q2_K"), ("q3_k_m", "Q3_K")])
def test_k_quants_the_shapes_do_not_allow_are_skipped(tiny, dtype, primary):
    # hidden size 576 is not a multiple of 256: llama.cpp would substitute other types for every such tensor
    with pytest.raises(SkipCell, match=rf"do not allow {dtype}: llama.cpp stored no tensor as {primary}"):
        llama(tiny, dtype)


def test_shipped_q4_1_file_is_its_own_stack(reference_model, prompts):
    be = llama(reference_model, "q4_1")
    assert be.artifact["path"] == reference_model.gguf_path
    assert be.artifact["sha256"] == reference_model.source_sha256
    # the reference weights were dequantised from this very file: it is close to them
    assert kl_rows(hf_rows(reference_model, prompts), run_all(be, prompts)) < 0.01


# MLX on Linux runs on the CPU with reference BLAS and its own quantised kernels
# (~2 GFLOP/s dense, ~1.4 s per token quantised on the full model, measured here): the MLX tests
# feed prefixes. Logits at p depend on ids[0..p] only, so prefix rows compare exactly.
def _prefix_rows(prompts, n, which=None):
    """[(ids prefix, positions)] for prompts[which], and their row indices in run_all(prompts)."""
    out, index, offset = [], [], 0
    for k, p in enumerate(prompts):
        pos = Positions.every(STRIDE).of(len(p.token_ids))
        if which is None or k in which:
            keep = [i for i, q in enumerate(pos) if q < n]
            out.append((p.token_ids[: pos[keep[-1]] + 1], [pos[i] for i in keep]))
            index += [offset + i for i in keep]
        offset += len(pos)
    return out, index


def _mlx(model, dtype, **opts):
    from backends.mlx_backend import MLXBackend

    desc = StackDesc.of(
        "mlx", dtype, "default", options=tuple(sorted(opts.items())), weights_sha256=model.weights_sha256
    )
    be = MLXBackend(desc, model.hf_dir, 2)
    be.load()
    return be


def test_mlx_fp32_matches_hf_fp32_and_quants_move_away(tiny, prompts, hf_fp32):
    from store.warehouse import widen

    plan, index = _prefix_rows(prompts, 49)
    ref = hf_fp32[index]  # (rows, vocab)
    fp32 = np.concatenate([_mlx(tiny, "fp32").forward(i, q) for i, q in plan])
    assert float(np.max(np.abs(fp32 - ref))) <= 1e-3
    bf16 = _mlx(tiny, "bf16").forward(*plan[3])
    assert bf16.dtype == np.uint16  # native bf16 bits, stored as such
    short, sidx = _prefix_rows(prompts, 17, which={3})  # the code prompt, positions 0, 8, 16
    # fp32 activations: what the quantisation costs (with bf16 ones the kernel's sums weigh more,
    # test_mlx_fp32_activations_measure_the_quantisation_not_the_kernel)
    quants = [_mlx(tiny, d, activations="fp32") for d in ("q8_g64", "q4_g64")]
    kls = [kl_rows(hf_fp32[sidx], widen(be.forward(*short[0]))) for be in quants]
    assert 0 < kls[0] < kls[1] < 2.0, kls
    native = [kl_rows(hf_fp32[sidx], widen(_mlx(tiny, d).forward(*short[0]))) for d in ("q8_g64", "q4_g64")]
    assert all(0 < k < 2.0 for k in native), native


def test_mlx_rope_theta_trap_is_caught(tiny, prompts, hf_fp32, tmp_path):
    """Without a top-level rope_theta mlx-lm silently uses 10000: the logits go wrong."""
    import mlx.core as mx
    from mlx_lm import load

    from backends.mlx_backend import MLXBackend, convert, fix_rope_theta

    art = convert(tiny.hf_dir, tiny.weights_sha256, "fp32")
    broken = tmp_path / "mlx-no-rope-theta"
    shutil.copytree(art["path"], broken)
    cfg = json.loads((broken / "config.json").read_text())
    assert cfg["rope_theta"] == 100000  # our conversion set it
    del cfg["rope_theta"]
    (broken / "config.json").write_text(json.dumps(cfg))
    model, _ = load(str(broken))
    assert model.args.rope_theta == 10000  # the trap
    plan, index = _prefix_rows(prompts, 65, which={1})  # prose: positions 0..64
    ref = hf_fp32[index]
    ids, pos = plan[0]
    wrong = np.array(model(mx.array([ids]))[0, mx.array(pos)])
    assert float(np.max(np.abs(wrong - ref))) > 1.0  # silently wrong

    # the backend refuses such a directory instead of capturing wrong logits
    be = MLXBackend(StackDesc.of("mlx", "fp32", "default"), tiny.hf_dir, 2)
    be.artifact, be.model = {"path": str(broken)}, model
    with pytest.raises(OracleError, match="rope_theta=10000"):
        be._check_rope()
    # and the fix restores it
    assert fix_rope_theta(broken / "config.json") == 100000
    fixed, _ = load(str(broken))
    right = np.array(fixed(mx.array([ids]))[0, mx.array(pos)])
    assert float(np.max(np.abs(right - ref))) <= 1e-3


def test_mlx_unsupported_architecture_is_a_clear_error(tiny_model, tmp_path):
    from backends.mlx_backend import convert

    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="mlx_lm cannot convert this model"):
        convert(str(odd), None, "fp32")


def test_mlx_quantized_matmul_sums_bf16_activations_in_bf16_here():
    """The kernel behind MLX's quantised KL on Linux, reproduced with mx.quantized_matmul itself.
    If a future mlx sums in fp32, this test fails and says so: then `activations: fp32` is no longer
    needed on this device and configs/gates.yaml's MLX note should go."""
    import mlx.core as mx

    from backends.mlx_backend import QMM_TOLERANCE, qmm_probe

    mx.set_default_device(mx.cpu)
    for bits in (8, 4):
        fp32 = qmm_probe(mx, mx.float32, bits)
        assert fp32["rel_err"] < 1e-6 and fp32["sums_in"] == "float32", fp32
        bf16 = qmm_probe(mx, mx.bfloat16, bits)
        assert bf16["rel_err"] > QMM_TOLERANCE, (
            f"mlx {mx.__version__} now sums bf16 activations in fp32 on {mx.default_device()} "
            f"(rel err {bf16['rel_err']:.1e}): its quantised stacks measure the quantisation again"
        )
        assert bf16["sums_in"] == "the activation dtype"


def test_mlx_fp32_activations_measure_the_quantisation_not_the_kernel(tiny, prompts, hf_fp32):
    from backends.mlx_backend import MLXBackend

    short, sidx = _prefix_rows(prompts, 33, which={3})  # the code prompt, positions 0, 8, 16, 24, 32
    ref = hf_fp32[sidx]
    kls, settings = {}, {}
    for act in ("native", "fp32"):
        be = MLXBackend(
            StackDesc.of(
                "mlx",
                "q8_g64",
                "default",
                options=(("activations", act),),
                weights_sha256=tiny.weights_sha256,
            ),
            tiny.hf_dir,
            2,
        )
        be.load()
        rows = be.forward(*short[0])
        from store.warehouse import widen

        kls[act], settings[act] = kl_rows(ref, widen(rows)), be.settings()
    assert settings["fp32"]["activations"] == "fp32" and settings["fp32"]["quantized_matmul"]["sums_in"] == "float32"
    assert settings["native"]["quantized_matmul"]["sums_in"] == "the activation dtype"
    # llama.cpp's Q8_0 is ~3e-3 from the reference; MLX q8 with bf16 activations ~0.1 (the kernel)
    assert kls["fp32"] < 0.01 < kls["native"] and kls["native"] > 5 * kls["fp32"], kls


def test_llamacpp_kept_context_and_output_buffers_give_a_fresh_contexts_bits(tiny, prompts):
    """forward() keeps its context from prompt to prompt of one length (the KV cache cleared) and,
    inside a capture, hands out two output buffers in turn: neither may change a bit."""
    be = llama(tiny, "q8_0")
    asks = [(p.token_ids, Positions.every(STRIDE).of(len(p.token_ids))) for p in prompts]
    fresh = []
    for ids, pos in asks:
        be._drop_kept()  # a new context for this prompt, as each prompt had one before contexts were kept
        fresh.append(be.forward(ids, pos).copy())
    be.keep_outputs(2)
    order = [i for i in range(len(asks)) for _ in range(2)]  # each prompt twice: the second reuses its context
    last = None
    for k, i in enumerate(order):
        got = be.forward(*asks[i])
        assert np.array_equal(got.view(np.uint32), fresh[i].view(np.uint32)), (k, i)
        if last is not None:  # the result before is still intact: it sits in the other buffer
            assert not np.shares_memory(got, last[1])
            assert np.array_equal(last[1].view(np.uint32), fresh[last[0]].view(np.uint32))
        last = (i, got)
    be.keep_outputs(0)
    assert not np.shares_memory(be.forward(*asks[0]), be.forward(*asks[0]))
    be.close()


def test_llamacpp_threads_wait_passively_unless_the_user_chose(tiny, prompts, tmp_path, monkeypatch):
    """llama.cpp's OpenMP threads sleep at their barriers in a fresh host process (a capture's row
    work runs beside each forward), with the same bits as spinning ones; the user's OMP_WAIT_POLICY
    stands, and a process that loaded llama_cpp before keeps libgomp's default. The cell's settings
    say which. Each policy in a process of its own: libgomp reads it once, when it loads."""
    import subprocess
    import sys

    from tests.conftest import REPO

    ids = prompts[0].token_ids
    m = tiny
    code = f"""
import json, sys, numpy as np
from backends.llamacpp_backend import LlamaCppBackend
from common.positions import Positions
from common.stack import StackDesc
be = LlamaCppBackend(StackDesc.of("llamacpp", "q8_0", "default", weights_sha256={m.weights_sha256!r},
                               source_gguf={m.gguf_path!r}, source_quant={m.gguf_quant!r}), {str(m.hf_dir)!r}, 2)
be.load()
np.save(sys.argv[1], be.forward({list(ids)!r}, Positions.every({STRIDE}).of({len(ids)})))
print(json.dumps([be.settings()["omp_wait_policy"], be.rows_beside_forward()]))
"""

    def fresh(policy: str | None) -> tuple[list, np.ndarray]:
        """(the settings' policy and rows_beside_forward, the rows) of a new process under `policy`."""
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        out = tmp_path / f"rows-{policy}.npy"
        r = subprocess.run(
            [sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True, env=env, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)

    chosen, passive = fresh(None)
    assert chosen == ["passive", True]
    chosen, spinning = fresh("active")
    assert chosen == ["active", False]  # the user's choice stands
    assert np.array_equal(passive.view(np.uint32), spinning.view(np.uint32))  # the same bits under both policies
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    be = llama(tiny, "q8_0")  # this test's module imported llama_cpp: too late to choose
    assert (be.settings()["omp_wait_policy"], be.rows_beside_forward()) == ("libgomp default", False)
    assert "OMP_WAIT_POLICY" not in os.environ
    be.close()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    be = llama(tiny, "q8_0")
    assert (be.settings()["omp_wait_policy"], be.rows_beside_forward()) == ("active", False)
    be.close()
