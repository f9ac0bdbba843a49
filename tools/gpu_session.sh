#!/usr/bin/env bash
# One device call of a session: set up (NumPy 2.4 wheel from .whl/, flashcore importable
# from the tree), then the stages named, logs under $OUT, a short summary last:
#   tests:  precompile every kernel variant (and the sweep's candidates), pytest -m gpu
#   sweep:  tools/simt_sweep.py (SWEEP_DIMS, SWEEP_ARGS, e.g. --fwd-only)
#   host:   tools/host_breakdown.py
#   bench:  tools/gpu_final.sh bench (the side-by-side table)
#   ncu:    tools/ncu_simt.sh (KERNELS, default attn_forward; NCU_D, default 128)
# Usage (device, repository root): bash tools/gpu_session.sh tests sweep host
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
ln -sfn ../backends flashcore/backends
export PYTHONPATH=/tmp/site:$PWD:$PWD/tools
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/env.log"
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
  tests)
    (SWEEP_DIMS=${SWEEP_DIMS:-128} python3 tools/simt_sweep.py --compile-only \
        > "$OUT/sweep_compile.log" 2>&1 &)
    python3 tools/gpu_precompile.py 14 2>&1 | tail -1
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -6 ;;
  sweep)
    SWEEP_DIMS=${SWEEP_DIMS:-128} timeout ${SWEEP_TIMEOUT:-240} python3 tools/simt_sweep.py \
        ${SWEEP_ARGS:---fwd-only} 2>&1 | tee "$OUT/sweep.log" | tail -16 ;;
  host)
    python3 tools/host_breakdown.py 2>&1 | tee "$OUT/host.log" | tail -20 ;;
  bench)
    bash tools/gpu_final.sh bench 2>&1 | tail -40 ;;
  ncu)
    KERNELS=${KERNELS:-attn_forward} bash tools/ncu_simt.sh ${NCU_D:-128} 2>&1 | tail -16 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage took $(( $(date +%s) - t0 )) s"
done
rm -f flashcore/backends
echo "== summary"; grep -hE "[0-9]+ passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -2
