"""Target for Nsight Compute: flashcore's CUDA kernels (forward, dK/dV, dQ) on B=4, H=16,
N=4096, each launched a few times after a warm-up, and optionally a peer's (torch SDPA's
cuDNN or flash backend) beside them. Run under ncu by the ``ncu`` stage of
tools/gpu_session.sh, which profiles the third launch of each kernel named in $KERNELS.

float32 runs the SIMT kernels; bfloat16 and float16 the tensor-core ones (on an H100 the
wgmma kernels, named ``attn_forward_wgmma``, ``attn_backward_dkdv_wgmma``, ...).

Usage: python tools/ncu_attention.py [head_dim] [causal|full] [dtype] [peer: cudnn|flash]

$NCU_DKDVQ (a tag of ``HOPPER_DKDVQ_CANDIDATES``, e.g. g2n64ow) runs the non-deterministic
backward (its one kernel, dkdvq) on that tiling instead of the deterministic pair.
$NCU_FORWARD (a tag of ``HOPPER_CANDIDATES``, or of ``HOPPER_TRIALS`` where a branch has
them, e.g. g2n128op3wt) runs the forward on that tiling, and no backward; ``windowW`` runs
the forward with a sliding window of W keys, ``(W // 2, W // 2 - 1)`` as the bench's
``window:W``, on the tiling the launch chooses. $NCU_SHAPE (BxHxN, default 4x16x4096)
sets the shape.
"""
from __future__ import annotations

import os
import sys

import torch

import flashcore

D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CAUSAL = len(sys.argv) > 2 and sys.argv[2] == "causal"
DTYPE = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
PEER = sys.argv[4] if len(sys.argv) > 4 else ""
if os.environ.get("NCU_DKDVQ"):
    from flashcore.backends.numba_cuda import launch, tilings

    tag = os.environ["NCU_DKDVQ"]
    found = [t for t in tilings.HOPPER_DKDVQ_CANDIDATES.get(D, ()) if t.tag == tag]
    if not found:
        sys.exit(f"NCU_DKDVQ={tag}: not a dkdvq candidate at head dim {D}")
    tilings.HOPPER_DKDVQ[D, CAUSAL] = found[0]
    launch.forget_plans()
    os.environ[launch.DETERMINISTIC_ENV] = "0"
FORWARD_ONLY = bool(os.environ.get("NCU_FORWARD"))
WINDOW = None
if FORWARD_ONLY and os.environ["NCU_FORWARD"].startswith("window"):
    w = int(os.environ["NCU_FORWARD"][len("window"):])
    WINDOW = (w // 2, w // 2 - 1)
elif FORWARD_ONLY:
    from flashcore.backends.numba_cuda import launch, tilings

    tag = os.environ["NCU_FORWARD"]
    known = (*tilings.HOPPER_CANDIDATES, *getattr(tilings, "HOPPER_TRIALS", ()))
    found = [t for t in known if t.tag == tag]
    if not found:
        sys.exit(f"NCU_FORWARD={tag}: not a forward candidate or trial")
    tilings.HOPPER_FORWARD[D, CAUSAL] = found[0]
    tilings.LONG_KEYS.pop((D, CAUSAL), None)
    tilings.PERSISTENT.pop((D, CAUSAL), None)
    launch.forget_plans()
g = torch.Generator(device="cuda").manual_seed(0)
B, H, N = (int(x) for x in os.environ.get("NCU_SHAPE", "4x16x4096").split("x"))
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=DTYPE)
               for _ in range(4))
for _ in range(3):
    o, lse = flashcore.attention_forward(q, k, v, causal=CAUSAL, window=WINDOW,
                                         backend="numba_cuda")
    if FORWARD_ONLY:
        continue
    flashcore.attention_backward(do, q, k, v, o, lse, causal=CAUSAL, backend="numba_cuda")
if PEER:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[PEER]
    qp, kp, vp = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(kind):
        for _ in range(3):
            out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp,
                                                                   is_causal=CAUSAL)
            out.backward(do)
torch.cuda.synchronize()
print("done", D, CAUSAL, DTYPE, PEER)
