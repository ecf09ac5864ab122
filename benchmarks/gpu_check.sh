#!/usr/bin/env bash
# One GPU session's checks, in one go (the device time is short): the CUDA-marked tests, the CUDA causal tests and the
# Triton kernel's GPU cases, then the benchmarks on CUDA with the random-weight models (the GPU image carries no
# weight packages). Everything lands under $OUT (default /tmp/gpu_check).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m cuda --timeout 120 tests/test_attention.py \
  tests/test_convert_bart.py tests/test_convert_bert.py tests/test_convert_t5.py tests/test_seq2seq_model.py \
  2>&1 | tee "$OUT/cuda_marked_tests.log" | tail -25
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 tests/test_causal_cuda.py tests/test_flash_triton.py \
  2>&1 | tee "$OUT/causal_cuda_tests.log" | tail -25
timeout 170 python3 -m benchmarks.run --device cuda --quick --models overhead,llama1b --repeats 3 --no-sweep \
  --out "$OUT/benchmarks" --note "GPU check, quick shapes, random weights" 2>&1 | tee "$OUT/benchmarks.log" | tail -40
