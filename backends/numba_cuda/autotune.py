"""A small autotuner for the tensor-core kernels' tilings: each candidate of
:data:`CANDIDATES` is compiled, timed on the GPU at a representative size, and the fastest
is kept in a JSON cache that ``tilings.choose_tc`` reads (per GPU name, compute
capability, kernel, head dim, causality and dtype). Without a cached result the built-in
tables of tilings.py serve; they hold what this tuner chose on an H100/H200
(notes/tensor_cores.md). Nothing in the package imports this module.

Usage (on a machine with a GPU; a few seconds per candidate, mostly compiling)::

    python -m flashcore.backends.numba_cuda.autotune [--head-dims 64,128] [--dtypes bfloat16]
        [--kernels forward,dkdv,dq] [--seqlen 4096] [--batch 4] [--heads 16] [--jobs N]
        [--json PATH]

The cache lives in ``$FLASHCORE_CACHE_DIR`` (default ``~/.cache/flashcore``), file
``tc_tiles.json``. Tuning is never started implicitly: compiling every candidate costs more
than any single call would gain.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from flashcore._case import Case

from . import tilings as _tiles
from .tilings import CANDIDATES, TCTiles, cache_key, cache_path


def _kernel(kernel, head_dim, dtype, causal, device, t):
    """(prepared kernel, block_m) of one tensor-core candidate."""
    from . import launch
    from .variant import Variant

    v = Variant(kernel, "tensor_core", head_dim, dtype, bool(causal), t)
    return launch.kernel(v, device), v.block_m


def time_candidate(kernel, t, head_dim, causal, dtype, device, batch, heads, seqlen,
                   reps=10):
    """Median milliseconds of one launch of ``kernel`` with tiling ``t`` on random inputs
    of (batch, heads, seqlen, head_dim), bhnd layout."""
    import numpy as np
    from numba import cuda

    from . import launch
    from .driver import synchronize

    rng = np.random.default_rng(0)
    shape = (batch, heads, seqlen, head_dim)
    bits = {"bfloat16": np.uint16, "float16": np.float16}[dtype]

    def dev(x):
        x = x.astype(np.float32)
        if dtype == "bfloat16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
        return cuda.to_device(x.astype(bits))

    with cuda.gpus[device]:
        q, k, v, do, o, dq, dk, dv = (dev(rng.standard_normal(shape)) for _ in range(8))
        lse = cuda.to_device(np.full((batch, heads, seqlen), 2.0 * np.log(seqlen), np.float32))
        delta = cuda.to_device(np.zeros((batch, heads, seqlen), np.float32))
        ptr = lambda a: a.__cuda_array_interface__["data"][0]  # noqa: E731
        st = (seqlen * head_dim * heads, seqlen * head_dim, head_dim, 1)
        vq, vk, vv, vdo, vo, vdq, vdk, vdv = ((ptr(x), st) for x in (q, k, v, do, o, dq, dk, dv))
        vl = (ptr(lse), (seqlen * heads, seqlen, 1))
        dl = ptr(delta)
        case = Case("numba", f"cuda:{device}", dtype, batch, heads, heads, seqlen, seqlen,
                    head_dim, bool(causal), head_dim ** -0.5, "bhnd")
        kern, bm = _kernel(kernel, head_dim, dtype, causal, device, t)
        ns, nm, nc = launch.no_slopes(dl), launch.no_mod_args(dl), launch.no_classes(dl)
        run = {  # the launches of launch.run_forward / run_backward, with this kernel
            "forward": lambda: launch.launch_forward(kern, bm, case, 0, vq, vk, vv, vo, vl[0],
                                                     ns, nm, nc),
            "dkdv": lambda: launch.launch_dkdv(kern, bm, case, 0, vq, vk, vv, vdo, vl, dl, vdk,
                                               vdv, ns, nm, nc),
            "dq": lambda: launch.launch_dq(kern, bm, case, 0, vq, vk, vv, vdo, vl, dl, vdq, ns,
                                           nm, nc),
        }[kernel]
        for _ in range(3):
            run()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = cuda.event(timing=True), cuda.event(timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(cuda.event_elapsed_time(a, b))
        synchronize(0, device)
    return statistics.median(times)


def _compile_one(job):
    kernel, d, dtype, causal, tiles = job
    _kernel(kernel, d, dtype, causal, 0, TCTiles(*tiles))
    return job


def precompile(kernels, head_dims, dtypes, causals=(False, True), jobs=8, log=print):
    """Compile every candidate in ``jobs`` processes (numba's disk cache keeps them), so
    that tuning then spends its time timing."""
    from concurrent.futures import ProcessPoolExecutor

    work = [(k, d, dt, c, t.as_list()) for k in kernels for d in head_dims
            for dt in dtypes for c in causals for t in CANDIDATES[k]
            if _tiles.fits(k, t, d, (9, 0))]
    with ProcessPoolExecutor(jobs) as ex:
        list(ex.map(_compile_one, work))
    log(f"compiled {len(work)} candidates")


def tune(kernels=("forward", "dkdv", "dq"), head_dims=(64, 128), dtypes=("bfloat16",),
         causals=(False, True), device=0, batch=4, heads=16, seqlen=4096, path=None,
         log=print):
    """Times every candidate, writes the winners to the cache and returns all timings as
    ``{key: {"tiles": [w, n, m, s], "ms": {"w4n64": ms, "w4n64m2": ms, ...}}}``."""
    from . import launch
    from .driver import device_cc, device_name

    name, cc = device_name(device), device_cc(device)
    path = cache_path() if path is None else Path(path)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    for kernel in kernels:
        for d in head_dims:
            for causal in causals:
                for dtype in dtypes:
                    ms, tried = {}, {}
                    for t in CANDIDATES[kernel]:
                        if not _tiles.fits(kernel, t, d, cc):
                            continue
                        tag = t.tag
                        tried[tag] = t
                        try:
                            ms[tag] = time_candidate(kernel, t, d, causal, dtype, device,
                                                     batch, heads, seqlen)
                        except Exception as e:  # noqa: BLE001  (a tiling that cannot launch)
                            log(f"{kernel} D={d} causal={causal} {tag}: {type(e).__name__}: {e}")
                    if not ms:
                        continue
                    best = min(ms, key=ms.get)
                    t = tried[best]
                    key = cache_key(name, cc, kernel, d, causal, dtype)
                    stored[key] = {"tiles": t.as_list(), "ms": ms,
                                   "size": [batch, heads, seqlen]}
                    log(f"{kernel:>7} D={d:<3} {'causal' if causal else 'full':>6} {dtype}: "
                        + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()) + f"  -> {best}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1, sort_keys=True))
    launch.forget_plans()
    return stored


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashcore.backends.numba_cuda.autotune",
                                description=__doc__.split("\n\n")[0])
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    names = lambda s: tuple(s.split(","))  # noqa: E731
    p.add_argument("--kernels", type=names, default=("forward", "dkdv", "dq"))
    p.add_argument("--head-dims", type=ints, default=(64, 128))
    p.add_argument("--dtypes", type=names, default=("bfloat16",))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--jobs", type=int, default=0,
                   help="compile the candidates in this many processes first")
    p.add_argument("--json", default=None, help="cache file (default: %(default)s -> "
                   f"{cache_path()})")
    a = p.parse_args(argv)
    for k in a.kernels:
        if k not in CANDIDATES:
            p.error(f"--kernels: unknown kernel {k!r}; expected some of {', '.join(CANDIDATES)}")
    for d in a.head_dims:
        if d not in _tiles.HEAD_DIMS:
            p.error(f"--head-dims: {d} has no tensor-core kernel ({_tiles.HEAD_DIMS})")
    if a.jobs:
        precompile(a.kernels, a.head_dims, a.dtypes, jobs=a.jobs)
    tune(a.kernels, a.head_dims, a.dtypes, batch=a.batch, heads=a.heads, seqlen=a.seqlen,
         path=a.json)
    print(f"wrote {a.json or cache_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
