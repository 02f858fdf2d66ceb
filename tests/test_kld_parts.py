"""The parts under `matrix kld` that need no model: llama-perplexity's statistics on known
values, the GGUF header reader against gguf-py's on a written file and on broken ones, the
llama.cpp build flags for a given CPU, and where a job's spec goes."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from analysis.kld_stats import stats, text
from common.errors import UserError
from common.gguf_header import read_header


def test_statistics_follow_perplexity_cpp_on_known_values():
    rng = np.random.default_rng(7)
    n = 400
    kld = rng.exponential(0.01, n)
    dp = rng.normal(0.0, 0.02, n)
    nll_ref = rng.exponential(2.0, n)
    nll = nll_ref + rng.normal(0.01, 0.05, n)
    same = rng.random(n) < 0.9
    s = stats(kld, dp, nll, nll_ref, same)
    assert s["rows"] == n
    assert s["kld"][0] == pytest.approx(kld.mean(), rel=1e-12)
    assert s["kld"][1] == pytest.approx(kld.std() / math.sqrt(n - 1), rel=1e-9)  # population variance / (n - 1)
    assert s["kld_percentiles"]["99.0%"] == pytest.approx(np.percentile(kld, 99), rel=1e-12)
    assert s["kld_median"] == pytest.approx(np.median(kld), rel=1e-12)
    assert (s["kld_min"], s["kld_max"]) == (kld.min(), kld.max())
    assert s["delta_p_percentiles"]["25.0%"] == pytest.approx(np.percentile(dp, 25), rel=1e-12)
    assert s["ppl"][0] == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert s["ppl_ratio"][0] == pytest.approx(math.exp(nll.mean() - nll_ref.mean()), rel=1e-12)
    assert s["ln_ppl_correlation"] == pytest.approx(np.corrcoef(nll, nll_ref)[0, 1], rel=1e-9)
    assert s["rms_delta_p"][0] == pytest.approx(math.sqrt(np.mean(dp**2)), rel=1e-12)
    p = same.mean()
    assert s["same_top_p"] == pytest.approx([p, math.sqrt(p * (1 - p) / (n - 1))], rel=1e-12)
    lines = text({**s, "nonfinite_rows": 0})
    assert lines[0] == "====== Perplexity statistics ======"
    assert f"Mean    KLD: {kld.mean():10.6f} ± {s['kld'][1]:10.6f}" in lines
    assert any(line.startswith(" 0.1%   KLD:") for line in lines) and any(
        line.startswith("99.9%   Δp:") for line in lines
    )


def test_few_or_no_rows_say_so():
    assert stats(*(np.array([]),) * 4, np.array([], dtype=bool)) == {"rows": 0}
    assert text({"rows": 0, "nonfinite_rows": 3}) == [
        "3 row(s) left out: non-finite logits",
        "no scored rows to measure",
    ]
    s = stats(
        np.array([0.1, 0.2]), np.array([0.0, 0.1]), np.array([1.0, 2.0]), np.array([1.0, 2.5]), np.array([True, False])
    )
    assert s["kld"] == [pytest.approx(0.15), 0.0]  # perplexity.cpp gives no error below 11 values
    assert "only 2 scored rows" in text({**s, "nonfinite_rows": 0})[0]


def _gguf(path, tokens):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_file_type(1)  # MOSTLY_F16
    w.add_token_list(tokens)
    w.add_bos_token_id(1)
    w.add_tensor("blk.0.w", np.ones((4, 4), np.float32))
    w.add_tensor("output.w", np.ones((2, 4), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_reader_agrees_with_gguf_py(tmp_path):
    import gguf

    from store.gguf_meta import read_info

    f = tmp_path / "m.gguf"
    tokens = ["<s>", "</s>", "héllo", "▁a" * 40] + [f"t{i}" for i in range(300)]
    _gguf(f, tokens)
    fields, table = read_header(f, tensors=True)
    r = gguf.GGUFReader(str(f))
    assert table == [(t.name, int(t.tensor_type)) for t in r.tensors]
    for key, field in r.fields.items():
        if not key.startswith("GGUF."):
            assert fields[key] == field.contents(), key
    info = read_info(f)
    assert (info.architecture, info.block_count, info.embedding_length, info.head_count) == ("llama", 2, 8, 2)
    assert tuple(info.tokens) == tuple(tokens) and len(info.tokens) == len(tokens)
    assert (
        [info.tokens[i] for i in (0, 2, 303)] == ["<s>", "héllo", "t299"] and info.bos == 1 and info.declared == "f16"
    )
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(f.read_bytes())
    again = read_info(copy).tokens
    assert again is not info.tokens and again == info.tokens and again._decoded is None  # equal bytes, not decoded


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\x00" * 8, b"NOPE" + b"\x00" * 40])
def test_a_broken_header_is_one_line(tmp_path, content):
    f = tmp_path / "bad.gguf"
    f.write_bytes(content)
    with pytest.raises(UserError, match=r"bad\.gguf: not a GGUF file"):
        read_header(f)


def test_a_truncated_header_is_one_line(tmp_path):
    f = tmp_path / "m.gguf"
    _gguf(f, [f"t{i}" for i in range(50)])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f.read_bytes()[:200])  # inside the token list
    with pytest.raises(UserError, match=r"cut\.gguf: GGUF header is truncated"):
        read_header(cut)


def test_llama_cpp_flags_follow_the_cpu_and_leave_amx_out():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "flags", Path(__file__).parent.parent / "scripts" / "llama_cmake_args.py"
    )
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    sapphire = (
        "flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw "
        "avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16\n"
    )
    got = flags.cmake_args("x86_64", sapphire)
    assert "-DGGML_NATIVE=OFF" in got and "-DGGML_AVX512=ON" in got and "-DGGML_AVX512_BF16=ON" in got
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(got)
    avx2 = flags.cmake_args("x86_64", "flags\t: sse4_2 avx avx2 fma f16c bmi2 avx512f\n")  # avx512f alone is not enough
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    assert flags.cmake_args("aarch64", None)[0] == "-DGGML_NATIVE=ON"


def test_a_jobs_spec_goes_beside_its_warehouse(tmp_path, monkeypatch):
    from matrix.spec.kld import job_files

    assert job_files(str(tmp_path / "wh")) == (tmp_path / "wh.kld.yaml", tmp_path / "wh.kld-corpus.yaml")
    monkeypatch.chdir(tmp_path)
    a, b = job_files("s3://bucket-a/kld")[0], job_files("gs://bucket-b/kld")[0]
    assert a.parent == b.parent == tmp_path and a != b and a.name.startswith("kld-")


def test_a_files_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """file_sha256 (which GGUF a cell ran) reads a settled file once per machine; any write, a
    `touch` included, hashes it again, and a file written a moment ago is never remembered."""
    import hashlib

    from common import files

    monkeypatch.setenv("LOGIT_MATRIX_CACHE", str(tmp_path / "cache"))
    reads = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p, *a: reads.append(p) or real(p, *a))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert files.file_sha256(f) == files.file_sha256(f) == want and len(reads) == 2  # just written: not kept
    monkeypatch.setattr(files, "SETTLED_S", 0.0)
    assert files.file_sha256(f) == files.file_sha256(f) == want and len(reads) == 3  # settled: read once
    f.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)  # same size, new bytes
    assert files.file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() != want and len(reads) == 4
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))  # mtime kept as it was: ctime still moves
    files.file_sha256(f)
    assert len(reads) == 5
