#!/usr/bin/env bash
# One prepared GPU check, made to run on a bare CUDA image (PyTorch, transformers, pyarrow, pyyaml,
# nvidia-ml-py; no Ray, DuckDB, llama.cpp or vLLM, no package index): the local executor captures
# HF on `cuda` at fp32, bf16 and f16 with eager attention and each of PyTorch's SDPA kernels
# (sdpa_math, sdpa_flash, sdpa_efficient, sdpa_cudnn; a kernel the GPU lacks for a dtype skips
# that cell), 2 repeats each, into OUT_DIR/warehouse, with the GPU's fingerprint (nvidia-ml-py).
# Without a GPU it runs the same sweep on the CPU (the kernels PyTorch has there).
#
#   scripts/gpu-check.sh MODEL [OUT_DIR]               the sweep (OUT_DIR: $OUT, else /tmp/gpu-check)
#   scripts/gpu-check.sh --reference MODEL OUT_DIR     the CPU fp32 reference of the same model file
#
# MODEL: a GGUF (.gguf or .gguf.xz; dequantised here), an HF directory, or a .tar.xz of one. What
# travels in 64 MiB with the tree: `matrix models cut smollm2-135m --layers 12 --gguf --out m.gguf
# && xz -9 m.gguf` (51 MiB). Then, where the reference was captured:
#   matrix merge OUT_DIR/warehouse --into REF_OUT/warehouse
#   matrix analyze --warehouse REF_OUT/warehouse --reference "$(cat REF_OUT/reference-cell)"
# Rows are kept small so every file under OUT_DIR stays under 16 MiB and all of them under
# 64 MiB: a window of each prompt's first 256 positions, every 64th, stored as bf16 (the floor
# that rounding costs is recorded and subtracted by analysis). GPU_CHECK_POSITIONS overrides it.
# Packages the image lacks travel as pure-Python wheels in GPU_CHECK_WHEELS (default gpu-wheels/,
# made by `make gpu-wheels`): they go on PYTHONPATH as they are, nothing is installed.
set -euo pipefail
reference=0
if [ "${1:-}" = "--reference" ]; then reference=1; shift; fi
model=${1:?usage: gpu-check.sh [--reference] MODEL_DIR|MODEL.gguf[.xz]|MODEL.tar.xz [OUT_DIR]}
out=${2:-${OUT:-/tmp/gpu-check}}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
unpacked=$(mktemp -d)  # not under OUT_DIR: the model need not come back with the results
trap 'rm -rf "$unpacked"' EXIT
case "$model" in
  *.tar.xz) tar -xJf "$model" -C "$unpacked"; model=$(dirname "$(find "$unpacked" -name config.json | head -n 1)") ;;
  *.gguf.xz) xz -dc "$model" > "$unpacked/$(basename "${model%.xz}")"; model="$unpacked/$(basename "${model%.xz}")" ;;
esac
case "$model" in
  *.gguf) test -f "$model" || { echo "gpu-check.sh: $model is not a file" >&2; exit 2; }; source_key=gguf ;;
  *) test -f "$model/config.json" || { echo "gpu-check.sh: $model has no config.json" >&2; exit 2; }; source_key=path ;;
esac
name=$(basename "${model%.gguf}")

