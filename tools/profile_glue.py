"""Where the host time of one small ``flashcore.attention`` forward+backward through torch
autograd goes: cProfile over repeated calls (tiny input, the default device), the top
functions by own time. A diagnostic for the glue overhead that tools/bench_wrappers.py
measures.

With ``--kvcache``: one decoding step of ``flashcore.attention_with_kvcache`` instead
(B=8, Hq=32, Hkv=8, D=128, bf16, 4096 cached keys, one new token appended each call with
``cache_seqlens`` unchanged, as a step after the lengths were read once), timed per call
with and without a synchronization after each; ``--host-lengths``: ``cache_seqlens`` as a
NumPy array (a decode loop's way of not waiting for the GPU).

Usage: python tools/profile_glue.py [--device cuda|cpu] [--calls 300] [--top 30] [--kvcache]
       [--host-lengths]
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
    p.add_argument("--kvcache", action="store_true")
    p.add_argument("--host-lengths", action="store_true")
    a = p.parse_args(argv)
    import torch

    import flashcore

    if a.kvcache:
        return kvcache(a, torch, flashcore)

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


def kvcache(a, torch, flashcore):
    B, Hq, Hkv, D, L = 8, 32, 8, 128, 4096
    dt = torch.bfloat16
    q = torch.randn(B, 1, Hq, D, device=a.device, dtype=dt)
    kc = torch.randn(B, L + 8, Hkv, D, device=a.device, dtype=dt)
    vc = torch.randn_like(kc)
    kn, vn = (torch.randn(B, 1, Hkv, D, device=a.device, dtype=dt) for _ in range(2))
    seqlens = torch.full((B,), L, dtype=torch.int32, device=a.device)
    if a.host_lengths:
        seqlens = seqlens.cpu().numpy()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def step():
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=kn, v=vn)

    for _ in range(5):
        step()
    sync()
    for label, each in (("enqueued back to back", False), ("synchronized each call", True)):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            step()
            if each:
                sync()
        sync()
        print(f"kvcache step, {label}: {(time.perf_counter() - t0) / a.calls * 1e6:.1f} us")
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
