"""Where a back-to-back loop's time goes beyond its kernels (issue 15: the causal varlen
forward+backward reads 1.11-1.15x the padded call's share timed back to back, 1.08 summed
over its kernels).

For the varlen batch of ``tools/packed_gpu.py`` (16 sequences of random lengths
128..4096, H=16, D=128, bf16), the same sequences padded, and a dense B=4 H=16 N=4096
D=128 call beside SDPA's cuDNN backend on it, causal and not, forward and backward by
torch autograd: ``LOOP`` calls back to back under torch.profiler (CPU and CUDA
activities), then, per loop:

- its span (first kernel's start to last kernel's end) against the kernels' busy time, and
  the idle gaps between kernels, the largest with the kernels around them, how late the
  host launched the kernel after the gap (launch call's end minus the previous kernel's
  end: positive is a GPU waiting on the host), and the CUDA runtime/driver calls the host
  made between (a synchronization, a blocking copy, an allocation);
- per kernel, its mean time in the loop against one call timed alone after an idle pause
  (slower in the loop: the clocks dropped under sustained load, not the host);
- the SM clock and power the driver reported while the loop ran (nvidia-smi sampling).

Usage (on a GPU host, from the repository root): python tools/gap_trace.py
Env: GAP_LOOP (default 5), GAP_JSON (write the numbers as JSON there).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import torch
from packed_gpu import fwd_bwd_calls, varlen_batch

import flashcore

LOOP = int(os.environ.get("GAP_LOOP", "5"))
SYNCING = ("Synchronize", "Memcpy", "Malloc", "Free", "MemAlloc", "MemFree", "memcpy",
           "HtoD", "DtoH")


def inputs(causal):
    H, D = 16, 128
    dt = torch.bfloat16
    lens, cu, share = varlen_batch()
    nseq, total, longest = len(lens), sum(lens), max(lens)
    q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=dt) for _ in range(4))
    qp, kp, vp, dop = (torch.randn(nseq, longest, H, D, device="cuda", dtype=dt)
                       for _ in range(4))
    varlen, padded = fwd_bwd_calls((q, k, v, do), (qp, kp, vp, dop), cu, longest, causal)
    B, N = 4, 4096
    qd, kd, vd, dod = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(4))
    for x in (qd, kd, vd):
        x.requires_grad_()

    def dense():
        o = flashcore.attention(qd, kd, vd, causal=causal)
        torch.autograd.grad(o, (qd, kd, vd), dod)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
        torch.autograd.grad(o, (qd, kd, vd), dod)

    return {"varlen": varlen, "padded": padded, "dense": dense, "cudnn": cudnn}, share


class Clocks:
    """nvidia-smi sampling of the SM clock (MHz) and power (W) every 20 ms, as a context."""

    def __enter__(self):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,"
                 "nounits", "-lms", "20"], stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.file.seek(0)
            for line in self.file:
                try:
                    mhz, watts = (float(t) for t in line.split(","))
                except ValueError:
                    continue
                self.samples.append((mhz, watts))
        self.file.close()

    def summary(self):
        if not self.samples:
            return "no samples"
        mhz = sorted(s[0] for s in self.samples)
        w = sorted(s[1] for s in self.samples)
        return (f"SM clock min/median/max {mhz[0]:.0f}/{mhz[len(mhz) // 2]:.0f}/{mhz[-1]:.0f} "
                f"MHz, power median/max {w[len(w) // 2]:.0f}/{w[-1]:.0f} W "
                f"({len(mhz)} samples)")


def trace(fn, n):
    """The chrome-trace events of ``n`` calls of ``fn`` back to back (after a sync)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            return json.load(g)["traceEvents"]


