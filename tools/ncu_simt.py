"""Target for Nsight Compute: the SIMT float32 kernels (forward, dK/dV, dQ) on B=4, H=16,
N=4096, each launched a few times after a warm-up. Run under ncu by the ``ncu`` stage of
tools/gpu_session.sh, which profiles the third launch of each kernel named in $KERNELS.

Usage: python tools/ncu_simt.py [head_dim] [causal]
"""
from __future__ import annotations

import sys

import torch

import flashcore

D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CAUSAL = len(sys.argv) > 2 and sys.argv[2] == "causal"
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(4, 16, 4096, D, device="cuda", generator=g) for _ in range(4))
for _ in range(3):
    o, lse = flashcore.attention_forward(q, k, v, causal=CAUSAL, backend="numba_cuda")
    flashcore.attention_backward(do, q, k, v, o, lse, causal=CAUSAL, backend="numba_cuda")
torch.cuda.synchronize()
print("done", D, CAUSAL)
