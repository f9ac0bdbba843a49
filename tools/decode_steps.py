"""A decode step's time with flashcore from whichever tree ``PYTHONPATH`` names, one line per
cache length (B=8 Hq=32 Hkv=8 D=128 bf16, one token, a contiguous cache; torch CUDA
tensors): one call between CUDA events (the host's work counted, the GPU idle before it)
and 20 calls back to back, both appending a key with the lengths on the host; a 32-step
decode loop appending a key per step (lengths on the host, ``+= 1``); one call and calls
back to back with the lengths on the GPU and no append. Medians over repetitions, then
the best of ``REPS`` turns (the host's speed drifts between and within processes). The
timing and the loop are tools/packed_gpu.py's (``timed``, ``decode_loop``).

For a before/after comparison run two trees in turns in one device call, e.g.::

    for i in 1 2 3 4; do for t in old new; do
        PYTHONPATH=/path/to/$t LS=4096,32768 REPS=3 python3 tools/decode_steps.py $t$i
    done; done

(notes/decode_host_2026-11-27.md).
"""
import os
import sys

import numpy as np
import torch
from packed_gpu import decode_loop, timed  # (tools/: the decode measurements' own timing)

import flashcore


def ev(fn, inner=1, reps=30):
    """Median µs per call (packed_gpu.timed: CUDA events, the host's work counted)."""
    return timed(fn, reps=reps, inner=inner) * 1e6


def main():
    B, Hq, Hkv, D = 8, 32, 8, 128
    dt = torch.bfloat16
    tag = sys.argv[1]
    for L in [int(x) for x in os.environ.get("LS", "4096,32768").split(",")]:
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
        kc = torch.randn(B, L + 64, Hkv, D, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        kn, vn = (torch.randn(B, 1, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
        host = np.full(B, L, np.int32)
        dev = torch.from_numpy(host).cuda()
        app = lambda: flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=host, k=kn, v=vn)  # noqa
        plain_dev = lambda: flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=dev)  # noqa
        runs = [[ev(app), ev(app, inner=20, reps=10),
                 decode_loop(q, kc, vc, L, on_host=True) * 1e6, ev(plain_dev),
                 ev(plain_dev, inner=20, reps=10)] for _ in range(int(os.environ.get("REPS", 1)))]
        r = [min(x) for x in zip(*runs)]  # (the best of the turns: the host's speed drifts)
        byts = 2 * B * L * Hkv * D * 2
        print(f"{tag} L={L}: append+host lengths single {r[0]:.1f} us, b2b {r[1]:.1f} us; "
              f"loop {r[2]:.1f} us/step ({byts / r[2] / 1e3:.0f} GB/s); device lengths "
              f"single {r[3]:.1f} us ({byts / r[3] / 1e3:.0f} GB/s), b2b {r[4]:.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
