"""``python -m flashcore warmup``: compile numba_cuda's kernel variants ahead of time.

A kernel variant (head dim, dtype, causal, tiling) costs 3-17 s to compile the first time
it is called (H100 host, notes/ci_and_disk_cache_2026-11-26.md), once per machine: numba
keeps the result in its disk cache (keyed by ``driver.VariantCache``), so later processes
load it in milliseconds. Run this once after installing (or after upgrading flashcore,
numba or the driver) so that the first training step does not stall: jobs of one (head
dim, causal) each compile every variant a launch on the chosen GPU may pick, for the
dtypes asked, in parallel processes (Numba compiles one kernel at a time per process).

Each variant has its own cache index file, and the preprocess kernel, which does not
depend on causality, is compiled by non-causal jobs only, so no two jobs write one file.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

#: Head dims the kernels serve (anything else is padded to the next of these).
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 160, 192, 256)
DTYPES = ("float32", "float16", "bfloat16")
CAUSAL = {"both": (False, True), "true": (True,), "false": (False,)}


def _int_list(text):
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--head-dims must be integers separated by commas; "
                                         f"got {text!r}") from None
    bad = [d for d in dims if not 1 <= d <= HEAD_DIMS[-1]]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--head-dims must lie in 1..{HEAD_DIMS[-1]}; got {','.join(map(str, bad))}")
    return dims


def _dtype_list(text):
    dtypes = tuple(text.split(","))
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--dtypes must be among {','.join(DTYPES)} (numba_cuda's dtypes); got "
            f"{','.join(bad)}")
    return dtypes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashcore warmup",
        description="Compile numba_cuda's kernels ahead of time into numba's disk cache "
                    "(NUMBA_CACHE_DIR, else __pycache__ beside the kernels or the user cache "
                    "directory), so that first calls load them instead of compiling.")
    p.add_argument("--head-dims", type=_int_list, default=(64, 128), metavar="D,...",
                   help="head dims (64,128); 'all' is not a value: list them "
                        f"({','.join(map(str, HEAD_DIMS))})")
    p.add_argument("--dtypes", type=_dtype_list, default=("bfloat16", "float16", "float32"),
                   metavar="DT,...", help="dtypes (bfloat16,float16,float32)")
    p.add_argument("--causal", choices=tuple(CAUSAL), default="both",
                   help="causal variants, non-causal ones or both (both)")
    p.add_argument("--device", type=int, default=0, help="GPU index whose kernels (0)")
    p.add_argument("--processes", type=int, default=None,
                   help="parallel processes (default: one per job, at most the CPU count)")
    return p


def jobs(head_dims, dtypes, causal) -> list:
    """``(head_dim, causal, dtypes)`` per job, in a stable order."""
    return [(d, c, tuple(dtypes)) for d in head_dims for c in CAUSAL[causal]]


def variants(head_dim, dtype, causal, device=0) -> list:
    """The numba_cuda kernel variants a call of one (head dim, dtype, causal) may launch on
    GPU ``device``: the SIMT ones (the preprocess with the non-causal job only), and for
    fp16/bf16 the tensor-core ones and, on sm_90, the wgmma forward and backward."""
    from flashcore.backends.numba_cuda import launch, tilings
    from flashcore.backends.numba_cuda.driver import device_cc

    cc, gpu = device_cc(device), launch._gpu(device)[1]  # (the name; None in the simulator)
    kt = tilings.choose_simt(head_dim, dtype, causal, cc)
    out = [v for v in launch.simt_variants(head_dim, dtype, causal, kt)
           if not (causal and v.kernel == "preprocess")]
    if dtype != "float32" and head_dim in tilings.HEAD_DIMS:
        out += launch.tc_variants(head_dim, dtype, causal, cc, gpu=gpu)
        if cc == (9, 0) and os.environ.get(launch.HOPPER_ENV) != "0":
            # the wgmma forward and backward, where they run
            names = ("forward",) + (("dkdv", "dq") if os.environ.get(
                launch.HOPPER_BWD_ENV) != "0" else ())
            out += [x for x in (launch.hopper_variant(head_dim, dtype, causal, n)
                                for n in names) if x is not None]
            # and the forwards of calls that do not take the bulk tensor copies (small ones:
            # tilings.NO_TMA) and of long key sequences (tilings.LONG_KEYS)
            for extra in (launch.hopper_variant(head_dim, dtype, causal, tma_ok=False),
                          launch.hopper_variant(head_dim, dtype, causal, long_keys=True)):
                if extra is not None and extra not in out:
                    out.append(extra)
    return out


def job(args):
    """Compile (or load from the disk cache) every variant of one job on GPU ``device``;
    returns ``(head_dim, causal, variants, seconds)``."""
    head_dim, causal, dtypes, device = args
    t0 = time.perf_counter()
    from flashcore.backends.numba_cuda import launch

    n = 0
    for dtype in dtypes:
        todo = variants(head_dim, dtype, causal, device)
        for v in todo:
            launch.kernel(v, device)
        n += len(todo)
    return head_dim, causal, n, time.perf_counter() - t0


def _bar(done, total, width=24):
    filled = width * done // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def run_warmup(argv) -> int:
    args = parser().parse_args(argv)
    from . import _dispatch

    why = _dispatch.unavailable_reason("numba_cuda")
    if why is not None:
        print(f"flashcore warmup: numba_cuda cannot run here: {why}", file=sys.stderr)
        return 2
    todo = jobs(args.head_dims, args.dtypes, args.causal)
    procs = args.processes or min(len(todo), os.cpu_count() or 1)
    if procs < 1:
        print(f"flashcore warmup: --processes must be at least 1; got {args.processes}",
              file=sys.stderr)
        return 2
    print(f"flashcore warmup: {len(todo)} jobs (head dims {','.join(map(str, args.head_dims))}; "
          f"{','.join(args.dtypes)}; causal {args.causal}) on GPU {args.device} in {procs} "
          "processes", flush=True)
    t0 = time.perf_counter()
    work = [(*j, args.device) for j in todo]
    results = _run(work, procs)
    for done, (d, c, n, s) in enumerate(results, 1):
        print(f"{_bar(done, len(work))} D={d} {'causal' if c else 'full'}: {n} kernels in "
              f"{s:.1f} s", flush=True)
    print(f"flashcore warmup: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _compile_one(args):
    variant, device = args
    from flashcore.backends.numba_cuda import launch

    t0 = time.perf_counter()
    launch.kernel(variant, device)
    return variant.tag, time.perf_counter() - t0


def compile_variants(variants, device=0, processes=None) -> list:
    """Compile (or load from numba's disk cache) the numba_cuda ``variants`` for GPU
    ``device`` in parallel processes, so that this process then loads them from the disk
    cache: ``[(tag, seconds)]``. For tools and GPU tests that need a few chosen kernels."""
    work = [(v, device) for v in variants]
    procs = processes or max(1, min(len(work), (os.cpu_count() or 2) - 1))
    return list(_run(work, procs, _compile_one))


def _run(work, procs, fn=job):
    """Job results as they finish: in this process for one process, else in a pool."""
    if procs == 1:
        yield from map(fn, work)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a forked child would inherit a CUDA context the parent may already hold
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for f in as_completed([ex.submit(fn, w) for w in work]):
            yield f.result()
