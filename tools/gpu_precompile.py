"""Compile the numba_cuda kernel variants in parallel processes, filling numba's disk cache
(``cache=True``), so that test and benchmark processes load instead of compiling.

One job per (head dim, causal) compiles every kernel variant that a launch on GPU 0 may
pick, for all three dtypes: the SIMT ones (launch.simt_variants, fp32 tiles streamed) and,
for fp16/bf16 at the head dims they serve, the tensor-core ones with the tilings that
launches choose on this GPU (launch.tc_variants: the autotuner's cache, else the tables).
Each variant has its own cache index file (variant.Variant.tag), and the preprocess
kernel, which does not depend on causality, is compiled by the non-causal job only, so
jobs never write one file concurrently. Prints the wall time per job and in all.

Usage: python tools/gpu_precompile.py [PROCESSES]
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 160, 192, 256)
DTYPES = ("float32", "float16", "bfloat16")


def job(args):
    head_dim, causal = args
    t0 = time.perf_counter()
    from flashcore.backends.numba_cuda import launch, tilings
    from flashcore.backends.numba_cuda.driver import device_cc

    cc, gpu = device_cc(0), launch._gpu(0)[1]  # (the GPU's name; None in the simulator)
    for dtype in DTYPES:
        kt = tilings.choose_simt(head_dim, dtype, causal, cc)
        variants = [v for v in launch.simt_variants(head_dim, dtype, causal, kt)
                    if not (causal and v.kernel == "preprocess")]
        if dtype != "float32" and head_dim in tilings.HEAD_DIMS:
            variants += launch.tc_variants(head_dim, dtype, causal, cc, gpu=gpu)
        for v in variants:
            launch.kernel(v, 0)
    return head_dim, causal, time.perf_counter() - t0


def main():
    procs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    t0 = time.perf_counter()
    jobs = [(d, c) for d in HEAD_DIMS for c in (False, True)]
    with ProcessPoolExecutor(procs) as ex:
        for d, c, s in ex.map(job, jobs):
            print(f"compiled D={d} causal={c}: {s:.1f} s", flush=True)
    print(f"precompile: {len(jobs)} jobs in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
