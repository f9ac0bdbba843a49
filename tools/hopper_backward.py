"""The sm_90a wgmma backward (backends/numba_cuda/hopper/backward.py) on an H100/H200: checked
against the mma.sync backward, then forward+backward timed beside SDPA's FlashAttention-2
and cuDNN backends.

Cases: bf16, B=4 H=16 N=4096 and B=1 H=16 N=16384, head dims 64, 128 and 256, causal or not
(``--quick``: N=4096 only). First the kernels are compiled in parallel processes (numba's
disk cache). Per case, o and lse come from flashcore's forward (the wgmma forward, the
default on cc 9.0); then a check: the wgmma backward in each candidate pair of dK/dV and dQ
tilings (``tilings.HOPPER_BWD_CANDIDATES``, the table's first) against the mma.sync
backward (``FLASHCORE_HOPPER_BWD=0``; which kernels ran is checked), norm-wise relative
difference of dq, dk and dv, and a second call bitwise equal to the first. Then the times of
the pairs that passed and of the mma.sync backward: forward+backward (flashcore's
``attention_forward`` then ``attention_backward``, the front end's host time included) and
the backward alone, CUDA events around each call, the median of ``--repeat`` calls after 3
warm-up calls; SDPA's flash and cuDNN backends as ``out.backward(do)`` after the forward,
inputs requiring grad. TFLOP/s count 4 B H N² D for the forward and 2.5 times that for the
backward, halved for causal. The table comes last; exit status 1 when a check fails, 2 when
it cannot run.

``--fused``: also the non-deterministic mode (``FLASHCORE_DETERMINISTIC=0``: the dkdvq
kernel, dQ by atomics), checked and timed as "wgmma fused" in the table's dkdvq tiling and
as "fused TAG" in each of ``tilings.HOPPER_DKDVQ_CANDIDATES``' at that head dim.

``--span``: each time the mean of ``--repeat`` calls back to back between one pair of events
(the host's work hidden wherever it is shorter than the kernels').

Usage: python tools/hopper_backward.py [--quick] [--table-only] [--only TAG,..] [--fused]
           [--span] [--repeat 20] [--json FILE] [--head-dims 64,128,256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import hopper_forward  # (tools/ is the script's directory)
from hopper_forward import environment, timer

HOPPER_BWD_ENV = "FLASHCORE_HOPPER_BWD"
DETERMINISTIC_ENV = "FLASHCORE_DETERMINISTIC"
CASES = [(4, 16, 4096), (1, 16, 16384)]
HEAD_DIMS = (64, 128, 256)
#: Norm-wise relative difference allowed between the two bf16 backwards (each within ~1e-2
#: of the exact gradients: bf16's rounding of P, dS and the outputs).
TOL = 2e-2


def candidate_pairs(tilings, d, c, table_only=False, only=None):
    """The (dK/dV, dQ) tiling pairs timed at head dim ``d``, causal ``c``: the table's
    first, then the other candidates (none with ``table_only``; with ``only``, a set of
    tags, those with a tiling of that tag)."""
    pairs = tilings.HOPPER_BWD_CANDIDATES[d, c]
    if table_only:
        return pairs[:1]
    return pairs[:1] + tuple(p for p in pairs[1:]
                             if only is None or {p[0].tag, p[1].tag} & only)


def variants(launch, tilings, table_only=False, fused=False, head_dims=HEAD_DIMS,
             only=None):
    """The kernels the run needs, per (D, causal): the wgmma forward, the wgmma dK/dV and dQ
    of the candidate pairs (:func:`candidate_pairs`), the mma.sync dK/dV and dQ, and the
    preprocess."""
    from dataclasses import replace

    from flashcore.backends.numba_cuda.driver import device_cc

    out = set()
    for d in head_dims:
        for c in (False, True):
            out.add(launch.hopper_variant(d, "bfloat16", c))
            for kt, qt in candidate_pairs(tilings, d, c, table_only, only):
                out.add(replace(launch.hopper_variant(d, "bfloat16", c, "dkdv"), tiles=kt))
                out.add(replace(launch.hopper_variant(d, "bfloat16", c, "dq"), tiles=qt))
            out |= {v for v in launch.tc_variants(d, "bfloat16", c, device_cc(0),
                                                  gpu=launch._gpu(0)[1])
                    if v.kernel in ("dkdv", "dq")}
            kt = tilings.choose_simt(d, "bfloat16", c, device_cc(0))
            out.add(launch.simt_variants(d, "bfloat16", c, kt)[1])
            if fused and d <= 128:  # (no dkdvq kernel at D=256)
                from flashcore.backends.numba_cuda.variant import Variant

                table_q = launch.hopper_variant(d, "bfloat16", c, "dkdvq")
                out.add(table_q)
                out |= {replace(table_q, tiles=t)
                        for t in tilings.HOPPER_DKDVQ_CANDIDATES.get(d, ())}
                out.add(Variant("dqconvert", "simt", d, "bfloat16", False, 256))
    return sorted(out, key=lambda v: v.tag)


def use_pair(launch, tilings, d, c, pair):
    """Make the plans pick the (dK/dV, dQ) tilings ``pair`` at head dim ``d``, causal
    ``c``."""
    tilings.HOPPER_DKDV[d, c], tilings.HOPPER_DQ[d, c] = pair
    launch._PLANS.clear()


def fused_tilings(tilings, d):
    """(label, dkdvq tiling or None for the table's) of the fused mode at head dim ``d``."""
    return [("wgmma fused", None)] + [(f"fused {t.tag}", t)
                                      for t in tilings.HOPPER_DKDVQ_CANDIDATES.get(d, ())]


def use_dkdvq(launch, tilings, d, c, tiles):
    """Make the plans pick dkdvq tiling ``tiles`` (None: the table's, as saved by the
    first call) at head dim ``d``, causal ``c``."""
    saved = use_dkdvq.table.setdefault((d, c), tilings.HOPPER_DKDVQ[d, c])
    tilings.HOPPER_DKDVQ[d, c] = tiles or saved
    launch.forget_plans()


use_dkdvq.table = {}


def label(pair):
    return f"wgmma {pair[0].tag}/{pair[1].tag}"


def table(rows) -> str:
    """TFLOP/s of forward+backward per contender, then time ratios: the fastest wgmma
    pair's forward+backward and the mma.sync one's to cuDNN's, and the backward alone, the
    fastest wgmma pair's to the mma.sync one's."""
    labels = []
    for r in rows:
        labels += [x for x in r["ms"] if x not in labels]
    w = {x: max(12, len(x) + 2) for x in labels}
    lines = ["", f"{'case (fwd+bwd TFLOP/s)':<26}" + "".join(f"{x:>{w[x]}}" for x in labels)
             + f"{'best/cuDNN':>12}{'mma/cuDNN':>11}{'bwd best/mma':>14}"]
    for r in rows:
        tf, ms, bwd = r["tflops"], r["ms"], r["bwd_ms"]
        ref = ms.get("sdpa_cudnn")
        ours = [t for x, t in ms.items() if x.startswith("wgmma")]
        best = f"{min(ours) / ref:.2f}" if ref and ours else "-"
        mma = f"{ms['mma.sync bwd'] / ref:.2f}" if ref and "mma.sync bwd" in ms else "-"
        wb = [t for x, t in bwd.items() if x.startswith("wgmma")]
        bb = (f"{min(wb) / bwd['mma.sync bwd']:.2f}" if wb and "mma.sync bwd" in bwd
              else "-")
        lines.append(f"{r['case']:<26}"
                     + "".join(f"{tf[x]:>{w[x]}.0f}" if x in tf else f"{'-':>{w[x]}}"
                               for x in labels)
                     + f"{best:>12}{mma:>11}{bb:>14}" + ("" if r["check"] else "  CHECK FAILED"))
    return "\n".join(lines)


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N=4096 only")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--table-only", action="store_true",
                    help="the table's pair only, not every candidate pair")
    ap.add_argument("--fused", action="store_true",
                    help="also the non-deterministic mode (dQ by atomics)")
    ap.add_argument("--only", default=None,
                    help="comma-separated tiling tags: the table's pair and the candidate "
                         "pairs with one of them (default: every candidate pair)")
    ap.add_argument("--span", action="store_true",
                    help="time --repeat calls back to back between one pair of events")
    ap.add_argument("--json", default=os.environ.get("HOPPER_BWD_JSON"))
    ap.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)),
                    help="comma-separated head dims (default: %(default)s)")
    args = ap.parse_args(argv)
    head_dims = tuple(int(x) for x in args.head_dims.split(","))
    only = set(args.only.split(",")) if args.only else None
    hopper_forward.SPAN = args.span
    torch, flashcore, launch = environment()
    import torch.nn.functional as F
    from flashcore.backends.numba_cuda import tilings
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashcore._warmup import compile_variants

    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    for tag, s in compile_variants(variants(launch, tilings, args.table_only, args.fused,
                                            head_dims, only), 0):
        print(f"compiled {tag}: {s:.1f} s", flush=True)
    saved = (dict(tilings.HOPPER_DKDV), dict(tilings.HOPPER_DQ))

    ran = []
    real = {n: getattr(launch, n) for n in ("launch_dkdv", "launch_dq")}

    def spying(fn):
        def spy(kern, *a, **kw):
            ran.append(kern.name)
            return fn(kern, *a, **kw)
        return spy

    for n, fn in real.items():
        setattr(launch, n, spying(fn))
    os.environ.pop("FLASHCORE_HOPPER", None)  # (the wgmma forward makes o and lse)

    def backward(do, q, k, v, o, lse, causal, hopper):
        os.environ[HOPPER_BWD_ENV] = "1" if hopper else "0"
        return flashcore.attention_backward(do, q, k, v, o, lse, causal=causal,
                                            backend="numba_cuda")

    def nondeterministic(fn):
        """``fn`` run in the non-deterministic mode."""
        def run_it():
            os.environ[DETERMINISTIC_ENV] = "0"
            try:
                return fn()
            finally:
                os.environ.pop(DETERMINISTIC_ENV, None)
        return run_it

    def both(q, k, v, do, causal, hopper):
        o, lse = flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cuda")
        return backward(do, q, k, v, o, lse, causal, hopper)

    def sdpa(backend, q, k, v, do, causal):
        q.grad = k.grad = v.grad = None  # (no accumulation into earlier gradients)
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.backward(do)

    def rel(a, b):
        return float(torch.linalg.vector_norm((a.float() - b.float()).ravel())
                     / torch.linalg.vector_norm(b.float().ravel()))

    rows, failed = [], False
    cases = CASES[:1] if args.quick else CASES
    for B, H, N in cases:
        for D in head_dims:
            for causal in (False, True):
                pairs = candidate_pairs(tilings, D, causal, args.table_only, only)
                name = f"B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}"
                g = torch.Generator(device="cuda").manual_seed(N + D + causal)
                q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g,
                                           dtype=torch.bfloat16) for _ in range(4))
                ms, bwd_ms, checks, ok = {}, {}, [], True
                try:
                    o, lse = flashcore.attention_forward(q, k, v, causal=causal,
                                                         backend="numba_cuda")
                    ran.clear()
                    ref = backward(do, q, k, v, o, lse, causal, False)
                    for pair in pairs:
                        use_pair(launch, tilings, D, causal, pair)
                        got = backward(do, q, k, v, o, lse, causal, True)
                        again = backward(do, q, k, v, o, lse, causal, True)
                        torch.cuda.synchronize()
                        errs = [rel(a, b) for a, b in zip(got, ref)]
                        same = all(torch.equal(a, b) for a, b in zip(got, again))
                        fin = all(bool((torch.isfinite(a) == torch.isfinite(b)).all())
                                  for a, b in zip(got, ref))
                        good = max(errs) < TOL and same and fin
                        checks.append((label(pair), good, errs, same))
                        ok &= good
                    kinds = tuple(ran)
                    ok &= kinds == (("attn_backward_dkdv_tc", "attn_backward_dq_tc")
                                    + ("attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma")
                                    * (2 * len(pairs)))
                    fused = args.fused and D <= 128  # (no dkdvq kernel at D=256)
                    fused_ok = {}
                    for fl, ft in (fused_tilings(tilings, D) if fused else ()):
                        use_pair(launch, tilings, D, causal, pairs[0])
                        use_dkdvq(launch, tilings, D, causal, ft)  # dQ by atomics
                        got = nondeterministic(
                            lambda: backward(do, q, k, v, o, lse, causal, True))()
                        torch.cuda.synchronize()
                        errs = [rel(a, b) for a, b in zip(got, ref)]
                        fin = all(bool(torch.isfinite(a).all() == torch.isfinite(b).all())
                                  for a, b in zip(got, ref))
                        good = max(errs) < TOL and fin
                        checks.append((fl, good, errs, True))
                        fused_ok[fl] = good
                        ok &= good
                    use_dkdvq(launch, tilings, D, causal, None)
                except Exception as e:  # noqa: BLE001  (a fault ends the CUDA context)
                    print(f"check {name}: ERROR {type(e).__name__}: {e}", flush=True)
                    rows.append({"case": name, "check": False, "ms": {}, "bwd_ms": {},
                                 "tflops": {}})
                    print(table(rows))
                    return 1
                failed |= not ok
                print(f"check {name}: {'pass' if ok else 'FAIL'} ("
                      + "; ".join(f"{lb} {'ok' if g_ else 'WRONG'}: dq/dk/dv rel "
                                  + "/".join(f"{x:.1e}" for x in e_)
                                  + ("" if s_ else ", NOT deterministic")
                                  for lb, g_, e_, s_ in checks) + ")", flush=True)
                for pair, (lb, good, _, _) in zip(pairs, checks):
                    if good:
                        use_pair(launch, tilings, D, causal, pair)
                        ms[lb] = timer(torch, lambda: both(q, k, v, do, causal, True),
                                       args.repeat)
                        bwd_ms[lb] = timer(
                            torch, lambda: backward(do, q, k, v, o, lse, causal, True),
                            args.repeat)
                for fl, ft in fused_tilings(tilings, D) if args.fused and D <= 128 else ():
                    if not fused_ok.get(fl):
                        continue
                    use_pair(launch, tilings, D, causal, pairs[0])
                    use_dkdvq(launch, tilings, D, causal, ft)
                    ms[fl] = timer(torch, nondeterministic(
                        lambda: both(q, k, v, do, causal, True)), args.repeat)
                    bwd_ms[fl] = timer(torch, nondeterministic(
                        lambda: backward(do, q, k, v, o, lse, causal, True)), args.repeat)
                use_dkdvq(launch, tilings, D, causal, None)
                ms["mma.sync bwd"] = timer(torch, lambda: both(q, k, v, do, causal, False),
                                           args.repeat)
                bwd_ms["mma.sync bwd"] = timer(
                    torch, lambda: backward(do, q, k, v, o, lse, causal, False), args.repeat)
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                for lb, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                               ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        ms[lb] = timer(torch, lambda be=be: sdpa(be, qg, kg, vg, do, causal),
                                       args.repeat)
                    except RuntimeError as e:  # (a backend that declines the case)
                        print(f"  {lb}: {str(e).splitlines()[0][:100]}")
                flops = 3.5 * 4 * B * H * N * N * D / (2 if causal else 1)
                rows.append({"case": name, "check": ok, "checks": checks, "ms": ms,
                             "bwd_ms": bwd_ms,
                             "tflops": {k_: flops / t / 1e9 for k_, t in ms.items()}})
                print("  ms fwd+bwd: " + ", ".join(f"{x} {t:.3f}" for x, t in ms.items())
                      + "; bwd: " + ", ".join(f"{x} {t:.3f}" for x, t in bwd_ms.items()),
                      flush=True)
    os.environ.pop(HOPPER_BWD_ENV, None)
    for n, fn in real.items():
        setattr(launch, n, fn)
    tilings.HOPPER_DKDV.update(saved[0])
    tilings.HOPPER_DQ.update(saved[1])

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
