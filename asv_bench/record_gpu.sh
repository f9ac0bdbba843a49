#!/usr/bin/env bash
# Record the GPU benchmarks' history grid (bench_attention._GPU.params: flashcore's
# numba_cuda next to SDPA flash, B=4 H=16 N=4096, D 64/128, bf16/fp32, forward and
# forward+backward) for COMMITs on this machine, under asv machine name MACHINE.
#   usage: asv_bench/record_gpu.sh MACHINE COMMIT...
#   e.g.   asv_bench/record_gpu.sh h200 8e32205 da4f3b9 440c577 HEAD
set -euo pipefail
cd "$(dirname "$0")"
machine=$1
shift
python=$(command -v "${PYTHON:-python}")
"$python" -m asv machine --machine "$machine" --yes > /dev/null
bash record.sh -m "$machine" "$@" -- -b "GPU.time_attention"
