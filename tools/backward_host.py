"""Host time of the torch backward (issue 17: forward+backward one call at a time carries
flashcore's backward host time wherever it exceeds the forward's kernel, 0.5-1.0 ms in
``tools/gap_trace.py``'s timelines against cuDNN's 0.2-0.5).

On torch CUDA tensors (bf16, B=4 H=16 N=4096, D=64 and 128, causal and not), after a
warm-up: the host time of ``torch.autograd.grad`` on one forward's graph
(``retain_graph=True``, so only the backward is timed), of the forward, and of SDPA's
cuDNN backend for both, in blocks of ``CALLS`` calls (the GPU never waited for: each block
ends in a synchronize that is not timed); then cProfile over ``PROFILE_CALLS`` backward
calls of flashcore, by own time and by cumulative time.

Usage (GPU host, repository root): python tools/backward_host.py [--head-dim 64]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import flashcore

CALLS, BLOCKS, PROFILE_CALLS = 10, 15, 60


def host_us(fn):
    """Median µs a call over BLOCKS blocks of CALLS calls (the sync after a block untimed)."""
    out = []
    for _ in range(BLOCKS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        out.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(out)


def cases(d, causal):
    B, H, N = 4, 16, 4096
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()

    def fc_fwd():
        return flashcore.attention(q, k, v, causal=causal)

    def sdpa_fwd():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return (q, k, v, do), {"flashcore": fc_fwd, "cudnn": sdpa_fwd}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for d in args.head_dim:
        for causal in (False, True):
            (q, k, v, do), fwds = cases(d, causal)
            row = {}
            for name, fwd in fwds.items():
                for _ in range(3):
                    torch.autograd.grad(fwd(), (q, k, v), do)
                o = fwd()
                row[name + " fwd"] = host_us(fwd)
                row[name + " bwd"] = host_us(
                    lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            print(f"D={d} causal={causal}: host µs a call: " + ", ".join(
                f"{k} {t:.0f}" for k, t in row.items()))
            if d == args.head_dim[0] and not causal:
                o = fwds["flashcore"]()
                prof = cProfile.Profile()
                torch.cuda.synchronize()
                prof.enable()
                for _ in range(PROFILE_CALLS):
                    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                prof.disable()
                torch.cuda.synchronize()
                for key, n in (("tottime", 30), ("cumulative", 45)):
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
                    print(f"\n--- cProfile of {PROFILE_CALLS} flashcore backward calls, by "
                          f"{key} ---")
                    print("\n".join(line for line in s.getvalue().splitlines()[6:]
                                    if line.strip()))


if __name__ == "__main__":
    main()