def analyse(events):
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset",
                                                           "gpu_memcpy")),
                     key=lambda e: e["ts"])
    api = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")),
                 key=lambda e: e["ts"])
    launch_of = {e["args"].get("correlation"): e for e in api if "args" in e}
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, end, gaps = 0.0, kernels[0]["ts"], []
    for a, b in zip([None] + kernels[:-1], kernels):
        s, e = b["ts"], b["ts"] + b["dur"]
        if a is not None and s > end:
            launch = launch_of.get(b["args"].get("correlation"))
            late = None if launch is None else launch["ts"] + launch["dur"] - end
            between = [x["name"] for x in api if end <= x["ts"] <= s and
                       any(t in x["name"] for t in SYNCING)]
            gaps.append((s - end, a["name"], b["name"], late, between))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    per_kernel = {}
    for k in kernels:
        per_kernel.setdefault(k["name"], []).append(k["dur"])
    syncs = {}
    for x in api:
        if any(t in x["name"] for t in SYNCING):
            syncs.setdefault(x["name"], [0, 0.0])
            syncs[x["name"]][0] += 1
            syncs[x["name"]][1] += x["dur"]
    return {"span_us": span, "busy_us": busy, "gaps": sorted(gaps, key=lambda g: -g[0]),
            "kernels": {k: (len(v), sum(v) / len(v)) for k, v in per_kernel.items()},
            "syncs": syncs, "n_gaps": len(gaps), "gap_us": sum(g[0] for g in gaps)}


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "loop", LOOP)
    out = {}
    for causal in (False, True):
        fns, share = inputs(causal)
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            time.sleep(0.5)
            alone = analyse(trace(fn, 1))
            for _ in range(2):
                fn()
            with Clocks() as clocks:
                loop = analyse(trace(fn, LOOP))
            key = f"{name} causal={causal}"
            out[key] = {"alone": alone, "loop": loop, "share": share,
                        "clocks": clocks.samples}
            print(f"\n== {key}: loop of {LOOP}: span {loop['span_us'] / LOOP / 1e3:.3f} ms "
                  f"a call, kernels busy {loop['busy_us'] / LOOP / 1e3:.3f} ms, idle "
                  f"{loop['gap_us'] / LOOP / 1e3:.3f} ms in {loop['n_gaps']} gaps; alone: "
                  f"span {alone['span_us'] / 1e3:.3f} busy {alone['busy_us'] / 1e3:.3f} ms")
            print("   " + clocks.summary())
            for gap, a, b, late, between in loop["gaps"][:6]:
                print(f"   gap {gap:8.1f} us  {a[:40]} -> {b[:40]}  launch late "
                      f"{'?' if late is None else f'{late:.1f}'} us  {between[:4]}")
            for k, (n, mean) in sorted(loop["kernels"].items(), key=lambda t: -t[1][1])[:6]:
                a = alone["kernels"].get(k)
                ratio = f"{mean / a[1]:.3f}" if a else "-"
                print(f"   {k[:60]:60s} x{n:3d} mean {mean:9.1f} us, alone "
                      f"{a[1] if a else float('nan'):9.1f} us, loop/alone {ratio}")
            if loop["syncs"]:
                print("   host calls that may wait: " + "; ".join(
                    f"{k} x{n} {t:.0f} us" for k, (n, t) in loop["syncs"].items()))
    print("\nsummary (ms a call): name, loop span, loop busy, alone busy, span/alone busy")
    for key, r in out.items():
        lp, al = r["loop"], r["alone"]
        print(f"  {key:22s} {lp['span_us'] / LOOP / 1e3:7.3f} {lp['busy_us'] / LOOP / 1e3:7.3f} "
              f"{al['busy_us'] / 1e3:7.3f} {lp['span_us'] / LOOP / al['busy_us']:6.3f}")
    for causal in (False, True):
        v, p = out[f"varlen causal={causal}"], out[f"padded causal={causal}"]
        ratio = (lambda a, b: a / (b * p["share"]))
        print(f"  causal={causal}: varlen / padded share: loop span "
              f"{ratio(v['loop']['span_us'], p['loop']['span_us']):.3f}, loop busy "
              f"{ratio(v['loop']['busy_us'], p['loop']['busy_us']):.3f}, alone busy "
              f"{ratio(v['alone']['busy_us'], p['alone']['busy_us']):.3f}")
    if os.environ.get("GAP_JSON"):
        with open(os.environ["GAP_JSON"], "w") as f:
            json.dump({k: {"loop": {x: r["loop"][x] for x in ("span_us", "busy_us", "gap_us",
                                                               "kernels", "syncs")},
                           "alone": {x: r["alone"][x] for x in ("span_us", "busy_us",
                                                                 "kernels")},
                           "clocks": r["clocks"], "share": r["share"]}
                       for k, r in out.items()}, f)


if __name__ == "__main__":
    main()
