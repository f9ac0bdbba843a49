"""The sm_90a wgmma forward (backends/numba_cuda/hopper/forward.py) on an H100/H200: checked
against the mma.sync forward, then timed beside it and beside torch SDPA's FlashAttention-2
and cuDNN backends.

Cases: bf16, B=4 H=16 N=4096 and B=1 H=16 N=16384, head dims 64 and 128, causal or not
(``--quick``: N=4096 only). First the kernels are compiled in parallel processes (numba's
disk cache). Per case, first a check: the wgmma forward (the default on cc 9.0) in each
candidate tiling (``tilings.HOPPER_CANDIDATES``: v1's schedule, FlashAttention 3's
overlapped one at 128 and 64 keys, and that one with a single warpgroup and two blocks per
SM) against the mma.sync forward (the switch unset; which
kernel ran is checked), norm-wise relative error of o and the largest lse difference. Then
the times of the tilings that passed: CUDA events around each call (flashcore's front end
included, some tens of microseconds of host time, hidden while the GPU queue stays full),
the median of
``--repeat`` calls after 3 warm-up calls (``--span``: their mean between one pair of
events), as TFLOP/s (4 B H N² D, halved for causal) and as
ratios to cuDNN's time. The table comes last; exit status 1 when a check fails, 2 when it
cannot run.

With ``--masks`` (e.g. ``none,window:1024,softcap:30,alibi``) every case runs under each
mask (``window:W``: W keys a query, ``window=(W // 2, W - W // 2 - 1)`` as the bench's;
``softcap:C``;
``alibi``: slopes 2^(-8 (h+1) / H)); the masked rows are checked against the mma.sync
forward with the same mask, timed without the SDPA peers, and the table adds each one's
time over its tiling's time without a mask (``--masks`` should then start with ``none``).

Usage: python tools/hopper_forward.py [--quick] [--repeat 20] [--tilings g2n128,...]
                                      [--cases 4x16x8192,...] [--head-dims 128]
                                      [--masks none,window:1024,...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

HOPPER_ENV = "FLASHCORE_HOPPER"
CASES = [(4, 16, 4096), (1, 16, 16384)]
HEAD_DIMS = (64, 128)
#: Norm-wise relative difference allowed between the two bf16 forwards (each within ~4e-3
#: of the exact result: bf16's rounding of o).
TOL = 1e-2


def fail(msg, code=2):
    print(f"hopper_forward: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def environment():
    """(torch, flashcore, launch) where an H100/H200 and the backend are there, else exit."""
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 5):
        fail(f"NumPy {np.__version__}: numba-cuda 0.30.4 cannot compile kernels with NumPy "
             ">= 2.5 (bash tools/gpu_session.sh hopper installs the carried NumPy 2.4)")
    import torch
    from flashcore.backends import numba_cuda
    from flashcore.backends.numba_cuda import launch

    import flashcore

    why = numba_cuda.unavailable_reason()
    if why is not None:
        fail(f"numba_cuda is unavailable: {why}")
    if not torch.cuda.is_available():
        fail("torch sees no CUDA GPU")
    if torch.cuda.get_device_capability(0) != (9, 0):
        fail(f"{torch.cuda.get_device_name(0)} is not compute capability 9.0: no wgmma")
    return torch, flashcore, launch


def mask_of(spec, causal, heads, torch):
    """``(label, kernel options, call options)`` of a ``--masks`` entry."""
    name, _, arg = spec.partition(":")
    if name == "none":
        return "none", {}, {}
    if name == "window":
        w = (int(arg) // 2, int(arg) - int(arg) // 2 - 1)  # (W keys a query, as the bench)
        return f"window {arg}", {"window": w}, {"window": w}
    if name == "softcap":
        return f"softcap {arg}", {"softcap": float(arg)}, {"softcap": float(arg)}
    if name == "alibi":
        slopes = None if torch is None else torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32,
            device="cuda")
        return "alibi", {"alibi": True}, {"alibi_slopes": slopes}
    fail(f"unknown mask {spec!r} (none, window:W, softcap:C, alibi)")


def serves(tilings, t, d):
    """Whether tiling ``t`` (a candidate, or one of ``tilings.HOPPER_TRIALS``, timed by
    name) is built at head dim ``d``."""
    if t in tilings.HOPPER_TRIALS:
        return d in tilings.HOPPER_CANDIDATE_DIMS.get(t, (64, 128))
    return t in tilings.hopper_candidates(d)


def variants(launch, tilings, candidates, head_dims, masks):
    """The kernels the run needs: the wgmma forward per candidate tiling and the mma.sync
    forward, per (D, causal, mask)."""
    from dataclasses import replace

    from flashcore.backends.numba_cuda.driver import device_cc

    out = []
    for d in head_dims:
        for c in (False, True):
            for m in masks:
                opts = mask_of(m, c, 1, None)[1]
                base = launch.hopper_variant(d, "bfloat16", c, **opts)
                out += [replace(base, tiles=tilings.masked_tiles(
                    t, softcap="softcap" in opts, alibi="alibi" in opts,
                    window="window" in opts, head_dim=d) if opts else t)
                        for t in candidates if serves(tilings, t, d)]
                out.append(launch.tc_variants(d, "bfloat16", c, device_cc(0),
                                              gpu=launch._gpu(0)[1], **opts)[0])
    return list(dict.fromkeys(out))


def use_tiling(launch, tilings, t):
    """Make the plans pick tiling ``t`` for the wgmma forward (plans do not key on it), at
    any size (a tiling of bulk tensor copies is otherwise replaced below
    ``tilings.TMA_MIN_WORK``, by ``tilings.LONG_KEYS``' on long key sequences and by
    ``tilings.PERSISTENT_TABLES``' on dense calls, a window's and varlen rows: the times
    would carry the wrong name)."""
    for key in list(tilings.HOPPER_FORWARD):
        tilings.HOPPER_FORWARD[key] = t
    tilings.LONG_KEYS.clear()
    for table in tilings.PERSISTENT_TABLES:
        table.clear()
    tilings.TMA_MIN_WORK = 0
    launch._PLANS.clear()


#: ``--span``: time ``repeat`` calls between one pair of CUDA events (their mean) instead of
#: each call between its own (their median). On an H100 at B=1 N=16384 D=128 the per-call
#: medians of one kernel moved by ±6% from one measurement to the next while the spans
#: agreed within 3% (notes/persistent_2026-11-27.md, section 3).
SPAN = False


def timer(torch, fn, repeat):
    """Median milliseconds of ``fn()`` between CUDA events, after 3 warm-up calls (with
    :data:`SPAN`: the mean over ``repeat`` calls between one pair of events)."""
    for _ in range(3):
        fn()
    calls, samples = (repeat, 1) if SPAN else (1, repeat)  # (calls between a pair)
    pairs = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / calls for a, b in pairs)


def table(rows) -> str:
    """The results as a table: TFLOP/s per contender (of the whole N² D work, masks or
    not), then time ratios to cuDNN of the fastest wgmma tiling and of the mma.sync forward
    (masked rows: to the same tiling's time without the mask, as ``tiling/none``)."""
    labels = []
    for r in rows:
        labels += [x for x in r["ms"] if x not in labels]
    w = {x: max(12, len(x) + 2) for x in labels}
    lines = ["", f"{'case':<26}" + "".join(f"{x:>{w[x]}}" for x in labels)
             + f"{'best/cuDNN':>12}{'mma/cuDNN':>11}  (TFLOP/s; time ratios)"]
    for r in rows:
        tf, ms = r["tflops"], r["ms"]
        ref = ms.get("sdpa_cudnn")
        ours = [t for x, t in ms.items() if x.startswith("wgmma")]
        best = f"{min(ours) / ref:.2f}" if ref and ours else "-"
        mma = f"{ms['mma.sync'] / ref:.2f}" if ref and "mma.sync" in ms else "-"
        plain = r.get("plain")
        if plain:  # a masked row: each time over its own time without the mask
            best = " ".join(f"{x.split()[-1]}/none {t / plain[x]:.3f}"
                            for x, t in ms.items() if x in plain)
        lines.append(f"{r['case']:<26}"
                     + "".join(f"{tf[x]:>{w[x]}.0f}" if x in tf else f"{'-':>{w[x]}}"
                               for x in labels)
                     + f"{best:>12}{mma:>11}" + ("" if r["check"] else "  CHECK FAILED"))
    return "\n".join(lines)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N=4096 only")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--span", action="store_true",
                    help="time --repeat calls between one pair of events (SPAN)")
    ap.add_argument("--tilings", default=None,
                    help="wgmma tilings by tag, e.g. g2n128,g2n128o (default: "
                         "tilings.HOPPER_CANDIDATES)")
    ap.add_argument("--cases", default=None, help="BxHxN,... (default 4x16x4096,1x16x16384)")
    ap.add_argument("--head-dims", default=None, help="e.g. 128 (default 64,128)")
    ap.add_argument("--masks", default="none", help="none,window:W,softcap:C,alibi")
    ap.add_argument("--json", default=os.environ.get("HOPPER_JSON"))
    args = ap.parse_args(argv)
    global SPAN
    SPAN = args.span
    cases = ([tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
             if args.cases else CASES[:1] if args.quick else CASES)
    head_dims = (tuple(int(x) for x in args.head_dims.split(","))
                 if args.head_dims else HEAD_DIMS)
    masks = args.masks.split(",")
    torch, flashcore, launch = environment()
    from flashcore.backends.numba_cuda import tilings

    candidates = list(tilings.HOPPER_CANDIDATES)
    tilings.WINDOW_TILES.clear()  # (windows run on each candidate, not on the table's choice)
    from flashcore.backends.numba_cuda.hopper import tilings as hopper_tilings

    hopper_tilings.SOFTCAP_KEYS = 256  # (a softcap runs on each candidate's own key tiles)
    if args.tilings:
        known = {t.tag: t for t in (*candidates, *tilings.HOPPER_TRIALS)}
        try:
            candidates = [known[x] for x in args.tilings.split(",")]
        except KeyError as e:
            fail(f"unknown tiling {e}; known: {', '.join(known)}")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashcore._warmup import compile_variants

    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    todo = variants(launch, tilings, candidates, head_dims, masks)
    for tag, s in compile_variants(todo, 0):
        print(f"compiled {tag}: {s:.1f} s", flush=True)

    ran = []
    real = launch.launch_forward

    def spy(kern, *a, **kw):
        ran.append(kern.name)
        return real(kern, *a, **kw)

    launch.launch_forward = spy

    def ours(q, k, v, causal, hopper, opts=None):
        if hopper:
            os.environ[HOPPER_ENV] = "1"
        else:
            os.environ[HOPPER_ENV] = "0"
        return flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cuda",
                                           **(opts or {}))

    def sdpa(backend, q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def case_row(name, q, k, v, causal, opts, built, peers):
        """One case: the check of every tiling against the mma.sync forward, then the
        times (None after a fault, which ends the CUDA context)."""
        ms, checks, ok = {}, [], True
        try:
            ran.clear()
            om, lm = ours(q, k, v, causal, False, opts)
            for t in built:
                use_tiling(launch, tilings, t)
                oh, lh = ours(q, k, v, causal, True, opts)
                torch.cuda.synchronize()
                err = float(torch.linalg.vector_norm((oh.float() - om.float()).ravel())
                            / torch.linalg.vector_norm(om.float().ravel()))
                fin = torch.isfinite(lm)
                dl = float((lh[fin] - lm[fin]).abs().max()) if fin.any() else 0.0
                good = err < TOL and dl < 1e-3 and bool((torch.isfinite(lh) == fin).all())
                checks.append((t.tag, good, err, dl))
                ok &= good
            kinds = tuple(ran)
            ok &= kinds == ("attn_forward_tc",) + ("attn_forward_wgmma",) * len(built)
        except Exception as e:  # noqa: BLE001  (a fault ends the CUDA context)
            print(f"check {name}: ERROR {type(e).__name__}: {e}", flush=True)
            return None
        print(f"check {name}: {'pass' if ok else 'FAIL'} (kernels {kinds}; "
              + "; ".join(f"{tag} {'ok' if g_ else 'WRONG'}: o rel {e_:.1e}, lse "
                          f"max diff {d_:.1e}" for tag, g_, e_, d_ in checks)
              + ")", flush=True)
        for t, (_, good, _, _) in zip(built, checks):
            if good:
                use_tiling(launch, tilings, t)
                ms[f"wgmma {t.tag}"] = timer(
                    torch, lambda: ours(q, k, v, causal, True, opts), args.repeat)
        ms["mma.sync"] = timer(torch, lambda: ours(q, k, v, causal, False, opts),
                               args.repeat)
        for label, be in ((("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                           ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)) if peers else ()):
            try:
                ms[label] = timer(torch, lambda be=be: sdpa(be, q, k, v, causal),
                                  args.repeat)
            except RuntimeError as e:  # (a backend that declines the case)
                print(f"  {label}: {str(e).splitlines()[0][:100]}")
        return {"case": name, "check": ok, "checks": checks, "ms": ms}

    rows, failed = [], False
    for B, H, N in cases:
        for D in head_dims:
            built = [t for t in candidates if serves(tilings, t, D)]
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(N + D + causal)
                q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g,
                                       dtype=torch.bfloat16) for _ in range(3))
                plain = None
                for spec in masks:
                    label, _, opts = mask_of(spec, causal, H, torch)
                    name = (f"B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}"
                            + ("" if label == "none" else f" {label}"))
                    row = case_row(name, q, k, v, causal, opts, built, label == "none")
                    if row is None:
                        print(table(rows))
                        return 1
                    failed |= not row["check"]
                    flops = 4 * B * H * N * N * D / (2 if causal else 1)
                    row["tflops"] = {k_: flops / t_ / 1e9 for k_, t_ in row["ms"].items()}
                    if label == "none":
                        plain = row["ms"]
                    elif plain:
                        row["plain"] = plain
                    rows.append(row)
    os.environ.pop(HOPPER_ENV, None)
    launch.launch_forward = real

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
