"""Issue 15's GPU measurements, side by side in one process (torch CUDA tensors):

1. decode: B=8, Hq=32, Hkv=8, D=128, bf16, one query row, caches of 4k, 32k and 128k keys,
   contiguous and paged (256-key pages, shuffled through the pool): flashcore with split-KV
   (the heuristic) and without (num_splits=1), with ``cache_seqlens`` on the GPU and on the
   host (NumPy), one call at a time and in a decode loop of 32 steps appending a key each
   (lengths changed every step: on the GPU each step's checks read them back, on the host
   nothing waits for the GPU), and SDPA with Nq=1 on a contiguous
   ``(B, Hkv, L, D)`` cache (its own best layout; ``enable_gqa``). Reported: time and
   achieved bandwidth = bytes of K and V read / time, next to the device's copy bandwidth
   (a device-to-device copy of 2 GiB: bytes read + written / time).
2. varlen: 16 sequences of random lengths 128..4096 (bf16, H=16, D=128, causal and not):
   ``attention_varlen`` forward and forward+backward against ``attention`` on the same
   sequences padded to the longest, scaled by the work the padding does not add
   (``sum L^2 / (B max L^2)``, halved alike under causal), and per-sequence SDPA calls.

Times: median of CUDA-event timings after a warm-up. Prints one table per part and
writes JSON to $PACKED_JSON when set.
"""
from __future__ import annotations

import json
import os
import statistics

import numpy as np
import torch
from flashcore.backends import numba_cuda

import flashcore
from flashcore._api import _plan
from flashcore._mods import options as _options
from flashcore._packed_checks import make_kvcache_case, make_varlen_case

#: PACKED_TILES=<tag>: the varlen forward (backend alone) timed on that wgmma tiling too
#: (tilings.VARLEN_PERSISTENT's set aside);
#: PACKED_SKIP_DECODE=1: the varlen part only; PACKED_SKIP_VARLEN=1: the decode part only;
#: PACKED_PROFILE=1: each kernel's time in one varlen and one padded forward+backward
#: (torch.profiler), printed per causal mode, and in one decode call per cache length.
TILES = os.environ.get("PACKED_TILES", "")
PROFILE = os.environ.get("PACKED_PROFILE", "") == "1"
#: PACKED_TURNS=1: the back-to-back samples of the varlen and the padded call taken in
#: turns (A B, B A, ...; :func:`timed_pair`). On an H200 (2026-11-28, two runs) that read
#: the varlen forward 1.17-1.19x the padded call's share where one call's samples, then
#: the other's, read 1.10-1.11 (earlier runs; why is not found: a switch between the two
#: calls may cost host work that repeated calls hide). Off by default, so the ratios
#: compare with earlier runs.
TURNS = os.environ.get("PACKED_TURNS", "") == "1"
#: Calls a sample of the steady-state rows (PACKED_STEADY, default 40).
STEADY = int(os.environ.get("PACKED_STEADY", "40"))


def kernel_times(fn, label):
    """Print each GPU kernel's time (ms, summed over its launches) in one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    print(f"  kernels of {label}: " + "; ".join(f"{k[:48]} {t:.3f}ms x{n}"
                                                for k, t, n in rows[:6]))


def timed_pair(fa, fb, reps=10, inner=10):
    """``timed`` of two functions back to back (``inner`` calls a sample), their samples
    taken in turns (A B, B A, ...) so that a drift of the GPU's clocks over the run falls
    on both: (median seconds per call of ``fa``, of ``fb``)."""
    for fn in (fa, fb):
        timed(fn, reps=1, warm=2, inner=1)
    out = ([], [])
    for r in range(reps):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            out[which].append(timed((fa, fb)[which], reps=1, warm=0, inner=inner))
    return statistics.median(out[0]), statistics.median(out[1])


def timed(fn, reps=20, warm=3, inner=1):
    """Median seconds per call. ``inner`` 1: one call between the events, the GPU idle
    while the host prepares it (its host time counted); more: that many calls back to
    back per sample, the host preparing the next while the GPU runs one (as in a model's
    step), the time divided by ``inner``."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(out)


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() * 2 / t


#: Steps of the decode loops: each appends one key per sequence and attends.
LOOP_STEPS = 32


