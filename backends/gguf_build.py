"""GGUF weights for the llama.cpp stacks, made by llama.cpp's own tools from the reference checkpoint.

    reference HF dir --convert_hf_to_gguf.py--> F32 / F16 / BF16 GGUF
        (the source GGUF's vocabulary put back where the checkpoint keeps it: backends/gguf_vocab.py)
    F32 GGUF --llama_model_quantize--> Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, Q4_1, Q3_K_M, Q2_K

The converter, gguf-py and the ggml-vocab test files come from the
llama-cpp-python source distribution of the installed version (downloaded
once from PyPI into the cache), so converter and runtime always match.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from backends.artifacts import content_key, ensure, locked
from backends.base import SkipCell
from backends.gguf_vocab import VOCAB_FILE, with_vocabulary
from common.errors import UserError
from common.files import cache_root, check_gguf, pip_download, sha256_file

FLOAT_TYPES = {"fp32": "f32", "f16": "f16", "bf16": "bf16"}
# dtype -> llama_ftype name (llama.h)
QUANT_TYPES = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
}
# The ggml type a quant is named after. K-quants need rows that are a multiple of 256;
# llama.cpp silently substitutes another type for a tensor that is not (e.g. Q4_K -> Q5_0).
PRIMARY_TYPE = {
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K",
    "q5_0": "Q5_0",
    "q4_k_m": "Q4_K",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q3_k_m": "Q3_K",
    "q2_k": "Q2_K",
}


def tools_dir() -> Path:
    """vendor/llama.cpp pieces of the llama-cpp-python sdist matching the installed version."""
    import llama_cpp

    version = llama_cpp.__version__
    d = cache_root() / "tools" / f"llama-cpp-python-{version}"
    if (d / "convert_hf_to_gguf.py").is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    with locked(d.parent / f".lock-{version}"):  # two actors may start at once on a fresh cache
        if not (d / "convert_hf_to_gguf.py").is_file():
            _fetch_tools(version, d)
    return d


def _fetch_tools(version: str, d: Path) -> None:
    vendor_tree(version, d, ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-"))
    if not (d / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"llama-cpp-python {version}'s sdist has no vendor/llama.cpp/convert_hf_to_gguf.py")


def vendor_tree(version: str, d: Path, want: tuple[str, ...] | None = None) -> None:
    """The sdist's vendor/llama.cpp (only the paths starting with `want`, if given) at d, atomically."""
    with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
        # --no-binary for this package only: ":all:" would also force every build dependency
        # of pip's metadata step to build from source (minutes of needless work).
        sdist = pip_download(
            f"llama-cpp-python=={version}", Path(tmp), extra=("--no-binary", "llama-cpp-python"), pattern="*.tar.gz"
        )
        out = Path(tmp) / "out"
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                parts = m.name.split("/vendor/llama.cpp/", 1)
                if len(parts) == 2 and (want is None or parts[1].startswith(want)) and (m.isfile() or m.isdir()):
                    m.name = parts[1]
                    tf.extract(m, out, filter="data")
        os.replace(out, d)


def convert(hf_dir: str, weights_sha256: str | None, outtype: str) -> dict[str, Any]:
    """Reference HF weights -> GGUF of a float type, by llama.cpp's converter."""
    import llama_cpp

    tools = tools_dir()
    recipe = {
        "tool": "convert_hf_to_gguf.py",
        "llama_cpp_python": llama_cpp.__version__,
        "source": hf_dir,
        "source_weights_sha256": weights_sha256,
        "outtype": outtype,
    }

    # A checkpoint dequantised from a GGUF whose vocabulary it cannot carry keeps that vocabulary
    # beside it (backends/gguf_vocab.py): the converted file takes it, and its hash is part of the
    # artifact's key, so a file converted from the checkpoint without it is never reused for it.
    vocab = Path(hf_dir) / VOCAB_FILE
    kept = vocab.is_file()
    if kept:
        recipe["vocabulary"] = {"file": VOCAB_FILE, "sha256": sha256_file(vocab)}

    def build(tmp: Path) -> None:
        if not kept:
            _run_converter(tools, hf_dir, outtype, tmp)
            return
        raw = tmp.with_name(tmp.name + ".converted")
        try:
            _run_converter(tools, hf_dir, outtype, raw)
            with_vocabulary(raw, vocab, tmp)
        finally:
            raw.unlink(missing_ok=True)

    return ensure("gguf", f"model-{outtype}.gguf", recipe, build, content_key(hf_dir, weights_sha256))


