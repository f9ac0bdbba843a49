#!/usr/bin/env bash
# Nsight Compute profile of the SIMT float32 kernels (needs a machine where ncu reads the
# counters: the Firecracker kinds). Text pages under $OUT (reports in /tmp); KERNELS picks
# the kernels (default: all three).
# Usage (on the device, after the setup in notes/numba_cuda.md): bash tools/ncu_simt.sh [D]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=${1:-64}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
python3 tools/ncu_simt.py "$D" >/dev/null 2>&1   # fill the disk cache outside the profiler
for kern in ${KERNELS:-attn_forward attn_backward_dkdv attn_backward_dq}; do
  $NCU --clock-control none --set full --import-source no -k "regex:$kern" \
      --launch-skip 2 --launch-count 1 -f -o "/tmp/ncu_${kern}_d$D" \
      python3 tools/ncu_simt.py "$D" > "/tmp/ncu_${kern}_d$D.log" 2>&1
  $NCU --import "/tmp/ncu_${kern}_d$D.ncu-rep" --page details > "$OUT/${kern}_d$D.details.txt" 2>&1
  $NCU --import "/tmp/ncu_${kern}_d$D.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/${kern}_d$D.sass.csv" 2>&1
  echo "== $kern D=$D"
  python3 tools/ncu_regions.py "$OUT/${kern}_d$D.sass.csv" 2>&1 | head -6
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Shared Memory Configuration Size|Block Limit" \
      "$OUT/${kern}_d$D.details.txt" | head -14
done
