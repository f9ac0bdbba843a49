#!/usr/bin/env bash
# Device run for the head-dim-256 tensor-core kernels (session 3), in two stages:
#   tune:  precompile, autotune at head dim 256 (cache in $FLASHCORE_CACHE_DIR), pytest -m gpu
#   bench: bf16 forward and forward+backward at D=256 (B=4 H=16 N=4096) and D=64/128 again,
#          next to SDPA flash and cuDNN
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLASHCORE_CACHE_DIR=${FLASHCORE_CACHE_DIR:-/tmp/flashcore_cache}
for stage in ${*:-tune bench}; do
case $stage in
tune)
  echo "== precompile"; python3 tools/gpu_precompile.py 14 2>&1 | tail -2
  echo "== autotune D=256"
  timeout 240 python3 -m flashcore.backends.numba_cuda.autotune --head-dims 256 --jobs 14 2>&1 | tail -8
  echo "== pytest -m gpu"
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tail -6
  ;;
bench)
  python3 -m flashcore bench --device cuda --batch 4 --heads 16 --seqlens 4096 \
      --head-dims 64,128,256 --dtypes bfloat16 --causal both --repeat 5 --budget 0.5 \
      --no-progress --no-memory --no-ceilings \
      --contenders flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu \
      --json "$OUT/bench_d256.json" 2>&1 | tee "$OUT/bench_d256.log" | tail -50
  ;;
*) echo "unknown stage $stage (tune, bench)"; exit 2;;
esac
done
cp "$FLASHCORE_CACHE_DIR/tc_tiles.json" "$OUT/" 2>/dev/null
