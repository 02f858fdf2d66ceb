#!/usr/bin/env bash
# One prepared GPU check: a small real sweep on one NVIDIA GPU, a warehouse, a summary.
#   scripts/gpu-check.sh MODEL_DIR|MODEL.tar.xz|MODEL.gguf[.xz] [OUT_DIR]
# MODEL: a local HF model directory (the GPU box may have no network), a .tar.xz of one, or a GGUF
# (dequantised there). What fits a 64 MiB upload next to Ray: `matrix models cut smollm2-135m
# --layers 1 --gguf --out m.gguf && xz -9 m.gguf` (31 MB: the source's own quantised bytes).
# Runs HF eager / sdpa
# (+ flash_attention_2 when flash-attn is importable) at fp32 and bf16 on `cuda`; when vllm is
# importable, vLLM bf16 with its default, FLASH_ATTN, TRITON_ATTN (+ FLASHINFER when installed)
# attention, once through its Ray executor in our placement group, and fp8 quantised at load; TensorRT-LLM when
# tensorrt_llm is importable; TP=1; then analyze (+ report and two SQL summaries when duckdb is
# importable). OUT_DIR/warehouse-tables.tar.gz holds every warehouse file but the logits shards,
# so `matrix report` / `matrix sql` can read the results on another machine.
set -euo pipefail
model=${1:?usage: gpu-check.sh MODEL_DIR|MODEL.tar.xz|MODEL.gguf[.xz] [OUT_DIR]}
out=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
unpacked=$(mktemp -d)  # not under OUT_DIR: the model need not come back with the results
case "$model" in
  *.tar.xz)
    tar -xJf "$model" -C "$unpacked"
    model=$(dirname "$(find "$unpacked" -name config.json | head -n 1)") ;;
  *.gguf.xz)
    xz -dc "$model" > "$unpacked/$(basename "${model%.xz}")"
    model="$unpacked/$(basename "${model%.xz}")" ;;
esac
case "$model" in
  *.gguf) test -f "$model" || { echo "gpu-check.sh: $model is not a file" >&2; exit 2; }
          source_key=gguf ;;
  *) test -f "$model/config.json" || { echo "gpu-check.sh: $model has no config.json" >&2; exit 2; }
     source_key=path ;;
esac
py=${PYTHON:-python3}
export RAY_AUTH_MODE=disabled
if ! "$py" -c "import matrix" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --no-build-isolation -e .
fi
has() { "$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
need="ray torch transformers pyarrow yaml numpy safetensors"
[ "$source_key" = gguf ] && need="$need gguf"
missing=""
for m in $need; do has "$m" || missing="$missing $m"; done
[ -z "$missing" ] || { echo "gpu-check.sh: $py cannot import:$missing (install them first)" >&2; exit 2; }
attn="[eager, sdpa]"
if has flash_attn; then attn="[eager, sdpa, flash_attention_2]"; fi
extra=""
if has vllm; then
  export LOGIT_MATRIX_VLLM_PYTHON="$(command -v "$py")"  # vLLM lives in this interpreter here
  vattn="default flash_attn triton_attn"
  if has flashinfer; then vattn="$vattn flashinfer"; fi
  for a in $vattn; do
    extra="$extra  - {engine: vllm, dtype: bf16, attention: $a, device: cuda}"$'\n'
  done
  extra="$extra  - {engine: vllm, dtype: bf16, attention: default, device: cuda, vllm_executor: ray}"$'\n'
  # fp8 weights quantised by vLLM at load (fp8 tensor cores: H100 / H200 / B200; older GPUs refuse it)
  extra="$extra  - {engine: vllm, dtype: fp8, attention: default, device: cuda}"$'\n'
fi
if has tensorrt_llm; then
  extra="$extra  - {engine: trtllm, dtype: bf16, attention: default, device: cuda}"$'\n'
fi
cat > "$out/gpu.yaml" <<YAML
name: gpu-check
models: [{name: m, $source_key: $model}]
engines: [hf]
dtypes: [fp32, bf16]
attention: $attn
devices: [cuda, cpu]
exclude: [{device: cpu, dtype: bf16}, {device: cpu, attention: sdpa}, {device: cpu, attention: flash_attention_2}]
include:
$( [ -n "$extra" ] && printf '%s' "$extra" || echo "  []" )
reference: {engine: hf, dtype: fp32, attention: eager, device: cpu}
stride: 32
repeats: 2
YAML
"$py" -m matrix cells "$out/gpu.yaml"
"$py" -m matrix run "$out/gpu.yaml" --warehouse "$out/wh"
"$py" -m matrix analyze --warehouse "$out/wh"
tar -czf "$out/warehouse-tables.tar.gz" -C "$out/wh" --exclude=./logits --exclude=./.lock .
if ! has duckdb; then
  echo "gpu-check.sh: no duckdb here: report and SQL skipped (read $out/warehouse-tables.tar.gz elsewhere)"
  exit 0
fi
"$py" -m matrix report --warehouse "$out/wh" --out "$out/report"
"$py" -m matrix sql "select c.engine, c.device, c.dtype, c.attention, c.options, s.kld_mean, s.kld_p99, s.top1_agreement, c.bit_reproducible
                     from summary s join cells c using (cell_id) order by c.engine, c.device, c.dtype, c.attention" --warehouse "$out/wh"
"$py" -m matrix sql "select distinct json_extract_string(fingerprint, '$.nvidia.gpus[0].name') as gpu,
                     json_extract(fingerprint, '$.nvidia.gpus[0].sm_count') as sms,
                     json_extract_string(fingerprint, '$.nvidia.driver') as driver
                     from cells where device = 'cuda'" --warehouse "$out/wh"
