"""Cold and warm first-call cost of each numba_cuda kernel variant (issue 19 §4).

Cold: numba's disk cache emptied (a fresh ``NUMBA_CACHE_DIR``), each variant compiled
(Numba -> NVVM -> PTX -> ptxas, then loaded) in one of ``--processes`` spawned processes.
Warm: the same variants again in new processes, now read from the disk cache and loaded.
Each time is ``launch.kernel(variant)`` alone (imports excluded; a process's first variant
also pays for its CUDA context, so the table gives the median too). Prints one row per
variant and the totals per kind of kernel.

Usage: python tools/compile_times.py [--head-dims 64,128] [--dtypes bfloat16,float32]
           [--processes 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--processes", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashcore_compile_times_")
    from flashcore import _warmup

    todo = {v.tag: v for d in map(int, a.head_dims.split(",")) for dt in a.dtypes.split(",")
            for c in (False, True) for v in _warmup.variants(d, dt, c)}
    rows = {}
    for phase in ("cold", "warm"):
        t0 = time.perf_counter()
        for tag, s in _warmup.compile_variants(list(todo.values()), processes=a.processes):
            rows.setdefault(tag, {})[phase] = s
        print(f"{phase}: {len(todo)} variants in {time.perf_counter() - t0:.1f} s wall "
              f"({a.processes} processes)", flush=True)
    print(f"\n{'variant':<72} {'cold s':>7} {'warm s':>7}")
    for tag in sorted(rows):
        print(f"{tag[:72]:<72} {rows[tag]['cold']:>7.2f} {rows[tag]['warm']:>7.2f}")
    print(f"\n{'kind':<20} {'n':>3} {'cold median':>12} {'cold max':>9} {'warm median':>12}")
    for kind in sorted({v.family + "/" + v.kernel for v in todo.values()}):
        tags = [t for t, v in todo.items() if v.family + "/" + v.kernel == kind]
        cold = [rows[t]["cold"] for t in tags]
        warm = [rows[t]["warm"] for t in tags]
        print(f"{kind:<20} {len(tags):>3} {statistics.median(cold):>12.2f} {max(cold):>9.2f} "
              f"{statistics.median(warm):>12.2f}")


if __name__ == "__main__":
    main()
