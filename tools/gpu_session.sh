#!/usr/bin/env bash
# One GPU session in one device call: set up, then run the stages named, in that order.
#
#   setup   the wheels carried in .whl/ (NumPy 2.4: numba-cuda 0.30.4 cannot compile with
#           the image's NumPy 2.5) installed into /tmp/site; flashcore imported from this
#           tree (flashcore/backends linked to ../backends for the run, standing in for the
#           editable install's package-dir mapping); environment facts in session.log
#   tests   parallel precompile (tools/gpu_precompile.py: fills numba's disk cache), then
#           pytest -m gpu ($PYTEST_ARGS, default --durations=25: where the suite's time goes)
#           and the main job (python -m flashcore). The whole suite no longer
#           fits one 600 s device call on an H200 (about 575 s of pytest at 15 workers,
#           2026-11-26): run it as two, PYTEST_K=hopper TEST_TIMEOUT=500 (about 325 s)
#           and PYTEST_K="not hopper" TEST_TIMEOUT=500 (about 250 s)
#   bench   the side-by-side table: python -m flashcore bench $BENCH_ARGS, then the long
#           sequence table ($BENCH_LONG_ARGS; set it empty to skip)
#   tune    the tensor-core autotuner ($TUNE_DIMS); the tuned tilings stay in
#           $FLASHCORE_CACHE_DIR for the stages after it ("tune tests bench")
#   sweep   tools/simt_sweep.py: SIMT tilings checked and timed ($SWEEP_DIMS, $SWEEP_ARGS)
#   host    tools/host_breakdown.py: host time of a tiny call, step by step
#   ncu     Nsight Compute on the kernels ($KERNELS: regexes, $NCU_D, $NCU_CAUSAL=1,
#           $NCU_DTYPE: float32 the SIMT kernels, bfloat16 the tensor-core ones, $NCU_PEER:
#           cudnn or flash to run SDPA's kernels too, e.g. KERNELS="wgmma cudnn"), per
#           kernel the stall samples per loop (tools/ncu_regions.py) and the key metrics;
#           $NCU_FORWARDS: forward tilings (tags) profiled in turn, forward only;
#           needs a kind where ncu reads the counters (nvidia-h100-x1, not nvidia-h200)
#   sass    tools/sass.py --all: registers, spills, instruction counts per kernel
#   packed  tools/packed_gpu.py: decode bandwidth (contiguous and paged caches, split-KV
#           or not, SDPA beside) and varlen against padded calls (issue 15)
#   wgmma   tools/wgmma_ceiling.py: the wgmma layouts checked against NumPy, then the wgmma
#           and mma.sync ceilings from Numba (TFLOP/s); $WGMMA_ARGS (e.g. --check)
#   hopper  tools/hopper_forward.py: the sm_90a wgmma forward (the default on cc 9.0; FLASHCORE_HOPPER=0 turns it off)
#           checked against the mma.sync forward, then timed beside it and SDPA's flash and
#           cuDNN backends (bf16, N=4096 and 16384); $HOPPER_ARGS (e.g. --quick)
#   hopper_bwd  tools/hopper_backward.py: the sm_90a wgmma backward (FLASHCORE_HOPPER_BWD=0
#           turns it off) checked against the mma.sync backward, then forward+backward
#           timed beside SDPA's flash and cuDNN backends; $HOPPER_BWD_ARGS (e.g. --quick)
#   mods    tools/mods_backward.py: the user's score_mod / mask_mod and the built-in softcap,
#           forward+backward on the wgmma backward and on the mma.sync one, checked against
#           each other (issue 14); $MODS_ARGS (e.g. --head-dim 64 --repeat 5)
#   maskfwd tools/mask_mod_forward.py: a forward with a mask_mod without the overlap and
#           overlapped, checked against each other and timed; $MASKFWD_ARGS
#   cpu     the host CPU: tools/cpu_scaling.py $CPU_ARGS (numba_cpu and SDPA by thread count),
#           then python -m flashcore bench --device cpu $CPU_BENCH_ARGS (empty: skip)
#   compile tools/compile_times.py $COMPILE_ARGS: each kernel variant's cold compile and warm
#           (disk cache) load, in parallel processes
#   ring    tools/ring_gpu.py under torchrun on every GPU of the machine (NCCL, NVLink
#           multicast off): ring attention against one GPU, then the scaling table
#           ($RING_ARGS); on nvidia-h200-x2
#
# What comes back under $OUT (at most 8 files): session.log (facts, summary), one
# STAGE.log per stage, and files.tar.gz with the data (bench.json, simt_sweep.json,
# tc_tiles.json, sass.json, ncu pages); when that would be more than 8 files, the stage
# logs go into the archive too. The summary table is printed last.
#
# Usage (device run from the repository root, carry [".whl"]):
#   bash tools/gpu_session.sh tests bench
#   BENCH_ARGS="--device cuda ..." SWEEP_DIMS=64 bash tools/gpu_session.sh sweep host
# Each stage has a timeout (TEST_TIMEOUT, BENCH_TIMEOUT, ...; below): one device call may
# run 10 minutes in all, setup and precompile included. See tools/README.md.
set -u
STAGES="tests bench tune sweep host ncu sass ring packed wgmma hopper hopper_bwd mods maskfwd cpu compile"
if [ $# -eq 0 ]; then
  echo "usage: bash tools/gpu_session.sh STAGE... (stages: $STAGES)"; exit 2
fi
for s in "$@"; do
  case " $STAGES " in *" $s "*) ;; *) echo "unknown stage $s (stages: $STAGES)"; exit 2 ;; esac
