"""Compile the numba_cuda kernel variants in parallel processes, filling numba's disk cache
(``cache=True``), so that test and benchmark processes load instead of compiling.

One job per (head dim, causal) compiles every kernel for all three dtypes (SIMT, and the
tensor-core kernels where fp16/bf16 has them); each variant has
its own cache index file (see forward_kernels.variant_tag), so jobs never write one file
concurrently. Prints the wall time per job and in all.

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
    from flashcore.backends.numba_cuda import launch, launch_tc, tile_product_tc

    for dtype in DTYPES:
        if dtype != "float32" and head_dim in tile_product_tc.HEAD_DIMS:
            for name in ("forward", "dkdv", "dq"):
                launch_tc.kernel(name, head_dim, dtype, causal, 0)
        kt = launch.kernel_tiles(head_dim, dtype, causal, 0)
        launch.forward_kernel(head_dim, dtype, causal, 0, kt.forward)
        launch.dkdv_kernel(head_dim, dtype, causal, 0, kt.dkdv)
        launch.dq_kernel(head_dim, dtype, causal, 0, kt.dq)
        if not causal:  # the preprocess kernel does not depend on causality
            launch.preprocess_kernel(head_dim, dtype, 0, kt.preprocess_threads)
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
