#!/usr/bin/env bash
# Everything the GPU reports come from, in one run on one machine: the GPU tests, the matmul sweep and the price
# of reproducibility. Usage: bench/gpu_run.sh OUT_DIR [STAGE...], stages: tests sweep tune speed divergence
# (default: tests sweep speed divergence). `tune` is `sweep` that also rewrites matmul_plans.TUNED in this copy of
# the tree (and leaves the new matmul_plans.py in OUT_DIR), so that the stages after it run the new plans. Each
# stage writes its JSON and log under OUT_DIR; a failing stage does not stop the others.
set -u
out=${1:?usage: bench/gpu_run.sh OUT_DIR [tests] [sweep] [tune] [speed] [divergence]}
shift
stages=${*:-tests sweep speed divergence}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$out/gpu.txt" 2>&1
for stage in $stages; do
    start=$(date +%s)
    case $stage in
    tests)
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_triton.py tests/test_kernels_triton_gluon.py \
            tests/test_kernels_triton_fused.py tests/test_attention_triton_split.py tests/test_step_graphs.py \
            tests/test_dependent_launch.py \
            tests/test_backend_cuda.py >"$out/pytest.log" 2>&1
        ;;
    sweep) python3 -m bench.gpu_kernels "$out/kernels.json" --budget-s="${SWEEP_BUDGET_S:-300}" >"$out/kernels.log" 2>&1 ;;
    tune)
        python3 -m bench.gpu_kernels "$out/kernels.json" --budget-s="${SWEEP_BUDGET_S:-300}" --write-tuned \
            >"$out/kernels.log" 2>&1
        status=$?
        cp pinned_backend/kernels/triton/matmul_plans.py "$out/matmul_plans.py"
        (exit $status)
        ;;
    speed) python3 -m bench.gpu_price "$out/price.json" --parts speed >"$out/price.log" 2>&1 ;;
    divergence)
        python3 -m bench.gpu_price "$out/divergence.json" --parts divergence --embed-std 0.02 \
            --trials "${TRIALS:-1000}" --budget-s "${DIVERGENCE_BUDGET_S:-150}" >"$out/divergence.log" 2>&1
        ;;
    *) echo "unknown stage $stage" >&2 ;;
    esac
    echo "== $stage: exit $? in $(($(date +%s) - start)) s"
done
for stage in $stages; do
    case $stage in
    tests) tail -n 3 "$out/pytest.log" ;;
    sweep | tune) sed -n '/^shape/,$p' "$out/kernels.log" ;;
    speed) sed -n '/^NVIDIA\|^copy\|^matmul worst\|^batch\|^ *[0-9]\|^decode step/p' "$out/price.log" | tail -n 12 ;;
    divergence) grep '^divergence' "$out/divergence.log" | tail -n 2 ;;
    esac
done
