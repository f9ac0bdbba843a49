"""Compile the numba_cuda kernel variants of every head dim in parallel processes, filling
numba's disk cache, so that test and benchmark processes load instead of compiling: the
public ``python -m flashcore warmup`` (flashcore/_warmup.py) over all head dims, dtypes
and both causal settings.

Usage: python tools/gpu_precompile.py [PROCESSES]
"""
from __future__ import annotations

import sys

from flashcore._warmup import DTYPES, HEAD_DIMS, run_warmup


def main():
    argv = ["--head-dims", ",".join(map(str, HEAD_DIMS)), "--dtypes", ",".join(DTYPES),
            "--causal", "both", "--processes", sys.argv[1] if len(sys.argv) > 1 else "8"]
    return run_warmup(argv)


if __name__ == "__main__":
    sys.exit(main())
