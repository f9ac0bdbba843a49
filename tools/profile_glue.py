"""Where the host time of one small ``flashcore.attention`` forward+backward through torch
autograd goes: cProfile over repeated calls (tiny input, the default device), the top
functions by own time. A diagnostic for the glue overhead that tools/bench_wrappers.py
measures.

Usage: python tools/profile_glue.py [--device cuda|cpu] [--calls 300] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    import torch

    import flashcore

    q, k, v, do = (torch.randn(1, 1, 16, 16, device=a.device) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def step():
        torch.autograd.grad(flashcore.attention(qg, kg, vg), (qg, kg, vg), do)

    for _ in range(5):
        step()
    sync()
    for label, fn in [("forward", lambda: flashcore.attention(qg, kg, vg)),
                      ("forward+backward", step)]:
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        sync()
        print(f"{label}: {(time.perf_counter() - t0) / a.calls * 1e6:.1f} us per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        step()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
