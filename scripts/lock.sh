#!/bin/bash
# Write constraints/cpu.txt: every package of the CPU dev environment (.venv) at its version, so a
# fresh `make venv` next month installs what was tested today. torch is left out: the Makefile pins
# the CPU wheel itself (TORCH_SPEC), and a GPU box brings its own torch; a constraint on it would
# be something that box has to undo. Run after changing pyproject.toml: `make lock`.
set -euo pipefail
VENV=${VENV:-.venv}
out=constraints/cpu.txt
{
  echo "# pip constraints for the CPU environment the Makefile builds (scripts/lock.sh wrote this from"
  echo "# $VENV on $(uname -m), Python $($VENV/bin/python -c 'import platform; print(platform.python_version())'))."
  echo "# torch is pinned by TORCH_SPEC in the Makefile, not here. CONSTRAINTS= make venv installs unpinned."
  "$VENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(torch==|triton==|nvidia-(cu|cudnn|nccl|nvjitlink|nvtx|cusparselt|cufile))' | LC_ALL=C sort -f
} > "$out"
echo "wrote $out ($(grep -vc '^#' "$out") packages)"