# The project from this tree, and the carried wheels, on PYTHONPATH: nothing is installed.
wheels=${GPU_CHECK_WHEELS:-$root/gpu-wheels}
pypath=$root
carried=0
for w in "$wheels"/*.whl; do
  [ -f "$w" ] || continue
  pypath="$pypath:$w"
  size=$(stat -c %s "$w"); carried=$((carried + size))
  echo "gpu-check.sh: carried wheel $(basename "$w") ($((size / 1024)) KiB)"
done
echo "gpu-check.sh: carried wheels: $((carried / 1024)) KiB in all"
export PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}"
has() { "$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
need="torch transformers tokenizers safetensors pyarrow yaml numpy pynvml"
[ "$source_key" = gguf ] && need="$need gguf accelerate"  # transformers loads a GGUF only with accelerate
missing=""
for m in $need; do has "$m" || missing="$missing $m"; done
[ -z "$missing" ] || { echo "gpu-check.sh: $py cannot import:$missing (carry their wheels in $wheels: make gpu-wheels)" >&2; exit 2; }

if [ "$reference" = 1 ]; then
  device=cpu; dtypes="[fp32]"; attn="[eager]"
elif "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device=cuda; dtypes="[fp32, bf16, f16]"; attn="[eager, sdpa_math, sdpa_flash, sdpa_efficient, sdpa_cudnn]"
else
  echo "gpu-check.sh: no CUDA device here: the CPU path (the same sweep on cpu)"
  device=cpu; dtypes="[fp32, bf16, f16]"; attn="[eager, sdpa_math, sdpa_flash, sdpa_efficient, sdpa_cudnn]"
fi
# GPU_CHECK_BATCH="[1, 8, 32]": also HF bf16 (eager, sdpa_math, sdpa_flash) at those batch sizes, each
# prompt among the corpus's next ones (common/batching.py); once merged and analysed, batch_drift
# gives each against its batch-1 cell and summary against the CPU reference.
batch_include=""
if [ -n "${GPU_CHECK_BATCH:-}" ] && [ "$reference" = 0 ]; then
  batch_include="include:"
  for a in eager sdpa_math sdpa_flash; do
    batch_include="$batch_include
  - {engine: hf, dtype: bf16, attention: $a, device: $device, batch: $GPU_CHECK_BATCH}"
  done
fi
spec="$out/gpu-check.yaml"
cat > "$spec" <<YAML
name: gpu-check
description: HF at fp32 / bf16 / f16, eager and each SDPA kernel, on one device (scripts/gpu-check.sh)
models: [{name: $name, $source_key: $model}]
engines: [hf]
dtypes: $dtypes
attention: $attn
devices: [$device]
reference: {engine: hf, dtype: fp32, attention: eager, device: $device}
$batch_include
positions: ${GPU_CHECK_POSITIONS:-"{from: 0, to: 255, stride: 64, last: false}"}
store: bf16
repeats: 2
YAML
"$py" -m matrix run "$spec" --warehouse "$out/warehouse" --executor local
"$py" -m matrix verify --warehouse "$out/warehouse"
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path

import pyarrow.parquet as pq

out = Path(sys.argv[1])
cells = pq.read_table(sorted(str(p) for p in (out / "warehouse" / "cells").glob("*.parquet"))).to_pylist()
rows = []
for c in sorted(cells, key=lambda c: c["cell_id"]):
    fp = json.loads(c["fingerprint"] or "{}").get("nvidia") or {}
    gpu = (fp.get("gpus") or [{}])[0]
    rows.append({"cell_id": c["cell_id"], "status": c["status"], "bit_reproducible": c["bit_reproducible"],
                 "gpu": gpu.get("name"), "driver": fp.get("driver"), "cuda_driver": fp.get("cuda_driver"),
                 "torch_cuda": json.loads(c["settings"] or "{}").get("cuda"), "nvml": fp.get("status")})
    print(f"{c['cell_id']:70} {c['status']:8} bit_reproducible={c['bit_reproducible']} gpu={gpu.get('name')}")
(out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
ref = next(c["cell_id"] for c in cells if c["is_reference"])
(out / "reference-cell").write_text(ref + "\n")
PY
# Every file that comes back: under 16 MiB each, 64 MiB in all.
"$py" - "$out" <<'PY'
import sys
from pathlib import Path

files = [p for p in Path(sys.argv[1]).rglob("*") if p.is_file()]
total, biggest = sum(p.stat().st_size for p in files), max(files, key=lambda p: p.stat().st_size)
print(f"gpu-check.sh: {len(files)} files, {total / 2**20:.1f} MiB in all; the largest {biggest.name} "
      f"{biggest.stat().st_size / 2**20:.1f} MiB")
if biggest.stat().st_size >= 16 * 2**20 or total >= 64 * 2**20:
    sys.exit("gpu-check.sh: over the limits (16 MiB a file, 64 MiB in all): narrow GPU_CHECK_POSITIONS")
PY