done

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/gpu_session; rm -rf "$WORK"; mkdir -p "$WORK/files"
FILES=$WORK/files        # data files, packed into $OUT/files.tar.gz at the end
LOG=$OUT/session.log
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLASHCORE_CACHE_DIR=${FLASHCORE_CACHE_DIR:-/tmp/flashcore_cache}
JOBS=${JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}

BENCH_ARGS=${BENCH_ARGS:---device cuda --batch 4 --heads 16 --seqlens 4096 --head-dims 64,128 \
--dtypes float32,bfloat16 --causal both --repeat 5 --budget 0.5 --no-progress \
--contenders flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu,\
torch_sdpa_efficient@gpu,jax_cudnn@gpu}
BENCH_LONG_ARGS=${BENCH_LONG_ARGS---device cuda --batch 1 --heads 16 --seqlens 16384 \
--head-dims 128 --dtypes bfloat16 --causal both --repeat 5 --budget 0.5 --no-progress \
--no-memory --no-ceilings \
--contenders flashcore:numba_cuda@gpu,torch_sdpa_flash@gpu,torch_sdpa_cudnn@gpu}
AUTOTUNE=${AUTOTUNE:-flashcore.backends.numba_cuda.autotune}

# ---- setup
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD:$PWD/tools
else
  echo "(no .whl/ carried: the image's packages as they are)"
  export PYTHONPATH=$PWD:$PWD/tools
fi
LINK=
if [ -d backends ] && [ ! -e flashcore/backends ]; then
  ln -s ../backends flashcore/backends && LINK=flashcore/backends
fi

finish() {
  [ -n "$LINK" ] && rm -f "$LINK"
  if [ -n "$(ls -A "$FILES")" ]; then
    # at most 8 files come back: session.log, the archive, and the stage logs if they fit
    if [ $(( $(ls "$OUT" | wc -l) + 1 )) -gt 8 ]; then
      for f in "$OUT"/*.log; do [ "$f" = "$LOG" ] || mv "$f" "$FILES/"; done
    fi
    tar -czf "$OUT/files.tar.gz" -C "$FILES" .
  fi
}
trap finish EXIT

{
  echo "== $(date -u +%FT%TZ) stages: $*"
  # The device's copy of the tree may carry a stale .git: pass COMMIT=... from here.
  echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)")}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core)"
  echo "CPU flags: $(lscpu | sed -n 's/^Flags: *//p' | tr ' ' '\n' |
      grep -xE 'avx2|fma|avx512f|avx512bw|avx512_bf16|avx512_fp16|amx_tile|amx_bf16' | xargs)"
  echo "kernel: $(uname -r)"
  python3 - <<'EOF'
import importlib
for name in ("numpy", "numba", "numba_cuda", "torch", "jax", "cuda.bindings"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"), end="  ")
    except Exception as e:  # noqa: BLE001
        print(name, "missing", end="  ")
print()
import flashcore, flashcore.backends
print("flashcore from", flashcore.__file__, "backends from", list(flashcore.backends.__path__))
EOF
} 2>&1 | tee "$LOG"

# ---- stages (each writes $OUT/STAGE.log; data files go to $FILES)
precompile() {  # once per call, whichever stage needs it first
  [ -e "$WORK/precompiled" ] || [ "${PRECOMPILE:-1}" = 0 ] && return
  python3 tools/gpu_precompile.py "$JOBS" 2>&1 | tail -1
  touch "$WORK/precompiled"
}

