"""Where a GPU sweep's time goes: loading, the store against the forward, the store over the host's cores.

Runs on a bare CUDA image (PyTorch, transformers, pyarrow, pyyaml; no Ray, DuckDB or llama.cpp:
the sweep uses the local executor) with the model scripts/gpu-check.sh takes, and on a CPU box
with the forward on the CPU. Three parts, each a ratio against a peer measured in the same run:

1. sweep: scripts/gpu-check.sh's sweep (HF at fp32 / bf16 / f16, eager and each SDPA kernel,
   2 repeats) with one host per cell (`hosts: per_cell`) and with the cells of one loaded model
   sharing a host (`hosts: shared`): wall time, hosts that loaded weights, and the share of the
   wall spent loading.
2. capture: one stack's capture + store of every position of the corpus over its forward with
   the logits copied to the host (and over the bare forward), for a bf16 and an fp32 stack.
3. store: ShardWriter's rows/s and MB/s at 1, 2, 4, ... threads (benchmarks/store_scaling.py).

    python benchmarks/gpu_capture.py [MODEL] [--device auto|cpu|cuda] [--parts sweep,capture,store]

MODEL: a GGUF (.gguf or .gguf.xz, e.g. the 12-layer cut `matrix models cut smollm2-135m --layers 12
--gguf`), an HF directory, or a catalog name (default smollm2-135m).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import tempfile
import time
from pathlib import Path

from _common import cpu, gpu, save_result

KERNELS = ["eager", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"]


def model_ref(model: str, work: Path):
    """(ModelRef, the spec's models entry) of MODEL; a .gguf.xz is unpacked into work first."""
    from matrix.spec.model_entry import ModelRef

    if model.endswith(".gguf.xz"):
        out = work / Path(model).name.removesuffix(".xz")
        with lzma.open(model) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        model = str(out)
    if model.endswith(".gguf"):
        name = Path(model).stem
        return ModelRef(name, "gguf", str(Path(model).resolve())), {"name": name, "gguf": str(Path(model).resolve())}
    if Path(model).is_dir():
        name = Path(model).name
        return ModelRef(name, "path", str(Path(model).resolve())), {"name": name, "path": str(Path(model).resolve())}
    return ModelRef(model, "catalog", model), model


def sweep(entry, device: str, work: Path, corpus_max: int | None) -> list[dict]:
    """The gpu-check sweep with `hosts: per_cell` and `hosts: shared`: wall, loads, load share."""
    import yaml

    from matrix import api

    rows = []
    # on a GPU the three dtypes' hosts may also load side by side on the one device
    runs = [("per_cell", 1), ("shared", 1)] + ([("shared", 3)] if device == "cuda" else [])
    for hosts, per_gpu in runs:
        name = hosts if per_gpu == 1 else f"{hosts}-{per_gpu}-per-gpu"
        spec = work / f"sweep-{name}.yaml"
        body = {
            "name": f"gpu-capture-{name}",
            "models": [entry],
            "engines": ["hf"],
            "dtypes": ["fp32", "bf16", "f16"],
            "attention": KERNELS,
            "devices": [device],
            "reference": {"engine": "hf", "dtype": "fp32", "attention": "eager", "device": device},
            "positions": {"from": 0, "to": 255, "stride": 64, "last": False},
            "store": "bf16",
            "repeats": 2,
            "hosts": hosts,
            "cells_per_gpu": per_gpu,
            **({"max_tokens": corpus_max} if corpus_max else {}),
        }
        spec.write_text(yaml.safe_dump(body, sort_keys=False))
        t0 = time.perf_counter()
        result = api.run(str(spec), str(work / f"wh-{name}"), executor="local", log=lambda line: None)
        wall = time.perf_counter() - t0
        cells = _cells(work / f"wh-{name}")
        ran = [c for c in cells if c["status"] == "done"]
        load_s = sum(c["load_seconds"] or 0.0 for c in ran)
        rows.append(
            {
                "hosts": name,
                "device": device,
                "wall_s": wall,
                "cells_done": len(ran),
                "cells_skipped": sum(c["status"] == "skipped" for c in cells),
                "rows": result.rows_written,
                "loads": sum(c["loaded_by"] is None for c in ran),
                "load_s": load_s,
                "load_share": load_s / wall,
            }
        )
        r = rows[-1]
        print(
            f"  hosts: {name:20}  {r['wall_s']:6.1f}s wall, {r['cells_done']} cells done "
            f"({r['cells_skipped']} skipped), {r['loads']} loads taking {r['load_s']:.1f}s "
            f"= {100 * r['load_share']:.0f}% of the wall",
            flush=True,
        )
    for r in rows[1:]:
        print(f"  per_cell / {r['hosts']} wall = {rows[0]['wall_s'] / r['wall_s']:.2f}x")
    return rows


def _cells(wh: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(sorted(str(p) for p in (wh / "cells").glob("*.parquet"))).to_pylist()


def capture(hf_dir: str, prompts, device: str, dtype: str, attention: str, rounds: int) -> dict:
    """One stack: bare forward, forward + host copy, capture + store, every position, medians of rounds."""
    import statistics

    from actors.capture import capture_shard
    from common.positions import Positions
    from store.warehouse import ShardWriter

    be = _backend(hf_dir, dtype, attention, device)
    every = Positions.every(1)
    plan = [(ids, every.of(len(ids))) for _, ids in prompts]
    be.forward(*plan[0])  # first-call allocations and kernel selection are not what is measured
    bare, copied, full = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            bare.append(_timed(lambda: [_bare_forward(be, ids, pos) for ids, pos in plan], be))
            be.keep_outputs(2)  # the host buffers a capture copies into (page-locked on a GPU)
            copied.append(_timed(lambda: [be.forward(ids, pos) for ids, pos in plan], be))
            be.keep_outputs(0)
            t0 = time.perf_counter()
            m = capture_shard(be, ShardWriter(d, "bench", "cell", r), prompts, every)
            full.append(time.perf_counter() - t0)
    be.close()
    row = {
        "dtype": dtype,
        "attention": attention,
        "device": device,
        "rows": m["rows"],
        "bare_s": statistics.median(bare),
        "forward_copy_s": statistics.median(copied),
        "capture_s": statistics.median(full),
    }
    row["capture_over_forward_copy"] = row["capture_s"] / row["forward_copy_s"]
    print(
        f"  {dtype:5} {attention:10} {row['rows']} rows: bare forward {row['bare_s']:.3f}s, forward + host copy "
        f"{row['forward_copy_s']:.3f}s, capture + store {row['capture_s']:.3f}s "
        f"= {row['capture_over_forward_copy']:.2f}x forward + copy",
        flush=True,
    )
    return row


def _backend(hf_dir: str, dtype: str, attention: str, device: str):
    import os

    from backends.hf_backend import HFBackend
    from common.stack import StackDesc

    be = HFBackend(StackDesc.of(HFBackend.engine, dtype, attention, device=device), hf_dir, os.cpu_count() or 1)
    be.load()
    return be


def _bare_forward(be, ids: list[int], positions: list[int]) -> None:
    """The model's forward with the same rows kept as forward(), left on the device."""
    import torch

    from backends import hf_sdpa

    t = torch.tensor([ids], dtype=torch.long, device=be.torch_device)  # (1, T)
    keep = torch.tensor(positions, dtype=torch.long, device=be.torch_device)  # (rows,)
    with be._grad_off(), hf_sdpa.pinned(torch, be.model, be.stack.attention, len(ids)):
        be.model(input_ids=t, logits_to_keep=keep, use_cache=False)


def _timed(fn, be) -> float:
    import torch

    t0 = time.perf_counter()
    fn()
    if be.torch_device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--parts", default="sweep,capture,store")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None, help="feed each prompt's first N tokens (CPU: 1024)")
    ap.add_argument("--threads", default=None, help="store threads to measure, e.g. 1,2,4 (default: powers of 2)")
    args = ap.parse_args()
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    max_tokens = args.max_tokens or (1024 if device == "cpu" else None)
    parts = set(args.parts.split(","))
    print(f"{args.model} on {device}: {gpu() or 'no GPU'}; host {cpu()}", flush=True)
    out: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ref, entry = model_ref(args.model, work)
        resolved, prompts = _model(ref, max_tokens)
        if "sweep" in parts:
            print("sweep (scripts/gpu-check.sh's cells; the reference on the same device):", flush=True)
            out["sweep"] = sweep(entry, device, work, max_tokens)
        if "capture" in parts:
            print("capture + store at every position, against the forward:", flush=True)
            attention = "sdpa_flash" if device == "cuda" else "sdpa"
            out["capture"] = [
                capture(resolved.hf_dir, prompts, device, dt, attention, args.rounds) for dt in ("bf16", "fp32")
            ]
        if "store" in parts:
            print("store (ShardWriter) over the host's cores:", flush=True)
            out["store"] = _store(args.threads, model_vocab(resolved.hf_dir))
    rows = [{"part": k, **r} for k, v in out.items() for r in v]
    print(f"recorded: {save_result('gpu_capture', rows, _TARGET, _met(out))}")
    print(json.dumps(out, indent=1))


def _model(ref, max_tokens: int | None):
    """(the resolved model, its built-in corpus as [(prompt_id, ids)]), each prompt cut to max_tokens."""
    import sys

    import transformers

    from matrix.spec.corpus import tokenize
    from matrix.spec.models import fetch

    resolved = fetch(ref, log=lambda m: print(m, file=sys.stderr))
    tok = transformers.AutoTokenizer.from_pretrained(resolved.hf_dir)
    prompts = tokenize("builtin", ref.name, tok, "tokenizer")
    return resolved, [(p.prompt_id, p.token_ids[:max_tokens]) for p in prompts]


def model_vocab(hf_dir: str) -> int:
    """The model's logits per row (config.json vocab_size, or its text_config's)."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def _store(threads: str | None, vocab: int) -> list[dict]:
    """benchmarks/store_scaling.py at this model's vocabulary: 5 prompts of 300 rows, bf16 and fp32."""
    import os

    from store_scaling import logits_rows, store_scaling, thread_counts

    counts = [int(t) for t in threads.split(",")] if threads else thread_counts(os.cpu_count() or 1)
    rows = {dt: logits_rows(5, 300, vocab, dt) for dt in ("bf16", "fp32")}
    out = store_scaling(rows, counts)
    for r in out:
        print(
            f"  {r['dtype']:5} {r['threads']:3} threads: {r['rows_s']:8.1f} rows/s, {r['mb_s']:7.1f} MB/s "
            f"= {r['ratio']:.2f}x one thread",
            flush=True,
        )
    return out


_TARGET = (
    "store at 2 threads >= 1.7x 1 thread (CPU); on a GPU: the sweep <= 60 s and capture + store <= 2.0x "
    "forward + host copy for the bf16 stack"
)


def _met(out: dict) -> bool | None:
    """Whether the figures measured reach their targets (None: none of them measured)."""
    checks = []
    store = {r["threads"]: r for r in out.get("store", []) if r.get("dtype") == "bf16"}
    if 1 in store and 2 in store:
        checks.append(store[2]["rows_s"] >= 1.7 * store[1]["rows_s"])
    for r in out.get("capture", []):
        if r["device"] == "cuda" and r["dtype"] == "bf16":
            checks.append(r["capture_over_forward_copy"] <= 2.0)
    fastest = min((r["wall_s"] for r in out.get("sweep", []) if r["device"] == "cuda"), default=None)
    if fastest is not None:
        checks.append(fastest <= 60)
    return all(checks) if checks else None


if __name__ == "__main__":
    main()
