"""Tilings of the SIMT float32 kernels on a GPU, each checked and then timed beside torch
SDPA's memory-efficient kernel in the same process.

For every candidate tiling: a correctness check first (B=1, H=2, N=333, outputs poisoned
with NaN, against a float64 torch reference; forward, and gradients for the backward
passes), then the time at B=4, H=16, N=4096 (median of CUDA-event timings). A backward
candidate replaces one pass's tiling (dK/dV or dQ) and the whole backward is timed.
Writes JSON to $OUT and prints a table last. SWEEP_DIMS picks the head dims (default
64,128); --compile-only fills numba's disk cache with every candidate (SWEEP_JOBS processes)
and times nothing. On a GPU machine: the ``sweep`` stage of tools/gpu_session.sh.

Usage: python tools/simt_sweep.py [--fwd-only] [--bwd-only] [--compile-only]
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from flashcore.backends.numba_cuda import launch, tilings
from flashcore.backends.numba_cuda.variant import Variant
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcore._checks import make_case
from flashcore.bench import Prepared, time_runs

OUT = os.environ.get("OUT", ".")
DEV = "cuda"
T = tilings.Tiles

FORWARD = {
    64: [T(128, 64, 16, 16, 2, True), T(128, 64, 16, 16, 2, True, k_unroll=16),
         T(64, 64, 8, 16, 3, True), T(64, 64, 8, 16, 3, True, k_unroll=16)],
    # (two blocks per SM at D=128, 64 or 96 query rows, all lost to the one-block 128x64
    # in an H100 sweep before 3127bde: 1.20-1.42x SDPA against 1.19; notes/numba_cuda.md)
    128: [T(128, 64, 16, 16, 1, True), T(128, 64, 16, 16, 1, True, k_unroll=8),
          T(128, 64, 16, 16, 1, True, k_unroll=16)],
}
DKDV = {
    64: [T(128, 64, 16, 16, 1, True), T(128, 64, 16, 16, 1, True, k_unroll=16)],
    128: [T(64, 64, 8, 32, 1, True, True), T(64, 64, 8, 32, 1, True, True, k_unroll=8),
          T(64, 64, 8, 32, 1, True, True, k_unroll=16)],
}
DQ = {
    64: [T(128, 64, 16, 16, 1, True), T(128, 64, 16, 16, 1, True, k_unroll=16)],
    128: [T(128, 32, 16, 16, 1, True), T(128, 32, 16, 16, 1, True, k_unroll=8),
          T(128, 32, 16, 16, 1, True, k_unroll=16)],
}


def bench(fn, warmup=3, reps=15):
    """Median milliseconds of ``reps`` runs of ``fn`` after ``warmup`` (CUDA events,
    flashcore.bench.time_runs)."""
    prep = Prepared(fn, timer="cuda_event", device=DEV)
    return 1e3 * statistics.median(time_runs(prep, repeat=reps, warmup=warmup))


def randn(*shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g)


def name(t):
    return f"{t.block_m}x{t.block_n}/{t.rows}x{t.cols}" + (
        f"/b{t.min_blocks}" if t.min_blocks > 1 else "") + ("/cpa" if t.async_copy else "") + (
        "/ps1" if t.one_ps_buffer else "") + (f"/u{t.k_unroll}" if t.k_unroll else "")


def fits(t, words):
    return t.threads <= 1024 and tilings.blocks_fit(words, t.min_blocks, (9, 0))


class Problem:
    """Inputs, outputs (poisoned per run) and the raw launch arguments of one shape."""

    def __init__(self, B, H, N, D, causal, seed):
        self.q, self.k, self.v, self.do = (randn(B, H, N, D, seed=seed + i) for i in range(4))
        self.causal = causal
        self.case = make_case(self.q, self.k, self.v, causal=causal, scale=None,
                              layout="bhnd", need_lse=True)
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty(B, H, N, device=DEV)
        self.grads = [torch.empty_like(self.q) for _ in range(3)]
        self.delta = torch.empty(B, H, N, device=DEV)
        self.stream = torch.cuda.current_stream().cuda_stream

    def v_(self, x):
        return (x.data_ptr(), x.stride())

    def forward(self, kt):
        launch.run_forward(self.case, 0, self.stream, *map(self.v_, (self.q, self.k, self.v,
                                                                      self.o)),
                           self.lse.data_ptr(), tiles=kt)

    def backward(self, kt):
        bcase = make_case(self.q, self.k, self.v, causal=self.causal, scale=None,
                          layout="bhnd", direction="backward",
                          extra={"do": self.do, "o": self.o, "lse": self.lse})
        launch.run_backward(bcase, 0, self.stream,
                            *map(self.v_, (self.do, self.q, self.k, self.v, self.o)),
                            self.v_(self.lse), self.delta.data_ptr(),
                            *map(self.v_, self.grads), tiles=kt)


def reference(p):
    q, k, v = (x.double().requires_grad_(True) for x in (p.q, p.k, p.v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=p.causal)
    grads = torch.autograd.grad(o, (q, k, v), p.do.double())
    return o.detach(), grads


def rel(x, ref):
    x = x.double()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm())


def check(D, kt, which):
    """Largest relative error over the outputs ``which`` computes (fwd: O; bwd: dQ, dK, dV)
    on a small problem with tails, poisoned outputs first."""
    worst = 0.0
    for causal in (False, True):
        p = Problem(1, 2, 333, D, causal, seed=17)
        o_ref, g_ref = reference(p)
        p.o.fill_(math.nan)
        p.forward(kt if which == "fwd" else None)
        if which == "fwd":
            worst = max(worst, rel(p.o, o_ref))
            continue
        for g in p.grads:
            g.fill_(math.nan)
        p.backward(kt)
        worst = max(worst, *(rel(g, r) for g, r in zip(p.grads, g_ref)))
    return worst


def sdpa_eff(p, backward):
    q, k, v = (x.clone().requires_grad_(backward) for x in (p.q, p.k, p.v))

    def run():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=p.causal)
        if backward:
            o.backward(p.do)
    return bench(run)


def _compile(job):
    which, D, t, causal = job
    kernel = {"fwd": "forward", "dkdv": "dkdv", "dq": "dq"}[which]
    launch.kernel(Variant(kernel, "simt", D, "float32", causal, t,
                          tilings.streams(t, "float32")), 0)


def compile_only():
    """Compile (into numba's disk cache, in parallel processes) every candidate tiling of
    SWEEP_DIMS, so that a timing run started later only loads them."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for D in [int(x) for x in os.environ.get("SWEEP_DIMS", "64,128").split(",")]:
        for which, cands, words in (("fwd", FORWARD[D], tilings.forward_smem_words),
                                    ("dkdv", DKDV[D], tilings.dkdv_smem_words),
                                    ("dq", DQ[D], tilings.dq_smem_words)):
            jobs += [(which, D, t, causal) for t in cands if fits(t, words(t, D, "float32"))
                     for causal in ((False, True) if which == "fwd" else (False,))]
    with ProcessPoolExecutor(int(os.environ.get("SWEEP_JOBS", "6"))) as ex:
        list(ex.map(_compile, jobs))


def main():
    if "--compile-only" in sys.argv:
        return compile_only()
    rows = []
    B, H, N = 4, 16, 4096
    do_fwd = "--bwd-only" not in sys.argv
    do_bwd = "--fwd-only" not in sys.argv
    for D in [int(x) for x in os.environ.get("SWEEP_DIMS", "64,128").split(",")]:
        base = tilings.choose_simt(D, "float32", False, (9, 0))
        for causal in (False, True) if do_fwd else ():
            p = Problem(B, H, N, D, causal, seed=1)
            ref = sdpa_eff(p, False)
            rows.append(dict(D=D, causal=causal, pass_="fwd", tiling="sdpa_eff", ms=ref))
            for t in FORWARD[D]:
                if not fits(t, tilings.forward_smem_words(t, D, "float32")):
                    continue
                kt = tilings.KernelTiles(forward=t, dkdv=base.dkdv, dq=base.dq)
                try:
                    err = check(D, kt, "fwd") if not causal else math.nan
                    ms = bench(lambda kt=kt, p=p: p.forward(kt))
                except Exception as e:  # noqa: BLE001  (a tiling that does not launch)
                    print(f"fwd D={D} {name(t)}: {type(e).__name__}: {e}", flush=True)
                    continue
                rows.append(dict(D=D, causal=causal, pass_="fwd", tiling=name(t), ms=ms,
                                 ratio=ms / ref, err=err))
                print(json.dumps(rows[-1]), flush=True)
            del p
        if not do_bwd:
            continue
        p = Problem(B, H, N, D, False, seed=1)
        p.forward(None)
        ref = sdpa_eff(p, True) - sdpa_eff(p, False)
        rows.append(dict(D=D, causal=False, pass_="bwd", tiling="sdpa_eff", ms=ref))
        for which, cands, words in (("dkdv", DKDV[D], tilings.dkdv_smem_words),
                                    ("dq", DQ[D], tilings.dq_smem_words)):
            for t in cands:
                if not fits(t, words(t, D, "float32")):
                    continue
                kt = tilings.KernelTiles(forward=base.forward,
                                       dkdv=t if which == "dkdv" else base.dkdv,
                                       dq=t if which == "dq" else base.dq)
                try:
                    err = check(D, kt, "bwd")
                    ms = bench(lambda kt=kt, p=p: p.backward(kt))
                except Exception as e:  # noqa: BLE001
                    print(f"{which} D={D} {name(t)}: {type(e).__name__}: {e}", flush=True)
                    continue
                rows.append(dict(D=D, causal=False, pass_=f"bwd:{which}", tiling=name(t),
                                 ms=ms, ratio=ms / ref, err=err))
                print(json.dumps(rows[-1]), flush=True)
        del p
    with open(os.path.join(OUT, "simt_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{'D':>4} {'causal':>6} {'pass':>9} {'tiling':>20} {'ms':>8} {'÷eff':>6} {'err':>8}")
    for r in rows:
        print(f"{r['D']:>4} {r['causal']!s:>6} {r['pass_']:>9} {r['tiling']:>20} "
              f"{r['ms']:8.3f} {r.get('ratio', 1.0):6.2f} {r.get('err', 0.0):8.1e}")


if __name__ == "__main__":
    main()