stage_tests() {
  case " $* " in *" sweep "*)  # compile the sweep's candidates beside the precompile
    (SWEEP_DIMS=${SWEEP_DIMS:-128} python3 tools/simt_sweep.py --compile-only \
        > "$FILES/sweep_compile.log" 2>&1 &) ;;
  esac
  precompile
  # several pytest workers when pytest-xdist is carried in .whl/ (kernels compile on the
  # CPU: the user-mod variants are not disk-cached), failures reported as they happen
  local par=
  python3 -c "import xdist" 2>/dev/null && par="-n ${TEST_JOBS:-6}"
  FLASHCORE_INSTAFAIL=1 timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -m gpu -q \
      -p no:cacheprovider $par ${PYTEST_K:+-k "$PYTEST_K"} tests/ ${PYTEST_ARGS---durations=25}
  local rc=$?
  echo "== main job"
  python3 -m flashcore > "$WORK/main.log" 2>&1 || { [ $rc -ne 0 ] || rc=1; }
  tail -12 "$WORK/main.log"
  return $rc
}

stage_bench() {
  precompile
  timeout "${BENCH_TIMEOUT:-300}" python3 -m flashcore bench $BENCH_ARGS \
      --json "$FILES/bench.json" || return
  if [ -n "$BENCH_LONG_ARGS" ]; then
    echo "== long sequences"
    timeout "${BENCH_TIMEOUT:-300}" python3 -m flashcore bench $BENCH_LONG_ARGS \
        --json "$FILES/bench_long.json"
  fi
}

stage_tune() {
  timeout "${TUNE_TIMEOUT:-300}" python3 -m "$AUTOTUNE" --head-dims "${TUNE_DIMS:-64,128}" \
      --jobs "$JOBS" ${TUNE_ARGS:-}
  local rc=$?
  cp "$FLASHCORE_CACHE_DIR"/*.json "$FILES/" 2>/dev/null
  return $rc
}

stage_sweep() {
  OUT=$FILES SWEEP_DIMS=${SWEEP_DIMS:-128} timeout "${SWEEP_TIMEOUT:-240}" \
      python3 tools/simt_sweep.py ${SWEEP_ARGS:---fwd-only}
}

stage_host() {
  timeout "${HOST_TIMEOUT:-180}" python3 tools/host_breakdown.py ${HOST_ARGS:-}
}

stage_ncu() {
  local ncu d=${NCU_D:-128} causal=${NCU_CAUSAL:+causal} rep kern
  local args="$d ${causal:-full} ${NCU_DTYPE:-float32} ${NCU_PEER:-}"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "ncu not found"; return 1; }
  local fwd
  for fwd in ${NCU_FORWARDS:-""}; do  # (each forward tiling in turn: NCU_FORWARD)
  export NCU_FORWARD=$fwd
  python3 tools/ncu_attention.py $args >/dev/null 2>&1  # compile outside the profiler
  for kern in ${KERNELS:-attn_forward}; do
    rep=$WORK/ncu_${kern//[^A-Za-z0-9_]/_}_d$d${fwd:+_$fwd}
    timeout "${NCU_TIMEOUT:-300}" "$ncu" --clock-control none --set full --import-source no \
        -k "regex:$kern" --launch-skip 2 --launch-count 1 -f -o "$rep" \
        python3 tools/ncu_attention.py $args > "$rep.log" 2>&1 || { tail -5 "$rep.log"; return 1; }
    local base=${rep##*/}
    "$ncu" --import "$rep.ncu-rep" --page details > "$FILES/$base.details.txt" 2>&1
    "$ncu" --import "$rep.ncu-rep" --page source --csv --print-source sass \
        > "$FILES/$base.sass.csv" 2>&1
    "$ncu" --import "$rep.ncu-rep" --page raw > "$FILES/$base.raw.txt" 2>&1
    echo "== $kern D=$d $causal ${NCU_DTYPE:-float32} ${fwd:+forward $fwd}"
    python3 tools/ncu_regions.py "$FILES/$base.sass.csv" 2>&1 | head -6
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Shared Memory Configuration Size|Block Limit|SM Busy|Compute \(SM\) Throughput|DRAM Throughput|L2 Hit Rate|Mem Busy" \
        "$FILES/$base.details.txt" | head -20
    grep -E "pipe_(tensor|fma|alu|fp16|xu)[a-z_]*cycles_active.avg.pct_of_peak_sustained_active|pipe_(tensor|fma|alu|xu)[a-z_]*.avg.pct_of_peak_sustained_active" \
        "$FILES/$base.raw.txt" | head -12
  done
  done
}

stage_sass() {
  timeout "${SASS_TIMEOUT:-300}" python3 tools/sass.py --all --head-dims "${SASS_DIMS:-64,128}" \
      --jobs "$JOBS" --json "$FILES/sass.json" ${SASS_ARGS:-}
}

stage_packed() {
  PACKED_JSON=$FILES/packed.json timeout "${PACKED_TIMEOUT:-300}" python3 tools/packed_gpu.py
}

stage_wgmma() {
  timeout "${WGMMA_TIMEOUT:-240}" python3 tools/wgmma_ceiling.py ${WGMMA_ARGS:-}
}

