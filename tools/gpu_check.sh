#!/usr/bin/env bash
# One device run for the numba_cuda backend: environment facts, parallel precompile (fills
# numba's disk cache), the GPU tests (pytest -m gpu), then the benchmark; logs under $OUT,
# a short table last. Usage: bash tools/gpu_check.sh [pytest args...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import numpy, numba, numba_cuda, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)"
} 2>&1 | tee "$OUT/env.log"
python3 tools/gpu_precompile.py 12 2>&1 | tee "$OUT/precompile.log" | tail -3
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/test_numba_cuda_gpu.py "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
${SKIP_BENCH:+true} python3 tools/gpu_bench.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -22