def _run_converter(tools: Path, hf_dir: str, outtype: str, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py, with the gguf-py beside it, writing out."""
    env = {**os.environ, "PYTHONPATH": f"{tools / 'gguf-py'}{os.pathsep}{tools}"}
    cmd = [sys.executable, str(tools / "convert_hf_to_gguf.py"), hf_dir, "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["failed"]
        raise UserError(f"{hf_dir}: convert_hf_to_gguf.py --outtype {outtype} failed: {tail[0]}")


def quantize(
    f32: dict[str, Any],
    dtype: str,
    threads: int,
    imatrix: dict[str, Any] | None = None,
    tensor_types: tuple[str, ...] = (),
    label: str | None = None,
    planned: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A float GGUF (F32, F16 or BF16) -> a quant type, by llama.cpp's own quantiser
    (llama_model_quantize), weighted by an importance matrix (an artifact of backends/gguf_imatrix.py)
    when one is given. tensor_types: llama-quantize's --tensor-type lines (PATTERN=TYPE,
    backends/gguf_groups.py), first match wins; label: what they do, in the file's name
    (model-q4_k_m+attn_v=q8_0.gguf), so that a job's files and stacks read apart; planned: the
    caller's planned_types of these lines, where it has them (no second dry run; not in the key)."""
    import llama_cpp

    ftype_name = QUANT_TYPES[dtype]
    recipe = {
        "tool": "llama_model_quantize",
        "llama_cpp_python": llama_cpp.__version__,
        "source_sha256": f32["sha256"],
        "ftype": ftype_name,
        "imatrix": None if imatrix is None else {"sha256": imatrix["sha256"], **imatrix["recipe"]},
    }
    name = f"model-{dtype}.gguf"
    if tensor_types:  # only where given: a plain quant's key (and cached file) has no such field
        recipe["tensor_types"] = list(tensor_types)
        if label:  # part of the key: the file's name is what the key's directory holds
            recipe["label"] = label
            name = f"model-{dtype}+{label}.gguf"

    def build(tmp: Path) -> None:
        if tensor_types:  # the plain recipe's file holds most of its tensors already
            base = quantize(f32, dtype, threads, imatrix)
            _quantize_over(f32["path"], base["path"], dtype, tmp, threads, imatrix, tensor_types, planned)
        else:
            quantize_file(f32["path"], dtype, tmp, threads, imatrix, tensor_types)

    return ensure("gguf", name, recipe, build)


def _quantize_over(
    source: str, base: str, dtype: str, out: Path, threads: int, imatrix, tensor_types, planned=None
) -> None:
    """quantize_file's very file, with only the tensors whose type differs from the base's quantised:
    llama.cpp's dry run gives each tensor's type, the base's tensors that keep theirs are spliced
    into the float source (common/gguf_splice.py), and the quantiser copies those as they are."""
    from common.gguf_splice import splice

    if planned is None:
        planned = planned_types(source, dtype, imatrix, tensor_types)
    held = types_held(base)
    mixed = out.with_name(out.name + ".spliced")
    try:
        splice(source, base, {n for n, t in planned.items() if held.get(n) == t}, mixed)
        quantize_file(str(mixed), dtype, out, threads, imatrix, tensor_types)
    finally:
        mixed.unlink(missing_ok=True)
    got = types_held(out)
    if got != planned:
        wrong = sorted(n for n in planned.keys() | got.keys() if got.get(n) != planned.get(n))
        raise RuntimeError(f"{out}: llama.cpp's quantiser wrote other types than its dry run planned ({wrong[:3]})")


def types_held(path: str | Path) -> dict[str, str]:
    """{tensor: ggml type name, lower case} as the file holds them."""
    from gguf import GGMLQuantizationType

    from common.gguf_header import read_tensors

    return {name: GGMLQuantizationType(t).name.lower() for name, t, _ in read_tensors(path)}


def quantize_file(
    source: str,
    dtype: str,
    out: Path,
    threads: int,
    imatrix: dict[str, Any] | None = None,
    tensor_types: tuple[str, ...] = (),
    dry_run: bool = False,
) -> None:
    """llama_model_quantize from source to out, as llama-quantize [--imatrix F] [--tensor-type-file F]
    SOURCE OUT TYPE does, with no cache in between; dry_run: as its --dry-run, every tensor's type
    chosen and logged, nothing quantised or written."""
    import ctypes

    import llama_cpp

    from backends.llama_binding import quiet_logs

    quiet_logs()  # the quantiser logs every tensor (and each fallback) as a warning
    params = llama_cpp.llama_model_quantize_default_params()
    params.dry_run = dry_run
    params.ftype = getattr(llama_cpp, QUANT_TYPES[dtype])
    params.nthread = threads  # threads split rows; the result does not depend on them
    if imatrix is not None:  # as llama-quantize --imatrix does, header keys included
        from backends.gguf_imatrix import quantize_inputs

        arr, kv, _keep = quantize_inputs(imatrix["path"], imatrix["recipe"]["calibration"])
        params.imatrix, params.kv_overrides = arr, kv
    if tensor_types:
        from backends.gguf_groups import overrides

        params.tt_overrides, _keep_overrides = overrides(tensor_types)
    rc = llama_cpp.llama_model_quantize(source.encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not (dry_run or out.is_file()):
        raise UserError(f"llama.cpp could not quantise {source} to {dtype} (return code {rc})")


# a tensor's line in llama_model_quantize's log: "[  12/ 272] NAME - [576, 576, 1, 1], type = f16, "
# then "size = A MiB -> B MiB (q4_K)" where it is quantised, "size = A MiB" where it stays
_PLANNED = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =[^\n(]*(?:\((\w+)\))?")


def planned_types(source: str, dtype: str, imatrix: dict[str, Any] | None, tensor_types: tuple[str, ...]) -> dict:
    """{tensor: ggml type name, lower case} of every tensor quantize_file would write, from llama.cpp's
    own dry run (its mixture's choices, the overrides and the fallbacks), in ~0.1 s: nothing quantised."""
    from backends.llama_binding import logs_of_this_thread

    with logs_of_this_thread() as parts:
        quantize_file(source, dtype, Path(os.devnull), 1, imatrix, tensor_types, dry_run=True)
    planned = {m[1]: (m[3] or m[2]).lower() for m in _PLANNED.finditer("".join(parts))}
    missed = sorted(set(types_held(source)) - set(planned))
    if missed:  # its log read otherwise than this parser expects: no plan at all, rather than part of one
        raise RuntimeError(
            f"llama.cpp's quantiser dry run on {source} named no type for {len(missed)} tensor(s): {missed[:3]}"
        )
    return planned


def tensor_types(path: str | Path) -> dict[str, int]:
    """ggml type name -> number of tensors, as actually stored in the file."""
    return tensor_layout(path)[0]


def tensor_layout(path: str | Path) -> tuple[dict[str, int], dict[str, Any]]:
    """From one read of the header: the file's tensor types (as tensor_types) and its size as a
    quant's reader weighs it: the file's bytes, its weights' elements and bits per weight over the
    tensor data (llama.cpp's BPW: tensor bytes x 8 / elements)."""
    from gguf import GGMLQuantizationType

    from common.gguf_header import nbytes, read_tensors

    tensors = read_tensors(path)
    types = Counter(GGMLQuantizationType(t).name for _, t, _ in tensors)
    elements = sum(n for _, _, n in tensors)
    data = sum(nbytes(n, ttype) for _, ttype, n in tensors)
    size = {
        "file_bytes": Path(path).stat().st_size,
        "tensor_bytes": data,
        "parameters": elements,
        "bits_per_weight": data * 8 / elements,
    }
    return dict(sorted(types.items())), size


def published(path: str, sha256: str | None, source: str | None = None) -> dict[str, Any]:
    """A candidate's file, run as it is: its hash checked here, where it is read (the driver adds
    what its header declares to the recipe: matrix/spec/candidate_check.py header_facts)."""
    from common.files import file_sha256

    check_gguf(path)
    got = file_sha256(Path(path))
    if sha256 and got != sha256:
        raise RuntimeError(f"{path}: sha256 {got}, but the driver recorded {sha256} for this candidate")
    return {
        "path": path,
        "sha256": got,
        "recipe": {"tool": "published artifact", "source": source or path, "file": Path(path).name},
    }


def build_for(
    dtype: str,
    hf_dir: str,
    weights_sha256: str | None,
    threads: int,
    original: str | None = None,
    original_quant: str | None = None,
    imatrix: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The GGUF for a cell dtype. A catalog model's own file serves its own quant type (unless an
    imatrix is asked for: then llama.cpp quantises the reference with it)."""
    if original and original_quant == dtype and imatrix is None:
        from common.files import file_sha256

        check_gguf(original)
        return {
            "path": original,
            "sha256": file_sha256(Path(original)),
            "recipe": {"tool": "as shipped", "source": original},
        }
    if dtype in FLOAT_TYPES:
        return convert(hf_dir, weights_sha256, FLOAT_TYPES[dtype])
    if dtype in QUANT_TYPES:
        f32 = convert(hf_dir, weights_sha256, "f32")
        weights = None
        if imatrix is not None:
            from backends.gguf_imatrix import collect

            weights = collect(
                f32, imatrix["text"], imatrix["corpus"], imatrix["sha256"], imatrix["chunks"], imatrix["ctx"], threads
            )
        art = quantize(f32, dtype, threads, weights)
        types = tensor_types(art["path"])
        if PRIMARY_TYPE[dtype] not in types:
            raise SkipCell(
                f"the tensor shapes do not allow {dtype}: llama.cpp stored no tensor as "
                f"{PRIMARY_TYPE[dtype]} (got {', '.join(f'{k} x{v}' for k, v in types.items())})"
            )
        return art
    raise UserError(f"llama.cpp has no dtype {dtype!r}")
