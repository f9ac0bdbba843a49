"""Ring attention on GPUs over NCCL: correctness against one GPU, then the scaling table.

Run under torchrun (``tools/gpu_session.sh ring`` does, with NVLink multicast off):

    torchrun --nproc-per-node 2 tools/ring_gpu.py [--check-n 32768] [--seqlens 65536,...]

1. Correctness: bf16, B=1, H=8, D=128, causal, N = --check-n; the ring's o and gradients
   (gathered) against flashcore.attention on rank 0's GPU, norm-wise relative error.
2. Scaling: bf16, B=1, H=32, D=128, causal, balanced order, for each N: forward+backward
   time and peak memory per GPU of flashcore.attention on one GPU (rank 0) and of the
   ring on all ranks (median of --repeat runs after a warm-up), and the ring's per-step
   timeline on rank 0: kernel time and the time spent waiting for the next block (what
   the transfer did not hide).
Prints a table; writes JSON lines to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _sync():
    torch.cuda.synchronize()
    dist.barrier()


def _inputs(N, H, D, gen_seed=0):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    mk = lambda: torch.randn((1, H, N, D), generator=g, device="cuda",  # noqa: E731
                             dtype=torch.bfloat16)
    return mk(), mk(), mk(), mk()


def check(N, rank, world):
    import flashcore
    import flashcore.distributed as fcd

    q, k, v, do = _inputs(N, 8, 128)
    ql, kl, vl = (fcd.shard_sequence(x).detach().requires_grad_() for x in (q, k, v))
    o = fcd.ring_attention(ql, kl, vl, causal=True)
    o.backward(fcd.shard_sequence(do))
    got = [fcd.gather_sequence(x) for x in (o.detach(), ql.grad, kl.grad, vl.grad)]
    errs = None
    if rank == 0:
        qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ref = flashcore.attention(qr, kr, vr, causal=True)
        ref.backward(do)
        errs = {n: float((a.float() - b.float()).norm() / b.float().norm())
                for n, a, b in zip(("o", "dq", "dk", "dv"), got,
                                   (ref.detach(), qr.grad, kr.grad, vr.grad))}
    _sync()
    return errs


def _time(fn, repeat):
    fn()
    _sync()
    ts = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def scaling(N, rank, world, repeat):
    import flashcore.distributed as fcd

    H, D = 32, 128
    row = {"N": N, "world": world}
    if rank == 0:  # one GPU: the whole sequence
        row["t1"], row["mem1_GiB"] = _one_gpu(N, H, D, repeat)
        torch.cuda.empty_cache()
    _sync()
    q, k, v, do = _inputs(N, H, D)
    ql, kl, vl, dol = (fcd.shard_sequence(x) for x in (q, k, v, do))
    del q, k, v, do
    torch.cuda.empty_cache()
    ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def ring():
        for x in (ql, kl, vl):
            x.grad = None
        fcd.ring_attention(ql, kl, vl, causal=True).backward(dol)

    row["tW"] = _time(ring, repeat)
    row["memW_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    row["timeline"] = timeline(ql, kl, vl)
    return row


def _one_gpu(N, H, D, repeat):
    """(median seconds, peak GiB beyond the inputs) of forward+backward on this GPU."""
    import flashcore

    q, k, v, do = _inputs(N, H, D)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def one():
        for x in (q, k, v):
            x.grad = None
        flashcore.attention(q, k, v, causal=True).backward(do)

    t = _time_local(one, repeat)
    return t, (torch.cuda.max_memory_allocated() - base) / 2**30


def _time_local(fn, repeat):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def timeline(ql, kl, vl):
    """Per step of one forward ring on this rank: kernel ms and wait ms (CUDA events)."""
    from flashcore.distributed import _torch_ring as tr

    events = []
    real_wait, real_attn = tr._wait, tr.flashcore.attention_forward

    def attn(*a, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = real_attn(*a, **kw)
        e1.record()
        events.append(("kernel", e0, e1))
        return out

    def wait(reqs):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        real_wait(reqs)
        e1.record()
        events.append(("wait", e0, e1))

    tr._wait, tr.flashcore.attention_forward = wait, attn
    try:
        with torch.no_grad():
            fcdm = __import__("flashcore.distributed", fromlist=["ring_attention"])
            fcdm.ring_attention(ql, kl, vl, causal=True)
        torch.cuda.synchronize()
    finally:
        tr._wait, tr.flashcore.attention_forward = real_wait, real_attn
    return [(kind, round(a.elapsed_time(b), 3)) for kind, a, b in events]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-n", type=int, default=32768)
    p.add_argument("--seqlens", default="65536,131072,262144")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=os.environ.get("RING_JSON", "ring.json"))
    args = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    errs = check(args.check_n, rank, world)
    if rank == 0:
        print(f"correctness N={args.check_n} bf16 H=8 D=128 causal, {world} GPUs vs 1: "
              + " ".join(f"{n}={e:.2e}" for n, e in errs.items()), flush=True)
        out.append({"check": errs, "N": args.check_n, "world": world})
    for n in map(int, args.seqlens.split(",")):
        row = scaling(n, rank, world, args.repeat)
        if rank == 0:
            out.append(row)
            print(f"N={n:>7}  1 GPU {row['t1'] * 1e3:9.1f} ms {row['mem1_GiB']:6.2f} GiB | "
                  f"{world} GPUs {row['tW'] * 1e3:9.1f} ms {row['memW_GiB']:6.2f} GiB/GPU | "
                  f"throughput x{row['t1'] / row['tW']:.2f}", flush=True)
            print("   forward ring steps (rank 0, ms):", row["timeline"], flush=True)
    if rank == 0:
        with open(args.json, "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