def decode_loop(q, kc, vc, L, on_host):
    """Seconds per step of a decode loop of LOOP_STEPS steps timed as a whole (no wait
    between steps): each appends one key per sequence and attends, the lengths going
    L - LOOP_STEPS .. L - 1. ``on_host``: the lengths are a NumPy array (``+= 1``), else a
    CUDA tensor changed in place on the GPU (``+= 1``), which the checks read back each
    step (a synchronization), as a loop written for FlashAttention 2 does."""
    B, Hkv, D = q.shape[0], kc.shape[2], q.shape[3]
    kn, vn = (torch.randn(B, 1, Hkv, D, device="cuda", dtype=q.dtype) for _ in range(2))

    def run():
        lens = (np.full(B, L - LOOP_STEPS, np.int32) if on_host else
                torch.full((B,), L - LOOP_STEPS, dtype=torch.int32, device="cuda"))
        for _ in range(LOOP_STEPS):
            flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn)
            lens += 1

    return timed(run, reps=5, warm=1) / LOOP_STEPS


def decode(rows):
    B, Hq, Hkv, D, page = 8, 32, 8, 128, 256
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt, generator=g)
    for L in (4096, 32768, 131072):
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * B * L * Hkv * D * 2
        kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt, generator=g)
        vc = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt, generator=g)
        res = {"L": L}
        for splits in (0, 1):
            res[f"contig_s{splits}"] = timed(lambda: flashcore.attention_with_kvcache(
                q, kc, vc, cache_seqlens=seqlens, num_splits=splits))
        # the backend alone on a case made once: no host checks (which read the lengths
        # back from the GPU, a synchronization per call)
        case = make_kvcache_case(q, kc, vc, seqlens, causal=False, scale=None, num_splits=0,
                                 options=_options(None, None, None, None, None, (), None))
        res["backend_only"] = timed(lambda: numba_cuda.forward(q, kc, vc, case))
        host = seqlens.cpu().numpy()  # the same lengths given on the host: no read-back
        res["contig_host"] = timed(lambda: flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=host))
        res["contig_host_b2b"] = timed(lambda: flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=host), inner=10)
        if PROFILE:
            kernel_times(lambda: flashcore.attention_with_kvcache(q, kc, vc,
                                                                  cache_seqlens=host),
                         f"decode L={L}")
        res["loop_device"], res["loop_host"] = (decode_loop(q, kc, vc, L, on_host)
                                                for on_host in (False, True))
        os.environ["FLASHCORE_DECODE_TILES"] = "0"  # the forward table's 128-row tiling
        res["table_tiles"] = timed(lambda: flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens))
        del os.environ["FLASHCORE_DECODE_TILES"]
        res["sweep"] = {s: timed(lambda: flashcore.attention_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, num_splits=s)) for s in (4, 8, 16, 32, 64)}
        # the same keys in shuffled pages
        n_pages = B * L // page
        perm = torch.randperm(n_pages, device="cuda", generator=g)
        table = perm.reshape(B, L // page).to(torch.int32)
        kp = torch.empty(n_pages, page, Hkv, D, device="cuda", dtype=dt)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(n_pages, page, Hkv, D)
        vp[perm] = vc.reshape(n_pages, page, Hkv, D)
        o_c = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        o_p = flashcore.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens,
                                               block_table=table)
        res["paged_equal"] = float((o_c.float() - o_p.float()).abs().max())
        for splits in (0, 1):
            res[f"paged_s{splits}"] = timed(lambda: flashcore.attention_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=splits))
        kp = vp = None  # (freed before the next copies)
        ks, vs = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        kc = vc = None
        qs = q.transpose(1, 2)
        res["sdpa"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, enable_gqa=True))
        ks = vs = None
        torch.cuda.empty_cache()
        res["bytes"] = kv_bytes
        rows.append(res)


