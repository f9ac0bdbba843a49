"""Host time of one numba_cuda forward call on a tiny torch CUDA input, and of each step it
takes, timed separately: the median over blocks of ``--calls`` calls of the time until the
last call returns (before the synchronize that ends each block). Blocks are kept short so
that the launch queue never fills: with thousands of queued launches the host waits for the
GPU and the figure becomes the kernels' time (seen: 37 µs per call with blocks of 2000). The
parts add up to about the whole, so a row shows where a tiny call's host time goes; each row
is also given ÷ torch SDPA's forward, since the hosts of the lent machines differ in speed.

Usage: python tools/host_breakdown.py [--calls 100] [--blocks 50]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import time


def per_call_us(rows, calls, blocks, sync):
    """Median µs per call of each ``(name, fn)`` row. The rows take turns, one block each
    per round, so that a host whose speed drifts (the lent VMs' does, by tens of percent
    between runs) biases no row against another."""
    out = {name: [] for name, _ in rows}
    for _ in range(blocks):
        for name, fn in rows:
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return {name: statistics.median(v) for name, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=50)
    a = ap.parse_args(argv)
    import torch
    from flashcore.backends import numba_cuda
    from flashcore.backends.numba_cuda import driver, launch

    import flashcore
    from flashcore._checks import make_case

    q, k, v = (torch.randn(1, 1, 16, 16, device="cuda") for _ in range(3))
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True)
    sync = torch.cuda.synchronize
    numba_cuda.forward(q, k, v, case)  # compile / load, plans
    sync()
    o = torch.empty_like(q)
    lse = torch.empty(1, 1, 16, device="cuda")
    views = [(x.data_ptr(), x.stride()) for x in (q, k, v, o)]
    # the launch run_forward makes for this call (the SIMT kernel: fp32), caught once: its
    # kernel, grid and argument words, as launch_forward packs them
    seen = []
    real_call = driver.Prepared.__call__

    def spy(self, grid, stream, args):
        seen.append((self, grid, args))
        return real_call(self, grid, stream, args)

    driver.Prepared.__call__ = spy
    try:
        numba_cuda.forward(q, k, v, case)
    finally:
        driver.Prepared.__call__ = real_call
    sync()
    kern, grid, args = seen[-1]
    grid3 = (*grid[:2], grid[2] if len(grid) > 2 else 1)
    stream = torch._C._cuda_getCurrentRawStream(0)
    lib = driver._libcuda()
    cur = ctypes.c_void_p()
    buf = (ctypes.c_int64 * len(args))()
    fmt = kern._fmt
    adapter = numba_cuda._adapter("torch")
    raw_launch = lib.cuLaunchKernel

    def lock_ctx(p):
        with p._lock:
            lib.cuCtxGetCurrent(p._cur_ref)
    case_no_lse = make_case(q, k, v, causal=False, scale=None, layout="bhnd")
    rows = [
        ("flashcore.attention(q, k, v) (public API)", lambda: flashcore.attention(q, k, v)),
        ("numba_cuda.forward, lse not asked (scratch)", lambda: numba_cuda.forward(
            q, k, v, case_no_lse)),
        ("numba_cuda.forward, lse returned", lambda: numba_cuda.forward(q, k, v, case)),
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("torch.empty lse", lambda: torch.empty((1, 1, 16), dtype=torch.float32,
                                                 device=q.device)),
        ("q.new_empty lse", lambda: q.new_empty((1, 1, 16), dtype=torch.float32)),
        ("current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("4 views (data_ptr, stride, bhnd)", lambda: [adapter.view(x, "bhnd", []) for x in
                                                     (q, k, v, o)]),
        ("run_forward (plan, args, launch)", lambda: launch.run_forward(
            case, 0, stream, *views, lse.data_ptr())),
        ("Prepared.__call__ (pack, context, launch)", lambda: kern(grid, stream, args)),
        ("struct.pack_into", lambda: struct.pack_into(fmt, buf, 0, *args)),
        ("cuCtxGetCurrent (ctypes)", lambda: lib.cuCtxGetCurrent(ctypes.byref(cur))),
        ("cuLaunchKernel alone (ctypes, packed args)", lambda: raw_launch(
            kern.handle, *grid3, kern.threads, 1, 1, kern.smem, stream, kern._ptrs,
            None)),
        ("lock + context check (no launch)", lambda: lock_ctx(kern)),
    ]
    try:  # the same launch through cuda-python's Cython bindings, where numba-cuda has them
        from cuda.bindings import driver as cb

        fh, sh, pp = kern.handle, stream, ctypes.addressof(kern._ptrs)
        def cb_launch():
            return cb.cuLaunchKernel(fh, *grid3, kern.threads, 1, 1, kern.smem, sh, pp,
                                     0)

        print("cuda.bindings launch returns", cb_launch())
        rows.append(("cuLaunchKernel (cuda.bindings, int params)", cb_launch))
    except Exception as e:  # noqa: BLE001
        print(f"(cuda.bindings launch not measured: {e})")
    rows += [
        ("torch SDPA forward (reference)", lambda: torch.nn.functional
         .scaled_dot_product_attention(q, k, v)),
    ]
    for _, fn in rows:  # (warm-up: plans, scratch buffers)
        fn()
    us = per_call_us(rows, a.calls, a.blocks, sync)
    sdpa = us[rows[-1][0]]
    print(f"{'step':48s} {'us/call':>8s} {'÷ SDPA':>7s}")
    for name, _ in rows:
        print(f"{name:48s} {us[name]:8.2f} {us[name] / sdpa:7.2f}", flush=True)


if __name__ == "__main__":
    main()
