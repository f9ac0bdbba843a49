#!/usr/bin/env bash
# Device runs that check the whole project on a real GPU, in stages (each fits one device
# call of at most 10 minutes; logs, JSON and the tuned tilings under $OUT, summary last):
#   tune:  precompile the CUDA kernels, tune the tensor-core tilings (autotune.py, cache in
#          $FLASHCORE_CACHE_DIR, default /tmp/flashcore_cache, copied to $OUT)
#   test:  every test marked gpu, the main job (with the tuned tilings where tune ran)
#   check: tune, then test (may not fit one 10-minute device call: run them separately)
#   bench: the side-by-side benchmark with the peers (B=4 H=16 N=4096; bf16 B=1 N=16384)
#          and the host time of a tiny forward
# Usage (on the device, after the NumPy 2.4 wheel install and flashcore/backends symlink
# described in notes/numba_cuda.md): bash tools/gpu_final.sh [tune] [test] [check] [bench]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLASHCORE_CACHE_DIR=${FLASHCORE_CACHE_DIR:-/tmp/flashcore_cache}
stages=${*:-check bench}
log="$OUT/gpu_final.log"
for stage in $stages; do
case $stage in
tune|check)
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  python3 -c "import numpy, numba, numba_cuda, torch, jax; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__, 'jax', jax.__version__)"
  echo "== precompile"; python3 tools/gpu_precompile.py 14 2>&1 | tail -2
  echo "== autotune (tensor-core tilings)"
  timeout 300 python3 -m flashcore.backends.numba_cuda.autotune --head-dims 64,128 --jobs 14 2>&1 | tail -16
} 2>&1 | tee -a "$log"
;;&
test|check)
{
  echo "== pytest -m gpu"
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/ 2>&1 | tail -25
  echo "== main job"; python3 -m flashcore 2>&1 | tail -12
  echo "== main job bf16"; python3 -m flashcore --dtype bfloat16 --batch 4 --heads 16 2>&1 | tail -8
} 2>&1 | tee -a "$log"
;;
bench)
python3 tools/gpu_precompile.py 14 2>&1 | tail -1
python3 -m flashcore bench --device cuda --batch 4 --heads 16 --seqlens 4096 \
    --head-dims 64,128 --dtypes float32,bfloat16 --causal both --repeat 5 --budget 0.5 \
    --no-progress --contenders "${BENCH_CONTENDERS:-flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu,torch_sdpa_efficient@gpu,jax_cudnn@gpu}" \
    --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -60
echo "== host time of a tiny forward (tools/host_breakdown.py)"
python3 tools/host_breakdown.py 2>&1 | tee "$OUT/host_breakdown.log" | tail -12
echo "== bf16, B=1 H=16 N=16384 D=128 (tensor cores)"
python3 -m flashcore bench --device cuda --batch 1 --heads 16 --seqlens 16384 \
    --head-dims 128 --dtypes bfloat16 --causal both --repeat 5 --budget 0.5 --no-progress \
    --no-memory --no-ceilings \
    --contenders flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu \
    --json "$OUT/bench_long.json" 2>&1 | tee "$OUT/bench_long.log" | tail -30
;;
tune) ;;
*) echo "unknown stage $stage (tune, test, check, bench)"; exit 2;;
esac
done
cp "$FLASHCORE_CACHE_DIR/tc_tiles.json" "$OUT/" 2>/dev/null
echo "== summary"; grep -E "passed|failed|error" "$log" 2>/dev/null | tail -3
