#!/usr/bin/env bash
# Everything the GPU reports come from, in one run on one machine, from the repository root. Usage:
#   bench/gpu_run.sh OUT_DIR [STAGE...]     stages: tests sweep tune matmul speed divergence features moe families
# (default: tests sweep speed divergence features). `sweep` tunes plans for TUNE_MODELS (default bench/models/qwen3-1.7b)
# into a plan file in OUT_DIR; `tune` writes it among the shipped ones in this copy of the tree instead (and copies
# the shipped files to OUT_DIR), so that the stages after it serve it. `matmul` times the served plans and the rule against cuBLAS for
# MATMUL_MODELS (default Qwen3-8B, Llama-3.1-8B, Qwen3-32B). `features` runs bench/serving_features.py on the
# Qwen3-1.7B-shaped model, and on the tiny model too when TINY_MODEL names its folder. `moe` runs bench/moe_price.py on
# the Qwen3-30B-A3B-shaped model (61 GB of random weights on the GPU). `families` runs bench/families_price.py on
# FAMILY_MODELS (default Gemma 3 12B, gpt-oss-20b and DeepSeek-V3 shapes, the last with as many layers as fit). Each
# stage writes its JSON and log under OUT_DIR; a failing stage does not stop the others.
set -u
out=${1:?usage: bench/gpu_run.sh OUT_DIR [tests] [sweep] [tune] [matmul] [speed] [divergence] [features] [moe] [families]}
shift
stages=${*:-tests sweep speed divergence features}
tune_models=${TUNE_MODELS:-bench/models/qwen3-1.7b}
matmul_models=${MATMUL_MODELS:-bench/models/qwen3-8b bench/models/llama-3.1-8b bench/models/qwen3-32b}
family_models=${FAMILY_MODELS:-bench/models/gemma3-12b bench/models/gpt-oss-20b bench/models/deepseek-v3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$out/gpu.txt" 2>&1
for stage in $stages; do
    start=$(date +%s)
    case $stage in
    tests)
        python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/test_kernels_triton.py tests/test_kernels_triton_gluon.py \
            tests/test_kernels_triton_fused.py tests/test_attention_triton_split.py tests/test_step_graphs.py \
            tests/test_dependent_launch.py \
            tests/test_backend_cuda.py tests/test_invariance.py tests/test_kernels_expert_matmul.py \
            tests/test_kernels_triton_variants.py tests/test_families.py >"$out/pytest.log" 2>&1
        ;;
    sweep | tune)
        # The plan file is named for the GPU, Triton and models; `tune` writes it among the shipped ones.
        plans_dir=$out
        [ "$stage" = tune ] && plans_dir=pinned_backend/kernels/triton/plans
        # shellcheck disable=SC2086  # one argument per model folder
        python3 -m pinned_backend.cli tune $(printf -- '--model %s ' $tune_models) --out "$plans_dir" \
            --report "$out/tune.json" --budget-s "${SWEEP_BUDGET_S:-300}" >"$out/tune.log" 2>&1
        status=$?
        [ "$stage" = tune ] && cp "$plans_dir"/*.json "$out/" 2>/dev/null
        (exit $status)
        ;;
    matmul)
        # shellcheck disable=SC2086
        python3 -m bench.gpu_kernels "$out/matmul.json" $(printf -- '--model %s ' $matmul_models) >"$out/matmul.log" 2>&1
        ;;
    speed) python3 -m bench.gpu_price "$out/price.json" --parts speed >"$out/price.log" 2>&1 ;;
    divergence)
        python3 -m bench.gpu_price "$out/divergence.json" --parts divergence --embed-std 0.02 \
            --trials "${TRIALS:-1000}" --budget-s "${DIVERGENCE_BUDGET_S:-150}" >"$out/divergence.log" 2>&1
        ;;
    features)
        python3 -m bench.serving_features "$out/features.json" --device cuda --model qwen3-1.7b-random \
            --rounds "${ROUNDS:-3}" >"$out/features.log" 2>&1
        if [ -n "${TINY_MODEL:-}" ]; then
            python3 -m bench.serving_features "$out/features_tiny.json" --device cuda --model "$TINY_MODEL" \
                --rounds "${ROUNDS:-3}" >"$out/features_tiny.log" 2>&1
        fi
        ;;
    moe)
        python3 -m bench.moe_price "$out/moe.json" --trials "${TRIALS:-1000}" --budget-s "${DIVERGENCE_BUDGET_S:-95}" \
            >"$out/moe.log" 2>&1
        ;;
    families)
        # shellcheck disable=SC2086  # one argument per model folder
        python3 -m bench.families_price "$out/families.json" $(printf -- '--model %s ' $family_models) \
            >"$out/families.log" 2>&1
        ;;
    *) echo "unknown stage $stage" >&2 ;;
    esac
    echo "== $stage: exit $? in $(($(date +%s) - start)) s"
done
for stage in $stages; do
    case $stage in
    tests) tail -n 3 "$out/pytest.log" ;;
    sweep | tune) sed -n '/plan file/,$p' "$out/tune.log" ;;
    matmul) sed -n '/^model/,$p' "$out/matmul.log" ;;
    speed) sed -n '/^NVIDIA\|^copy\|^matmul worst\|^batch\|^ *[0-9]\|^decode step/p' "$out/price.log" | tail -n 12 ;;
    divergence) grep '^divergence' "$out/divergence.log" | tail -n 2 ;;
    features) sed -n '/ on NVIDIA/,$p' "$out"/features*.log ;;
    moe) sed -n '/^NVIDIA/,$p' "$out/moe.log" ;;
    families) sed -n '/^NVIDIA/,$p' "$out/families.log" ;;
    esac
done
