#!/usr/bin/env bash
# One device run that checks the whole project on a real GPU: precompile the CUDA kernels,
# every test marked gpu (numba_cuda, tensor cores, torch CUDA, JAX GPU), the main job, and
# the side-by-side benchmark with the peers. Logs and JSON under $OUT; summary last.
# Usage (on the device, after the NumPy 2.4 wheel install and flashcore/backends symlink
# described in notes/numba_cuda.md): bash tools/gpu_final.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log="$OUT/gpu_final.log"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  python3 -c "import numpy, numba, numba_cuda, torch, jax; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__, 'jax', jax.__version__)"
  echo "== precompile"; python3 tools/gpu_precompile.py 12 2>&1 | tail -2
  echo "== pytest -m gpu"
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tail -25
  echo "== main job"; python3 -m flashcore 2>&1 | tail -12
  echo "== main job bf16"; python3 -m flashcore --dtype bfloat16 --batch 4 --heads 16 2>&1 | tail -8
} 2>&1 | tee "$log"
python3 -m flashcore bench --device cuda --batch 4 --heads 16 --seqlens 4096 \
    --head-dims 64,128 --dtypes float32,bfloat16 --causal both --repeat 5 --budget 0.5 \
    --no-progress --contenders "${BENCH_CONTENDERS:-flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu,torch_sdpa_efficient@gpu,jax_cudnn@gpu}" \
    --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -60
echo "== tensor cores (FLASHCORE_TENSOR_CORES=1), bf16 forward"
FLASHCORE_TENSOR_CORES=1 python3 -m flashcore bench --device cuda --batch 4 --heads 16 \
    --seqlens 4096 --head-dims 64,128 --dtypes bfloat16 --causal both --directions fwd \
    --repeat 5 --budget 0.5 --no-progress --no-memory --no-ceilings \
    --contenders flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu \
    --json "$OUT/bench_tc.json" 2>&1 | tee "$OUT/bench_tc.log" | tail -30
echo "== summary"; grep -E "passed|failed|error" "$log" | tail -3
