#!/usr/bin/env bash
# Join a machine the cloud launcher cannot create to a running logit-matrix cluster.
#   scripts/join-node.sh DEVICE HEAD_IP:6379
# The cluster uses Ray's token auth: give its token the way Ray looks for it, RAY_AUTH_TOKEN,
# else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (copy the one `ray up` used:
# scp ~/.ray/auth_token HOST:.ray/auth_token).
# DEVICE: sm120 | mi300x | rocm | apple-m1 .. apple-m4 | cpu | h200 | b200 | cuda
# Installs logit-matrix with the extras that device runs, then starts a Ray worker that
# advertises the device the way matrix/run/placement.py looks for it.
set -euo pipefail
device=${1:?usage: join-node.sh DEVICE HEAD_IP:6379}
head=${2:?usage: join-node.sh DEVICE HEAD_IP:6379}
here=$(cd "$(dirname "$0")/.." && pwd)
case "$device" in
  apple-m*) extras="mlx,llamacpp"; res="--resources={\"$device\": 1}"; labels="logit-matrix.io/device=$device" ;;
  mi300x|rocm) extras="hf,llamacpp"; res=""; labels="logit-matrix.io/device=$device"
               export CMAKE_ARGS="-DGGML_HIP=ON" ;;
  cpu) extras="hf,llamacpp"; res=""; labels="logit-matrix.io/device=cpu"
       export CMAKE_ARGS="$(python3 "$here/scripts/llama_cmake_args.py")" ;;  # this CPU's instruction sets, AMX excepted
  sm120|h200|b200|h100|cuda) extras="hf,llamacpp"; res=""; labels="logit-matrix.io/device=$device"
                             export CMAKE_ARGS="-DGGML_CUDA=ON" ;;
  *) echo "join-node.sh: unknown device $device" >&2; exit 2 ;;
esac
# Checked before installing anything; the token itself is never printed.
token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
if [ -z "${RAY_AUTH_TOKEN:-}" ] && ! { [ -r "$token_file" ] && [ -s "$token_file" ]; }; then
  echo "join-node.sh: no cluster token: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or copy it to ~/.ray/auth_token" >&2
  exit 2
fi
# Ray as the head runs it (every node of a cluster needs the same Ray): the lock's version; 2.52 at least (token auth)
ray_pin=$(grep -i '^ray==' "$here/constraints/cpu.txt" 2>/dev/null | cut -d= -f3 || true)
if [ -n "$ray_pin" ]; then ray_spec="ray==$ray_pin"; else ray_spec="ray>=2.52"; fi
python3 -m pip install -q "$ray_spec"
# a CPU node installs from the lock, as `make venv` does (a GPU or Apple node brings its own torch / MLX)
lock=()
if [ "$device" = cpu ] && [ -f "$here/constraints/cpu.txt" ]; then lock=(-c "$here/constraints/cpu.txt"); fi
python3 -m pip install -q "${lock[@]}" -e "$here[$extras,s3]"
case "$device" in
  # (ROCm: PyPI's vllm is the CUDA build; use AMD's ROCm vLLM and point LOGIT_MATRIX_VLLM_PYTHON at it)
  sm120|h200|b200|h100|cuda)
    # vLLM pins its own torch: its own venv, where the vllm backend looks (.venv-vllm), same Ray version
    if [ ! -x "$here/.venv-vllm/bin/python" ]; then
      python3 -m venv "$here/.venv-vllm"
      "$here/.venv-vllm/bin/pip" install -q vllm "ray==$(python3 -c 'import ray; print(ray.__version__)')" \
        pyarrow pyyaml nvidia-ml-py duckdb
      "$here/.venv-vllm/bin/pip" install -q --no-deps -e "$here"
    fi ;;
esac
ray stop || true
# RAY_START_ARGS: more `ray start` flags, e.g. fixed ports for a firewall
# ("--node-manager-port 6380 --object-manager-port 6381 --min-worker-port 10002 --max-worker-port 10200")
# shellcheck disable=SC2086
RAY_AUTH_MODE=token ray start --address="$head" --labels="$labels" $res ${RAY_START_ARGS:-}
