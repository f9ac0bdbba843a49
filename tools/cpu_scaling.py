"""How the numba_cpu forward and torch SDPA's CPU kernel scale with threads, side by side.

For each (D, causal, N) and thread count, both are timed in turns (A B, B A, ...; the
median of ``--rounds`` rounds), B=1, H=8, fp32, on torch tensors as the bench does; the
flashcore forward also at other job sizes (query tiles per job, ``--per-job``) to see
whether the split of the work, not the tile products, sets the pace at few jobs per thread.
One more row: a tiny call (N=16), the per-call cost that is neither.

``--directions fwd,fwdbwd``: the forward, and forward+backward through torch autograd
(``flashcore.attention`` and SDPA on tensors that require grad, a fixed gradient of o).

Usage: python tools/cpu_scaling.py [--seqlens 1024,4096] [--head-dims 64,128]
           [--threads 1,4,16] [--per-job 0,1,2] [--rounds 15] [--directions fwd]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def timed(fn, rounds, inner):
    """Median seconds per call over ``rounds`` blocks of ``inner`` calls (after a warmup)."""
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def take_turns(rows, rounds):
    """Median seconds of each ``(name, fn)``, the rows taking turns, one call each per round
    (the order reversed every other round)."""
    times = {name: [] for name, _ in rows}
    for _, fn in rows:
        fn()
        fn()
    for r in range(rounds):
        for name, fn in (rows if r % 2 == 0 else rows[::-1]):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--seqlens", type=ints, default=[1024, 4096])
    ap.add_argument("--head-dims", type=ints, default=[64, 128])
    ap.add_argument("--threads", type=ints, default=None)
    ap.add_argument("--per-job", type=ints, default=[0],
                    help="query tiles per job (0: the backend's choice)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--directions", type=lambda s: s.split(","), default=["fwd"])
    a = ap.parse_args(argv)
    for d in a.directions:
        if d not in ("fwd", "fwdbwd"):
            ap.error(f"--directions: {d!r} is not fwd or fwdbwd")
    import numba
    import torch
    import torch.nn.functional as F
    from flashcore.backends import numba_cpu

    import flashcore

    top = os.cpu_count() or 1
    threads = a.threads or sorted({1, max(1, top // 4), max(1, top // 2), top})
    print(f"threading layer: {numba.config.THREADING_LAYER}; cpus {top}; "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    chosen = numba_cpu.q_tiles_per_job
    tiny = [torch.randn(1, 1, 16, 64) for _ in range(3)]
    header = f"{'dir':>6} {'D':>4} {'causal':>6} {'N':>6} {'thr':>4} {'sdpa ms':>8} " + \
        " ".join(f"{'fc/j' + str(p) if p else 'fc':>8}" for p in a.per_job) + \
        "  ratios (fc ÷ sdpa)"
    print(header)
    for direction in a.directions:
        bwd = direction == "fwdbwd"
        for D in a.head_dims:
            for causal in (False, True):
                for N in a.seqlens:
                    q, k, v = (torch.randn(1, 8, N, D, requires_grad=bwd) for _ in range(3))
                    do = torch.randn(1, 8, N, D)
                    for t in threads:
                        numba.set_num_threads(t)
                        torch.set_num_threads(t)
                        rows = [("sdpa", _call(lambda: F.scaled_dot_product_attention(
                            q, k, v, is_causal=causal), bwd, do, (q, k, v)))]
                        for p in a.per_job:
                            def ours(p=p):
                                if p:
                                    numba_cpu.q_tiles_per_job = lambda *_, p=p: p
                                try:
                                    if bwd:
                                        return flashcore.attention(q, k, v, causal=causal,
                                                                   backend="numba_cpu")
                                    return flashcore.attention_forward(
                                        q, k, v, causal=causal, backend="numba_cpu")
                                finally:
                                    numba_cpu.q_tiles_per_job = chosen
                            rows.append((f"fc{p}", _call(ours, bwd, do, (q, k, v))))
                        m = take_turns(rows, a.rounds)
                        s = m["sdpa"]
                        ours_ms = [m[f"fc{p}"] for p in a.per_job]
                        print(f"{direction:>6} {D:>4} {str(causal):>6} {N:>6} {t:>4} "
                              f"{s * 1e3:8.2f} " + " ".join(f"{x * 1e3:8.2f}"
                                                             for x in ours_ms) + "  "
                              + " ".join(f"{x / s:.2f}" for x in ours_ms), flush=True)
    numba.set_num_threads(top)
    torch.set_num_threads(top)
    fc = timed(lambda: flashcore.attention_forward(*tiny, backend="numba_cpu"), 20, 50)
    sd = timed(lambda: F.scaled_dot_product_attention(*tiny), 20, 50)
    print(f"threading layer used: {numba.threading_layer()}")
    print(f"tiny call (B=1 H=1 N=16 D=64), {top} threads: flashcore {fc * 1e6:.0f} us, "
          f"sdpa {sd * 1e6:.0f} us")
    tiny_parts(tiny, top, numba_cpu)


def _call(fn, bwd, do, leaves):
    """``fn`` (a forward), or with ``bwd`` the forward then ``o.backward(do)`` (the leaves'
    gradients cleared first)."""
    if not bwd:
        return fn

    def both():
        for x in leaves:
            x.grad = None
        o = fn()
        o.backward(do)

    return both


def tiny_parts(tiny, top, numba_cpu):
    """Where the tiny call's time goes: the backend on a case made once (no front end),
    and a parallel region that does nothing, on ``top`` threads."""
    import numba
    import numpy as np

    from flashcore._api import _plan

    @numba.njit(parallel=True)
    def empty_region(x, n):
        for i in numba.prange(n):
            x[i] += 0.0

    buf = np.zeros(top)
    case, _ = _plan(*tiny, False, None, "bhnd", True, "numba_cpu")
    backend = timed(lambda: numba_cpu.forward(*tiny, case), 20, 50)
    region = timed(lambda: empty_region(buf, top), 20, 50)
    print(f"tiny call parts: the backend alone {backend * 1e6:.0f} us; an empty parallel "
          f"region on {top} threads {region * 1e6:.1f} us")


if __name__ == "__main__":
    main()