def varlen_batch():
    """The varlen batch: ``(lens, cu_seqlens on the GPU, share)``, 16 lengths 128..4096
    (seed 1) and the share of the padded call's work that is real (``sum L^2 / (B max
    L^2)``)."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(128, 4097, (16,), generator=g).tolist()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    return lens, cu, sum(n * n for n in lens) / (len(lens) * max(lens) ** 2)


def fwd_bwd_calls(packed, padded, cu, longest, causal):
    """``(varlen, padded)``: forward+backward (torch autograd) of the varlen call on
    ``packed`` = (q, k, v, do) with offsets ``cu`` and of the dense call on the same
    sequences ``padded`` (bnhd); q, k, v of both are made to require grad."""
    (q, k, v, do), (qp, kp, vp, dop) = packed, padded
    for x in (q, k, v, qp, kp, vp):
        x.requires_grad_()

    def varlen_fb():
        o = flashcore.attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest,
                                       max_seqlen_k=longest, causal=causal)
        torch.autograd.grad(o, (q, k, v), do)

    def padded_fb():
        o = flashcore.attention(qp, kp, vp, causal=causal, layout="bnhd")
        torch.autograd.grad(o, (qp, kp, vp), dop)

    return varlen_fb, padded_fb


def varlen(rows):
    H, D = 16, 128
    dt = torch.bfloat16
    lens, cu, share = varlen_batch()
    nseq, total, longest = len(lens), sum(lens), max(lens)
    for causal in (False, True):
        q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=dt) for _ in range(4))
        qp, kp, vp, dop = (torch.randn(nseq, longest, H, D, device="cuda", dtype=dt)
                           for _ in range(4))
        res = {"causal": causal, "tokens": total, "longest": longest, "share": share}
        res["varlen_fwd"] = timed(lambda: flashcore.attention_varlen(
            q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal))
        res["padded_fwd"] = timed(lambda: flashcore.attention(
            qp, kp, vp, causal=causal, layout="bnhd"))
        vcase = make_varlen_case(q, k, v, cu, cu, max_seqlen_q=longest,
                                 max_seqlen_k=longest, causal=causal, scale=None,
                                 need_lse=True)
        res["varlen_fwd_backend"] = timed(lambda: numba_cuda.forward(q, k, v, vcase))
        # the padded tokens as a varlen batch of equal lengths: the packed kernel's own cost
        # per tile, with no ragged tiles and no short sequences
        qu, ku, vu = (x.reshape(nseq * longest, H, D) for x in (qp, kp, vp))
        cu_u = torch.arange(nseq + 1, dtype=torch.int32, device="cuda") * longest
        res["uniform_fwd"] = timed(lambda: flashcore.attention_varlen(
            qu, ku, vu, cu_u, cu_u, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal))
        # the same equal lengths, the backends alone back to back (no host checks, host
        # work under the GPU's), varlen and dense in turns: the kernels' own difference
        ucase = make_varlen_case(qu, ku, vu, cu_u, cu_u, max_seqlen_q=longest,
                                 max_seqlen_k=longest, causal=causal, scale=None,
                                 need_lse=True)
        pcase, _ = _plan(qp, kp, vp, causal, None, "bnhd", True, "numba_cuda")
        ub, pb = [], []
        for _ in range(3):
            ub.append(timed(lambda: numba_cuda.forward(qu, ku, vu, ucase), reps=5, inner=10))
            pb.append(timed(lambda: numba_cuda.forward(qp, kp, vp, pcase), reps=5, inner=10))
        res["uniform_backend_b2b"], res["padded_backend_b2b"] = min(ub), min(pb)
        if TILES:  # the backend alone again, the wgmma forward on another tiling
            from flashcore.backends.numba_cuda import launch, tilings

            known = {t.tag: t for t in tilings.HOPPER_CANDIDATES}
            saved = tilings.HOPPER_FORWARD[D, causal]
            saved_vp = dict(tilings.VARLEN_PERSISTENT)  # (which would replace it)
            tilings.HOPPER_FORWARD[D, causal] = known[TILES]
            tilings.VARLEN_PERSISTENT.clear()
            launch.forget_plans()
            try:
                o_t, lse_t = numba_cuda.forward(q, k, v, vcase)
                res["varlen_fwd_tiles"] = timed(lambda: numba_cuda.forward(q, k, v, vcase))
                res["uniform_backend_tiles"] = timed(
                    lambda: numba_cuda.forward(qu, ku, vu, ucase), reps=5, inner=10)
            finally:
                tilings.HOPPER_FORWARD[D, causal] = saved
                tilings.VARLEN_PERSISTENT.update(saved_vp)
                launch.forget_plans()
            # checked against the default tiling's outputs (lse: finite rows)
            o_d, lse_d = numba_cuda.forward(q, k, v, vcase)
            fin = torch.isfinite(lse_d)
            res["tiles_err"] = [float((o_t.float() - o_d.float()).abs().max()),
                                float((lse_t[fin] - lse_d[fin]).abs().max()),
                                bool(torch.equal(fin, torch.isfinite(lse_t)))]
            res["varlen_fwd_backend2"] = timed(lambda: numba_cuda.forward(q, k, v, vcase))
        vl_fb, pad_fb = fwd_bwd_calls((q, k, v, do), (qp, kp, vp, dop), cu, longest, causal)
        res["varlen_fwdbwd"] = timed(vl_fb, reps=10)
        res["padded_fwdbwd"] = timed(pad_fb, reps=10)
        # (back to back: one call's samples, then the other's; PACKED_TURNS=1 in turns)
        both = timed_pair if TURNS else (lambda fa, fb, reps, inner: (
            timed(fa, reps=reps, inner=inner), timed(fb, reps=reps, inner=inner)))
        res["varlen_fwd_b2b"], res["padded_fwd_b2b"] = both(
            lambda: flashcore.attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest,
                                               max_seqlen_k=longest, causal=causal),
            lambda: flashcore.attention(qp, kp, vp, causal=causal, layout="bnhd"),
            reps=10, inner=10)
        res["varlen_fwdbwd_b2b"], res["padded_fwdbwd_b2b"] = both(
            vl_fb, pad_fb, reps=5, inner=5)
        # steady state: STEADY calls a sample, so the first call's idle GPU (the host
        # preparing its backward outlasts its forward kernel: tools/gap_trace.py) weighs
        # 1/STEADY; a training step's host runs that far ahead of its GPU
        res["varlen_fwd_steady"], res["padded_fwd_steady"] = (
            timed(f, reps=3, warm=1, inner=STEADY) for f in (
                lambda: flashcore.attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest,
                                                   max_seqlen_k=longest, causal=causal),
                lambda: flashcore.attention(qp, kp, vp, causal=causal, layout="bnhd")))
        res["varlen_fwdbwd_steady"], res["padded_fwdbwd_steady"] = (
            timed(f, reps=3, warm=1, inner=STEADY) for f in (vl_fb, pad_fb))
        offs = [0] + list(torch.tensor(lens).cumsum(0).tolist())

        def per_seq():
            for s in range(nseq):
                a, b = offs[s], offs[s + 1]
                torch.nn.functional.scaled_dot_product_attention(
                    q[None, a:b].transpose(1, 2), k[None, a:b].transpose(1, 2),
                    v[None, a:b].transpose(1, 2), is_causal=causal)

        res["sdpa_per_seq_fwd"] = timed(per_seq, reps=10)
        if PROFILE:
            kernel_times(vl_fb, f"varlen f+b, causal={causal}")
            kernel_times(pad_fb, f"padded f+b, causal={causal}")
        rows.append(res)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write of a 2 GiB device copy): {bw / 1e9:.0f} GB/s")
    out = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "decode": [], "varlen": []}
    if not os.environ.get("PACKED_SKIP_VARLEN"):
        varlen(out["varlen"])
    print("\nvarlen: 16 sequences 128..4096, H=16 D=128 bf16; padded x share = the padded "
          "call's time scaled to the real work")
    print(f"{'causal':>6} {'tokens':>7} {'share':>6} {'varlen fwd':>11} {'pad*share':>10} "
          f"{'ratio':>6} {'sdpa/seq':>9} {'varlen f+b':>11} {'pad*share':>10} {'ratio':>6}")
    for r in out["varlen"]:
        pf, pb = r["padded_fwd"] * r["share"], r["padded_fwdbwd"] * r["share"]
        print(f"{r['causal']!s:>6} {r['tokens']:>7} {r['share']:>6.3f} "
              f"{r['varlen_fwd'] * 1e3:>9.2f}ms {pf * 1e3:>8.2f}ms {r['varlen_fwd'] / pf:>6.2f} "
              f"{r['sdpa_per_seq_fwd'] * 1e3:>7.2f}ms {r['varlen_fwdbwd'] * 1e3:>9.2f}ms "
              f"{pb * 1e3:>8.2f}ms {r['varlen_fwdbwd'] / pb:>6.2f}")
        for what, suffix in (("calls back to back (host work under the GPU's)", "b2b"),
                             (f"steady state ({STEADY} calls back to back)", "steady")):
            cells = [(r[f"varlen_{p}_{suffix}"], r[f"padded_{p}_{suffix}"] * r["share"])
                     for p in ("fwd", "fwdbwd")]
            print(f"       {what}: " + "; ".join(
                f"{name} {a * 1e3:.2f}ms ÷ {b * 1e3:.2f}ms = {a / b:.3f}"
                for name, (a, b) in zip(("forward", "forward+backward"), cells)))
        print(f"       forward, the backend alone on a case made once (no host checks): "
              f"{r['varlen_fwd_backend'] * 1e3:.2f}ms, {r['varlen_fwd_backend'] / pf:.2f}x "
              "pad*share")
        print(f"       equal lengths ({r['longest']} x 16) as varlen: "
              f"{r['uniform_fwd'] * 1e3:.2f}ms, {r['uniform_fwd'] / r['padded_fwd']:.2f}x the "
              "padded call")
        print(f"       the same, the backends alone back to back (best of 3 turns): varlen "
              f"{r['uniform_backend_b2b'] * 1e3:.3f}ms, dense "
              f"{r['padded_backend_b2b'] * 1e3:.3f}ms = "
              f"{r['uniform_backend_b2b'] / r['padded_backend_b2b']:.3f}")
        if "varlen_fwd_tiles" in r:
            print(f"       the same on tiling {TILES}: {r['varlen_fwd_tiles'] * 1e3:.2f}ms, "
                  f"{r['varlen_fwd_tiles'] / pf:.2f}x pad*share (the default again after "
                  f"it: {r['varlen_fwd_backend2'] * 1e3:.2f}ms); against the default's "
                  f"outputs: o within {r['tiles_err'][0]:.2e}, lse {r['tiles_err'][1]:.2e}, "
                  f"same empty rows {r['tiles_err'][2]}; equal lengths, back to back: "
                  f"{r['uniform_backend_tiles'] * 1e3:.3f}ms")
    if not os.environ.get("PACKED_SKIP_DECODE"):
        decode_table(out, bw)
    if os.environ.get("PACKED_JSON"):
        with open(os.environ["PACKED_JSON"], "w") as f:
            json.dump(out, f, indent=1)


def decode_table(out, bw):
    """The decode measurements and their table."""
    decode(out["decode"])
    print("\ndecode: B=8 Hq=32 Hkv=8 D=128 bf16 Nq=1; GB/s = K and V bytes / time "
          f"(copy {bw / 1e9:.0f} GB/s)")
    print(f"{'L':>7} {'contig split':>13} {'contig 1':>10} {'paged split':>12} "
          f"{'paged 1':>9} {'sdpa':>9} {'best/copy':>9}")
    for r in out["decode"]:
        gb = lambda t: r["bytes"] / t / 1e9  # noqa: E731
        cells = [r["contig_s0"], r["contig_s1"], r["paged_s0"], r["paged_s1"], r["sdpa"]]
        print(f"{r['L']:>7} " + " ".join(f"{t * 1e3:6.3f}ms {gb(t):5.0f}" for t in cells)
              + f" {gb(min(r['contig_s0'], r['paged_s0'])) * 1e9 / bw:>8.2f}"
              + f"  (paged == contiguous: max diff {r['paged_equal']:.1e})")
        print(f"        contiguous, split, the backend alone (no host checks): "
              f"{r['backend_only'] * 1e3:.3f}ms {gb(r['backend_only']):.0f}")
        per_copy = lambda t: gb(t) * 1e9 / bw  # noqa: E731
        print("        contiguous, split, cache_seqlens on the host: "
              f"{r['contig_host'] * 1e3:.3f}ms {gb(r['contig_host']):.0f} "
              f"({per_copy(r['contig_host']):.2f} of copy; lengths on the GPU "
              f"{per_copy(r['contig_s0']):.2f}); back to back "
              f"{r['contig_host_b2b'] * 1e3:.3f}ms ({per_copy(r['contig_host_b2b']):.2f})")
        print(f"        decode loop, {LOOP_STEPS} steps appending a key, per step: lengths on "
              f"the GPU {r['loop_device'] * 1e3:.3f}ms {gb(r['loop_device']):.0f} "
              f"({per_copy(r['loop_device']):.2f}); on the host "
              f"{r['loop_host'] * 1e3:.3f}ms {gb(r['loop_host']):.0f} "
              f"({per_copy(r['loop_host']):.2f})")
        print(f"        contiguous, the 128-row tiling: {r['table_tiles'] * 1e3:.3f}ms "
              f"{gb(r['table_tiles']):.0f}")
        print("        contiguous, num_splits: " + "  ".join(
            f"{s}: {t * 1e3:.3f}ms {gb(t):.0f}" for s, t in r["sweep"].items()))


if __name__ == "__main__":
    main()
