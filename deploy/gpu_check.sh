#!/usr/bin/env bash
# The prepared device check for a lent GPU (never in CI): what it needs is on the device's
# image (torch, transformers, grpcio); it runs the engine's CUDA passes from CUDA
# graphs, and writes its figures and log under $OUT (deploy/gpu_check.py says what it measures).
# Then the CUDA tests of the sampling rule, the penalties and batch-invariant speculation
# through the services (tests/gpu, at most 3 minutes; GPU_CHECK_TESTS=0 leaves them out).
# About 7 minutes on an H100 (GPU_CHECK_DEADLINE_S: no variant starts past it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
} | tee "$OUT/gpu_check.log"
PYTHONUNBUFFERED=1 python3 -m deploy.gpu_check "$OUT" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/gpu_check.log"
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu -k "draws or penalties or batch_invariant" \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log" || true
fi