stage_hopper() {
  HOPPER_JSON=$FILES/hopper.json timeout "${HOPPER_TIMEOUT:-230}" \
      python3 tools/hopper_forward.py ${HOPPER_ARGS:-}
}

stage_hopper_bwd() {
  HOPPER_BWD_JSON=$FILES/hopper_bwd.json timeout "${HOPPER_BWD_TIMEOUT:-400}" \
      python3 tools/hopper_backward.py ${HOPPER_BWD_ARGS:-}
}

stage_mods() {
  timeout "${MODS_TIMEOUT:-300}" python3 tools/mods_backward.py ${MODS_ARGS:-}
}

stage_maskfwd() {
  timeout "${MASKFWD_TIMEOUT:-300}" python3 tools/mask_mod_forward.py ${MASKFWD_ARGS:-}
}

stage_cpu() {
  timeout "${CPU_TIMEOUT:-300}" python3 tools/cpu_scaling.py ${CPU_ARGS:-} || return
  if [ -n "${CPU_BENCH_ARGS:-}" ]; then
    echo "== bench (CPU)"
    timeout "${CPU_TIMEOUT:-300}" python3 -m flashcore bench --device cpu $CPU_BENCH_ARGS \
        --json "$FILES/bench_cpu.json"
  fi
}

stage_compile() {
  timeout "${COMPILE_TIMEOUT:-400}" python3 tools/compile_times.py ${COMPILE_ARGS:-} || return
  local cache; cache=$(mktemp -d)
  for run in cold warm; do  # the main job in a fresh process, with an empty cache, then again
    local t0=$EPOCHREALTIME
    NUMBA_CACHE_DIR=$cache python3 -m flashcore > /dev/null 2>&1 || return
    echo "main job ($run cache): $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}') s"
  done
}

stage_ring() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  precompile
  RING_JSON=$FILES/ring.json timeout "${RING_TIMEOUT:-420}" python3 -m torch.distributed.run \
      --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" tools/ring_gpu.py ${RING_ARGS:-}
}

result() {  # one line for the summary table
  local log=$OUT/$1.log
  case $1 in
  tests) grep -hE "[0-9]+ (passed|failed)|error" "$log" | grep -v "^E " | tail -1 ;;
  sweep) echo "$(grep -c '^{' "$log") candidates timed (simt_sweep.json)" ;;
  host)  grep -E "^flashcore.attention" "$log" | tail -1 ;;
  ncu)   grep -hE "^ *Duration" "$log" | xargs ;;
  sass)  echo "$(grep -c ' registers' "$log") kernels, $(grep -c Error "$log") errors (sass.json)" ;;
  ring)  grep -hE "^N=" "$log" | tail -1 ;;
  cpu)   grep -hE "^threading layer used" "$log" | tail -1 ;;
  compile) grep -hE "^(cold|warm):|^main job" "$log" | cut -c1-40 | xargs ;;
  hopper) echo "$(grep -cE '^check .*: pass' "$log") checks passed," \
               "$(grep -cE '^check .*: FAIL' "$log") failed (hopper.json)" ;;
  mods|maskfwd)  echo "$(grep -cE '^check .*: pass' "$log") checks passed," \
              "$(grep -cE '^check .*: FAIL' "$log") failed" ;;
  hopper_bwd) echo "$(grep -cE '^check .*: pass' "$log") checks passed," \
                   "$(grep -cE '^check .*: (FAIL|ERROR)' "$log") failed (hopper_bwd.json)" ;;
  wgmma) echo "$(grep -cE '^check .*: pass' "$log") checks passed," \
              "$(grep -cE '^check .*: (FAIL|ERROR)' "$log") failed; best:" \
              "$(grep -E '^ceiling wgmma' "$log" |
                 awk -F': ' '{v = $NF + 0; if (v > b) {b = v; l = $0}} END {print substr(l, 9)}')" ;;
  esac > "$WORK/result"
  [ -s "$WORK/result" ] || grep -v '^\s*$' "$log" | tail -1 > "$WORK/result"
  cut -c1-90 "$WORK/result"
}

printf "%-6s %5s %4s  %s\n" stage s rc result > "$WORK/summary"
for s in "$@"; do
  echo "== $s"
  t0=$(date +%s)
  set -o pipefail
  "stage_$s" "$@" 2>&1 | tee "$OUT/$s.log" | tail -n "${TAIL:-25}"
  rc=$?
  set +o pipefail
  printf "%-6s %5d %4d  %s\n" "$s" $(( $(date +%s) - t0 )) "$rc" "$(result "$s")" \
      >> "$WORK/summary"
done
echo "== summary" | tee -a "$LOG"
tee -a "$LOG" < "$WORK/summary"
