"""A cross-engine sweep on a real local Ray cluster: HF, llama.cpp and MLX on the truncated real model;
the same spec on the local executor (no Ray) lands the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.files import sha256_file
from tests.conftest import run_cli, sql, write_spec

pytestmark = pytest.mark.slow  # runs `matrix run` captures end to end

pytest.importorskip("llama_cpp")
pytest.importorskip("mlx_lm")


def sweep_spec(d: Path, tiny_model: Path, short_corpus: Path) -> Path:
    return write_spec(
        d / "spec.yaml",
        tiny_model,
        short_corpus,
        dtypes=["fp32"],
        attention=["eager"],
        reference={"engine": "hf", "dtype": "fp32"},
        include=[
            {"engine": "llamacpp", "dtype": "fp32", "attention": "default", "kv_cache": "f32"},
            {"engine": "llamacpp", "dtype": "q8_0", "attention": "default"},
            {"engine": "llamacpp", "dtype": "q2_k", "attention": "default"},
            {"engine": "mlx", "dtype": "fp32", "attention": "default", "max_tokens": 33},
            {"engine": "mlx", "dtype": "q4_g64", "attention": "default", "max_tokens": 17},
        ],
    )


@pytest.fixture(scope="module")
def engines_sweep(tiny_model, short_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    spec = sweep_spec(d, tiny_model, short_corpus)
    wh = d / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json")  # on the worker's Ray cluster
    assert r.returncode == 0, r.stderr[-3000:]
    return wh, json.loads(r.stdout), r.stderr


def test_cells_done_skipped_and_rows_add_up(engines_sweep):
    wh, summary, log = engines_sweep
    cells = {(c["engine"], c["dtype"]): c for c in sql(wh, "select * from cells")}
    assert set(cells) == {
        ("hf", "fp32"),
        ("llamacpp", "fp32"),
        ("llamacpp", "q8_0"),
        ("llamacpp", "q2_k"),
        ("mlx", "fp32"),
        ("mlx", "q4_g64"),
    }
    skipped = cells[("llamacpp", "q2_k")]
    assert skipped["status"] == "skipped" and "stored no tensor as Q2_K" in skipped["skip_reason"]
    assert "skipped: the tensor shapes do not allow q2_k" in log
    done = [c for c in cells.values() if c["status"] == "done"]
    assert len(done) == 5 and all(c["bit_reproducible"] is not None for c in done)
    n = sql(wh, "select count(*) as n from logits")[0]["n"]
    assert n == sum(c["repeats"] * c["rows_per_repeat"] for c in done) == summary["rows_written"]


def test_the_local_executor_lands_the_same_rows_as_ray(engines_sweep, tiny_model, short_corpus, tmp_path):
    ray_wh, ray_summary, _ = engines_sweep
    spec = sweep_spec(tmp_path, tiny_model, short_corpus)
    wh = tmp_path / "wh"
    r = run_cli("run", str(spec), "--warehouse", str(wh), "--json", "--executor", "local")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["rows_written"] == ray_summary["rows_written"] > 0
    cells = (
        "select cell_id, status, repeats, rows_per_repeat, bit_reproducible, tokenizer_parity, skip_reason "
        "from cells order by cell_id"
    )
    assert sql(wh, cells) == sql(ray_wh, cells)
    rows = "select cell_id, repeat, prompt_id, position, row_hash from logits order by all"
    local_rows, ray_rows = sql(wh, rows), sql(ray_wh, rows)
    assert len(local_rows) == summary["rows_written"] and local_rows == ray_rows
    (run,) = sql(wh, "select executor, ray_address, status from runs")
    assert run == {"executor": "local", "ray_address": None, "status": "done"}
    assert {x["executor"] for x in sql(ray_wh, "select executor from runs")} == {"ray"}
    again = run_cli("run", str(spec), "--warehouse", str(wh), "--json", "--executor", "local")
    assert again.returncode == 0 and json.loads(again.stdout)["cells_run"] == 0, again.stderr[-2000:]


def test_prefix_cells_capture_a_subset_of_the_reference_rows(engines_sweep):
    wh, _, _ = engines_sweep
    extra = sql(
        wh,
        """
        select l.prompt_id, l.position from logits l join cells c using (cell_id)
        where c.engine = 'mlx' and c.dtype = 'fp32'
        except select l.prompt_id, l.position from logits l join cells c using (cell_id) where c.engine = 'hf'""",
    )
    assert extra == []
    pos = {
        r["position"]
        for r in sql(
            wh,
            "select distinct position from logits l join cells c using (cell_id) "
            "where c.engine = 'mlx' and c.dtype = 'fp32'",
        )
    }
    assert 0 in pos and 32 in pos and max(pos) == 32  # stride 16, prefix of 33 tokens


def test_artifacts_are_recorded_with_their_sha256(engines_sweep):
    wh, _, _ = engines_sweep
    for c in sql(
        wh,
        "select engine, dtype, artifact, artifact_sha256, artifact_recipe, settings from cells "
        "where status = 'done' and engine <> 'hf'",
    ):
        recipe = json.loads(c["artifact_recipe"])
        assert len(c["artifact_sha256"]) == 64
        if c["engine"] == "llamacpp":
            assert sha256_file(Path(c["artifact"])) == c["artifact_sha256"]
            assert recipe["tool"] in ("convert_hf_to_gguf.py", "llama_model_quantize")
            settings = json.loads(c["settings"])
            kv = "f32" if c["dtype"] == "fp32" else "f16"  # the fp32 cell's include entry asks for f32
            assert settings["kv_cache_k"] == settings["kv_cache_v"] == kv and "kv_cache" not in settings
            assert "AVX2" in settings["system_info"]
        else:
            assert recipe["tool"] == "mlx_lm.convert" and recipe["rope_theta_fix"] is True


def test_tokenizer_parity_is_recorded_per_cell_and_prompt(engines_sweep):
    wh, _, _ = engines_sweep
    rows = sql(
        wh,
        "select p.cell_id, p.prompt_id, p.match, p.diagnosis, c.engine from tokenizer_parity p "
        "join cells c using (cell_id)",
    )
    prompts = sql(wh, "select prompt_id from prompts")
    assert len(rows) == 5 * len(prompts)
    assert {r["engine"] for r in rows} == {"hf", "llamacpp", "mlx"}
    # SmolLM2's tokenizer adds no BOS, and the converted GGUF / MLX copies agree with it
    assert all(r["match"] and r["diagnosis"] == "ok" for r in rows), [r for r in rows if not r["match"]]
    assert {c["tokenizer_parity"] for c in sql(wh, "select tokenizer_parity from cells where status='done'")} == {"ok"}


def test_llamacpp_f32_agrees_with_hf_fp32_through_the_warehouse(engines_sweep):
    wh, _, _ = engines_sweep
    r = sql(
        wh,
        """
        select max(abs(a.v - b.v)) as maxdiff, bool_and(a.top = b.top) as same_top1 from
          (select prompt_id, position, unnest(logits) as v, generate_subscripts(logits, 1) as i,
                  list_position(logits, list_max(logits)) as top
           from logits join cells using (cell_id) where engine='hf' and repeat=0) a
        join
          (select prompt_id, position, unnest(logits) as v, generate_subscripts(logits, 1) as i,
                  list_position(logits, list_max(logits)) as top
           from logits join cells using (cell_id) where engine='llamacpp' and dtype='fp32' and repeat=0) b
        using (prompt_id, position, i)""",
    )[0]
    assert r["maxdiff"] < 0.1 and r["same_top1"] is True


def test_not_a_gguf_is_refused(tmp_path, short_corpus):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"models: [{{gguf: {fake}}}]\nengines: [llamacpp]\ndtypes: [fp32]\n"
        f"attention: [default]\ncorpus: {short_corpus}\n"
    )
    r = run_cli("run", str(spec), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2 and "not a GGUF file" in r.stderr and str(fake) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_tokenizer_larger_than_the_model_vocab_is_refused(tiny_model, short_corpus, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (odd / "config.json").write_text(json.dumps(cfg))
    spec = write_spec(tmp_path / "spec.yaml", odd, short_corpus, dtypes=["fp32"], attention=["eager"], reference=None)
    r = run_cli("run", str(spec), "--warehouse", str(tmp_path / "wh"))
    assert r.returncode == 2 and "tokenizer has 49152 tokens but the model has vocab_size 1000" in r.stderr, r.stderr
    assert not (tmp_path / "wh").exists()


@pytest.fixture(scope="module")
def engines_analyzed(engines_sweep):
    wh, _, _ = engines_sweep
    r = run_cli("analyze", "--warehouse", str(wh))
    assert r.returncode == 0, r.stderr[-2000:]
    return wh, {(c["engine"], c["dtype"]): c["cell_id"] for c in sql(wh, "select * from cells")}


def test_admit_rejects_a_4bit_stack_under_8bit_gates_and_cards_disclose_quant_recipes(engines_analyzed):
    wh, cells = engines_analyzed
    # Q2_K cannot exist for this model (no tensor takes that type: the cell is skipped), so the
    # lowest-bit stack here is MLX 4-bit; under the 8-bit class it must fail, under 4-bit it is judged as such.
    r = run_cli("admit", cells[("mlx", "q4_g64")], "--warehouse", str(wh), "--class", "8bit", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert not out["pass"] and out["class"] == "8bit"
    assert any(g["gate"] == "mean_kld" and not g["pass"] for g in out["gates"])
    r = run_cli("admit", cells[("llamacpp", "fp32")], "--warehouse", str(wh), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["pass"], r.stdout + r.stderr
    r = run_cli("admit", cells[("hf", "fp32")], "--warehouse", str(wh), "--json")  # the reference: nothing to gate
    assert r.returncode == 2 and "is the reference" in r.stderr, r.stderr
    r = run_cli("card", cells[("llamacpp", "q8_0")], "--warehouse", str(wh), "--format", "json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    assert card["disclosure"]["calibration_data"].startswith("none: llama.cpp round-to-nearest")
    assert "Q8_0" in json.dumps(card["disclosure"]["candidate_runtime"]["build"])
    r = run_cli("card", cells[("llamacpp", "q2_k")], "--warehouse", str(wh))
    assert r.returncode == 2 and "was not captured" in r.stderr


def test_fixture_export_and_check(engines_analyzed, tiny_model, tmp_path):
    wh, cells = engines_analyzed
    ref = cells[("hf", "fp32")]
    for ext in ("json", "parquet"):
        r = run_cli(
            "fixture",
            "export",
            ref,
            "--out",
            str(tmp_path / f"fx.{ext}"),
            "--k",
            "32",
            "--warehouse",
            str(wh),
            "--json",
        )
        assert r.returncode == 0, r.stderr[-2000:]
    body = json.loads((tmp_path / "fx.json").read_text())
    assert body["k"] == 32 and body["kl_direction"].startswith("KL(P_fixture") and len(body["prompts"]) == 4
    row = body["rows"][0]
    assert len(row["topk_ids"]) == 32 and row["logsumexp"] > max(row["topk_logits"])
    # the same stack passes (its rows are bit-identical: KL exactly 0 on the known part)
    r = run_cli(
        "fixture",
        "check",
        str(tmp_path / "fx.parquet"),
        "--engine",
        "hf",
        "--model",
        str(tiny_model),
        "--dtype",
        "fp32",
        "--attention",
        "eager",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    same = json.loads(r.stdout)
    assert same["pass"] and same["truncation"]["k"] == 32 and 0 <= same["truncation"]["tail_mass_mean"] < 1
    kl = next(g for g in same["gates"] if g["gate"] == "mean_kld")
    assert kl["measured"] < 1e-12 and kl["upper_bound"] >= kl["measured"]
    # a quantised stack fails tight gates, with the truncation bound quoted beside each KL
    tight = tmp_path / "tight.yaml"
    tight.write_text("classes:\n  strict: {mean_kld: 1.0e-4, top1_agreement: 1.0}\n")
    r = run_cli(
        "fixture",
        "check",
        str(tmp_path / "fx.json"),
        "--engine",
        "llamacpp",
        "--model",
        str(tiny_model),
        "--dtype",
        "q8_0",
        "--gates",
        str(tight),
        "--class",
        "strict",
    )
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "REJECTED" in r.stdout and "upper bound" in r.stdout and "tail mass" in r.stdout
    # damaged or foreign fixtures are errors, not verdicts
    bad = dict(body)
    bad["rows"] = [dict(body["rows"][0], topk_logits=[v + 1 for v in body["rows"][0]["topk_logits"]])] + body["rows"][
        1:
    ]
    (tmp_path / "damaged.json").write_text(json.dumps(bad))
    other = dict(
        body,
        prompts=[dict(body["prompts"][0], token_ids=[5] + body["prompts"][0]["token_ids"][1:])] + body["prompts"][1:],
    )
    from store.fixture_file import header_checksum

    def sealed(b: dict) -> dict:  # a consistent fixture, made for another model: its header checksum is right
        head = {k: v for k, v in b.items() if k != "rows"}
        return dict(b, header_sha256=header_checksum(head))

    (tmp_path / "ids.json").write_text(json.dumps(sealed(other)))
    (tmp_path / "vocab.json").write_text(json.dumps(sealed(dict(body, vocab_size=1000))))
    (tmp_path / "edited.json").write_text(json.dumps(dict(body, vocab_size=1000)))  # edited, not re-sealed
    for name, needle in [
        ("damaged.json", "fails its checksum"),
        ("ids.json", "token ids do not match"),
        ("vocab.json", "vocabulary 1000 but model"),
        ("edited.json", "header_sha256: the header"),
    ]:
        r = run_cli(
            "fixture",
            "check",
            str(tmp_path / name),
            "--engine",
            "hf",
            "--model",
            str(tiny_model),
            "--dtype",
            "fp32",
            "--attention",
            "eager",
        )
        assert r.returncode == 2 and needle in r.stderr, (name, r.stderr[-1500:])
