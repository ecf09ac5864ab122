#!/usr/bin/env bash
# One GPU session's checks in one go, within GPU_CHECK_BUDGET_S seconds (default 525: a 9-minute device call with
# room to copy the results back). In order of value:
#   1. the CUDA tests: every cuda-marked test (each family's parity on CUDA, the backends, the conversions), then
#      our Triton kernel's tests compiled for the GPU;
#   2. python -m benchmarks.gpu_check: hf_tiny beside official transformers at the shapes users run (random
#      TinyLlama-1.1B shape, bf16), every target of issue 42 beside its measured value (PASS / FAIL / not run);
#   3. where more than 150 s are left (a second call's): python -m benchmarks.moe_decode, captured decoding of a random
#      Mixtral at batch 1 and 8 (official, hf_tiny, hf_tiny with the routed loop in the step): moe-decode.md.
# Everything lands under $OUT (default /tmp/gpu_check): device.txt, the test logs, failures.log (each failing test's
# traceback, written as it fails: a cut-off test run still names them), gpu-check-<device>-<date>.md/.json.
# No network is needed: nothing is installed; flash-attn and liger-kernel are used where the image has them (the
# image has neither: carry liger-kernel's wheel, see benchmarks/README.md).
# Measured on one H200: the CUDA tests took ~140 s (2026-11-27, 2026-11-28) and ran into their 220 s cap at 90%
# (2026-11-30, 19 more since: captured decoding under CUDA graphs, Liger, the flash-attn package), our Triton
# kernel's 24 tests 57 s (a GPU runs 12 of the property test's 40 draws and 4 of 8 with sinks), the stages after
# them ~470 s, so one 9-minute call ends after batch-1 captured decode or the stages just before it; a
# second call on the same warm machine finishes the rest, and one page is made of both
# (name the stages the first call's page lists "not run"; longest-hf_tiny_fit needs longest-official in its call):
#   GPU_CHECK_SKIP_TESTS=1 GPU_CHECK_ARGS="--stages eager-paired,captured-official-8,captured-hf_tiny-8,longest-official,longest-hf_tiny_fit,longest-hf_tiny,main-hf_tiny_off" bash benchmarks/gpu_check.sh
#   python -m benchmarks.gpu_report --merge FIRST.json SECOND.json --out benchmarks/results/gpu-check-DEVICE-DATE.md
#
#   bash benchmarks/gpu_check.sh              on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run    on a CPU: the benchmark part with a 2-layer model (no tests)
#   HF_TINY_REVISION=<commit> bash benchmarks/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the GPU machine has no network: never wait on a download
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-525}
START=$(date +%s)
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

if [ "${1:-}" = "--dry-run" ]; then
  exec $PYTHON -m benchmarks.gpu_check --dry-run --out "$OUT" --budget-s "$(( $(left) - 15 ))" ${GPU_CHECK_ARGS:-}
fi

{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PYTHON -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# pytest plugins of the image: per-test timeout and parallel workers only where installed
PYTEST=($PYTHON -m pytest -p no:cacheprovider -rfEs)
if $PYTHON -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout 200); fi
if $PYTHON -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); else PARALLEL=(); fi
export HF_TINY_FAILURE_LOG="$OUT/failures.log"  # tests/conftest.py appends each failure there as it happens

# every file with cuda-marked tests; captured decoding first: its two tests (Llama, Mixtral) compile with inductor and
# record CUDA graphs in fresh processes, ours then official's, the longest tests here (hence the per-test timeout)
CUDA_MARKED=(tests/ecosystem/test_captured_decoding.py tests/models/test_cuda_families.py tests/models/test_cuda.py
  tests/models/test_gpt_oss.py tests/models/test_numerics.py tests/models/test_attention.py tests/models/test_seq2seq.py
  tests/conversion/test_bart.py tests/conversion/test_bert.py tests/conversion/test_t5.py tests/runtime/test_memory_fit.py
  tests/ecosystem/test_liger.py tests/models/test_flash_attn_package.py tests/ecosystem/test_distributed.py)
# the logs this call's page quotes: its own tests' only (a second call on the same $OUT keeps the first call's logs
# for the first call's page, and the merged page quotes them once)
TEST_LOGS=()
if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]; then  # 1: a later session that only finishes benchmark stages
  rm -f "$HF_TINY_FAILURE_LOG"
  TEST_LOGS=(--tests-log "$OUT/cuda_tests.log" --tests-log "$OUT/flash_kernel_tests.log" --failures-log "$HF_TINY_FAILURE_LOG")
  # -v: each test's name as it ends, so a run cut at its cap (the 2026-11-30 H200 run, at 90%) names what it reached
  # 260 s: the 2026-11-30 run reached 90% of them in 220 s
  timeout 260 "${PYTEST[@]}" -v "${PARALLEL[@]}" -m cuda "${CUDA_MARKED[@]}" 2>&1 | tee "$OUT/cuda_tests.log" | tail -30
  timeout 120 "${PYTEST[@]}" -q "${PARALLEL[@]}" tests/models/test_flash_triton.py 2>&1 | tee "$OUT/flash_kernel_tests.log" | tail -15
fi

BENCH_S=$(( $(left) - 15 ))
timeout $(( BENCH_S + 10 )) $PYTHON -m benchmarks.gpu_check --out "$OUT" --budget-s "$BENCH_S" \
  "${TEST_LOGS[@]}" --device-file "$OUT/device.txt" \
  ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.log" 2>&1
grep '^\[gpu_check' "$OUT/gpu_check.log"
if [ "$(left)" -gt 150 ]; then  # time left after the stages (a second call's): captured decoding of an MoE model
  timeout $(( $(left) - 10 )) $PYTHON -m benchmarks.moe_decode --batches 1,8 --out "$OUT/moe-decode.md" > "$OUT/moe_decode.log" 2>&1
  tail -6 "$OUT/moe-decode.md" 2>/dev/null || tail -5 "$OUT/moe_decode.log"
fi
sed -n '/^## Targets/,/^## Side by side/p' "$OUT"/gpu-check-*.md 2>/dev/null
echo "gpu_check.sh: $(( $(date +%s) - START )) s of $BUDGET_S"
