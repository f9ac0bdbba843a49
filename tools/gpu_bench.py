"""Benchmark of the numba_cuda backend against torch SDPA, side by side in one process.

B=4, H=16, N=4096, D=64 and 128, causal and not: forward and forward+backward, float32
against SDPA's memory-efficient kernel and bf16 against SDPA flash and cuDNN; peak extra
memory of a bf16 forward at N=16384 against SDPA flash; host overhead of a forward call on
a tiny input; and a few forward tilings of the float32 kernel. Times are medians of CUDA
event timings after warm-up. Writes JSON to $OUT (or the current folder) and prints a table.

Usage: python tools/gpu_bench.py [--quick] [--no-sweep]
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from flashcore.backends import numba_cuda
from flashcore.backends.numba_cuda import launch, tiles
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from flashcore._checks import make_case

OUT = os.environ.get("OUT", ".")
QUICK = "--quick" in sys.argv
SWEEP = "--no-sweep" not in sys.argv
DEV = "cuda"


def bench(fn, warmup=3, reps=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def inputs(B, H, N, D, dtype, grad=False):
    g = torch.Generator(device=DEV).manual_seed(0)
    xs = [torch.randn(B, H, N, D, device=DEV, dtype=torch.float32, generator=g).to(dtype)
          for _ in range(4)]
    if grad:
        for x in xs[:3]:
            x.requires_grad_(True)
    return xs


def ours(q, k, v, do, causal, backward):
    def fwd():
        return flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cuda")

    def fwdbwd():
        o, lse = fwd()
        return flashcore.attention_backward(do, q, k, v, o, lse, causal=causal,
                                            backend="numba_cuda")
    return fwdbwd if backward else fwd


def sdpa(q, k, v, do, causal, backward, backend):
    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwdbwd():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(do)
    return fwdbwd if backward else fwd


def flops(B, H, N, D, causal, backward):
    f = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)  # backward: 5 matmuls (2.5x fwd)


def main():
    rows = []
    results = {"device": torch.cuda.get_device_name(), "rows": rows}
    B, H, N = 4, 16, 4096
    if QUICK:
        B, N = 1, 1024

    # --- compile (or disk-cache load) time of the first kernel --------------------------
    t0 = time.perf_counter()
    q, k, v, do = inputs(1, 1, 128, 64, torch.float32)
    flashcore.attention_forward(q, k, v, backend="numba_cuda")
    torch.cuda.synchronize()
    results["first_call_s"] = time.perf_counter() - t0

    for D in (64, 128):
        for causal in (False, True):
            for backward in (False, True):
                row = {"D": D, "causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
                q, k, v, do = inputs(B, H, N, D, torch.float32)
                row["ours_f32"] = bench(ours(q, k, v, do, causal, backward))
                qg, kg, vg, dog = inputs(B, H, N, D, torch.float32, grad=True)
                row["sdpa_eff_f32"] = bench(sdpa(qg, kg, vg, dog, causal, backward,
                                                 SDPBackend.EFFICIENT_ATTENTION))
                del q, k, v, do, qg, kg, vg, dog
                q, k, v, do = inputs(B, H, N, D, torch.bfloat16)
                row["ours_bf16"] = bench(ours(q, k, v, do, causal, backward))
                qg, kg, vg, dog = inputs(B, H, N, D, torch.bfloat16, grad=True)
                row["sdpa_flash_bf16"] = bench(sdpa(qg, kg, vg, dog, causal, backward,
                                                    SDPBackend.FLASH_ATTENTION))
                try:
                    row["sdpa_cudnn_bf16"] = bench(sdpa(qg, kg, vg, dog, causal, backward,
                                                        SDPBackend.CUDNN_ATTENTION))
                except RuntimeError as e:
                    row["sdpa_cudnn_bf16"] = float("nan")
                    print("cudnn:", e)
                del q, k, v, do, qg, kg, vg, dog
                fl = flops(B, H, N, D, causal, backward)
                row["ours_f32_tflops"] = fl / row["ours_f32"] / 1e9
                row["ratio_f32_vs_eff"] = row["ours_f32"] / row["sdpa_eff_f32"]
                row["ratio_bf16_vs_flash"] = row["ours_bf16"] / row["sdpa_flash_bf16"]
                row["ratio_bf16_vs_cudnn"] = row["ours_bf16"] / row["sdpa_cudnn_bf16"]
                rows.append(row)
                print(json.dumps(row), flush=True)

    # --- forward tilings of the float32 kernel --------------------------------------------
    variants = {
        "64x64/8x16": tiles.Tiles(64, 64, 8, 16),
        "64x64/16x16": tiles.Tiles(64, 64, 16, 16),
        "128x64/16x16": tiles.Tiles(128, 64, 16, 16),
        "64x128/8x16": tiles.Tiles(64, 128, 8, 16),
        "128x128/16x16": tiles.Tiles(128, 128, 16, 16),
        "32x64/4x16": tiles.Tiles(32, 64, 4, 16),
    }
    tv = results["tilings"] = {}
    for D in (64, 128) if SWEEP else ():
        q, k, v, do = inputs(B, H, N, D, torch.float32)
        case = make_case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True)
        for name, t in variants.items():
            if tiles.forward_smem_words(t, D) * 4 > 227 * 1024:
                continue
            base = tiles.choose(D, "float32", False, (9, 0))
            kt = tiles.KernelTiles(forward=t, dkdv=base.dkdv, dq=base.dq)
            o = torch.empty_like(q)
            lse_buf = torch.empty(B, H, N, device=DEV)
            views = [(x.data_ptr(), x.stride()) for x in (q, k, v, o)]
            stream = torch.cuda.current_stream().cuda_stream

            def run():  # (called at once, inside this iteration)
                launch.run_forward(case, 0, stream, *views, lse_buf.data_ptr(), tiles=kt)
            try:
                ms = bench(run)
            except Exception as e:  # noqa: BLE001  (a tiling that does not fit or launch)
                print(f"tiling {name} D={D}: {type(e).__name__}: {e}")
                continue
            tv[f"D{D} {name}"] = ms
            print(f"tiling D={D} {name}: {ms:.3f} ms "
                  f"({flops(B, H, N, D, False, False) / ms / 1e9:.1f} TFLOP/s)", flush=True)
        del q, k, v, do

    # --- backward tilings (one pass's tiling changed at a time, whole backward timed) ----
    bvariants = {
        "64x64/16x16": tiles.Tiles(64, 64, 16, 16),
        "64x32/16x16": tiles.Tiles(64, 32, 16, 16),
        "128x64/16x16": tiles.Tiles(128, 64, 16, 16),
        "128x32/16x16": tiles.Tiles(128, 32, 16, 16),
        "32x64/8x16": tiles.Tiles(32, 64, 8, 16),
    }
    for D in (64, 128) if SWEEP else ():
        q, k, v, do = inputs(B, H, N, D, torch.float32)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda")
        case = make_case(q, k, v, causal=False, scale=None, layout="bhnd",
                         direction="backward", extra={"do": do, "o": o, "lse": lse})
        base = tiles.choose(D, "float32", False, (9, 0))
        delta = torch.empty(B, H, N, device=DEV)
        grads = [torch.empty_like(q) for _ in range(3)]
        views = [(x.data_ptr(), x.stride()) for x in (do, q, k, v, o)]
        lse_v = (lse.data_ptr(), lse.stride())
        gviews = [(x.data_ptr(), x.stride()) for x in grads]
        stream = torch.cuda.current_stream().cuda_stream
        for which in ("dkdv", "dq"):
            for name, t in bvariants.items():
                words = (tiles.dkdv_smem_words if which == "dkdv" else tiles.dq_smem_words)(t, D)
                if words * 4 > 227 * 1024:
                    continue
                kt = tiles.KernelTiles(forward=base.forward, dkdv=t if which == "dkdv" else
                                       base.dkdv, dq=t if which == "dq" else base.dq)

                def run():
                    launch.run_backward(case, 0, stream, *views, lse_v, delta.data_ptr(),
                                        *gviews, tiles=kt)
                try:
                    ms = bench(run)
                except Exception as e:  # noqa: BLE001  (a tiling that does not fit)
                    print(f"tiling {which} {name} D={D}: {type(e).__name__}: {e}")
                    continue
                tv[f"bwd D{D} {which} {name}"] = ms
                print(f"tiling bwd D={D} {which}={name}: {ms:.3f} ms", flush=True)
        del q, k, v, do, o, lse, grads

    # --- peak extra memory at N=16384, bf16 forward -----------------------------------------
    mem = results["peak_extra_mib_N16384"] = {}
    q, k, v, do = inputs(1, 16, 16384, 128, torch.bfloat16)
    for name, fn in [("ours", lambda: flashcore.attention_forward(q, k, v, backend="numba_cuda")),
                     ("sdpa_flash", sdpa(q, k, v, do, False, False,
                                         SDPBackend.FLASH_ATTENTION))]:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        mem[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del out
    mem["ratio"] = mem["ours"] / mem["sdpa_flash"]
    del q, k, v, do

    # --- host overhead on a tiny input --------------------------------------------------------
    q, k, v, _ = inputs(1, 1, 16, 64, torch.float16)
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True)
    host = results["host_us"] = {}
    for name, fn in [
        ("backend_forward", lambda: numba_cuda.forward(q, k, v, case)),
        ("attention_forward", lambda: flashcore.attention_forward(q, k, v,
                                                                  backend="numba_cuda")),
        ("attention_auto", lambda: flashcore.attention(q, k, v)),
        ("torch_sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
    ]:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(5):
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        host[name] = best

    with open(os.path.join(OUT, "bench.json"), "w") as f:
        json.dump(results, f, indent=1)

    # --- table last -------------------------------------------------------------------------
    print(f"\n{results['device']}; first call (compile or cache load): "
          f"{results['first_call_s']:.2f} s; B={B} H={H} N={N}; ms (median)")
    print(f"{'D':>4} {'causal':>6} {'pass':>8} | {'ours f32':>9} {'eff f32':>8} {'ratio':>6}"
          f" {'TF/s':>5} | {'ours bf16':>9} {'flash':>7} {'cudnn':>7} {'/flash':>6}")
    for r in rows:
        print(f"{r['D']:>4} {r['causal']!s:>6} {r['pass']:>8} | {r['ours_f32']:9.3f} "
              f"{r['sdpa_eff_f32']:8.3f} {r['ratio_f32_vs_eff']:6.2f} "
              f"{r['ours_f32_tflops']:5.1f} | {r['ours_bf16']:9.3f} "
              f"{r['sdpa_flash_bf16']:7.3f} {r['sdpa_cudnn_bf16']:7.3f} "
              f"{r['ratio_bf16_vs_flash']:6.2f}")
    print("peak extra MiB at N=16384 (bf16 fwd, B=1 H=16 D=128): "
          + ", ".join(f"{k} {v:.1f}" for k, v in mem.items()))
    print("host us per call (tiny input): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))


if __name__ == "__main__":
    main()
