"""Host side of the tensor-core forward (forward_tc_kernels.py): which cases it serves, the
prepared kernels, and the launch. Everything it does not serve goes to the SIMT kernels.

Served: fp16/bf16, head dims 32, 64, 96 and 128, compute capability 8.0 or newer, arrays whose
rows are 16-byte aligned with unit stride along the head dim (cp.async copies 16 bytes),
of torch, CuPy or JAX (NumPy only under the CUDA simulator, where it runs in place).
The launch arguments are attn_forward's: the same signature and packing.
"""
from __future__ import annotations

import os
import threading

from . import forward_tc_kernels as _tc
from . import launch
from ._io import _device_index
from .convert import SIMULATOR

#: Environment switch: the tensor-core forward serves fp16/bf16 by default (it passed the
#: whole numba_cuda GPU suite with it on, on an H200; notes/tensor_cores.md);
#: ``FLASHCORE_TENSOR_CORES=0`` selects the SIMT kernels instead.
ENV = "FLASHCORE_TENSOR_CORES"
_DTYPES = ("float16", "bfloat16")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def wanted(case) -> bool:
    """Cheap checks on the case alone (no buffers looked at)."""
    return (case.dtype in _DTYPES and case.head_dim in _tc.HEAD_DIMS
            and (case.library != "numpy" or SIMULATOR))


def _rows_aligned(view, sizes):
    handle, strides = view
    if strides[3] != 1:
        return False
    if any(n > 1 and s % 8 for s, n in zip(strides[:3], sizes)):
        return False
    return SIMULATOR or int(handle) % 16 == 0


_lock = threading.Lock()
_PREPARED: dict = {}


def forward_kernel(head_dim, dtype, causal, device, t):
    key = (head_dim, dtype, causal, device, t)
    p = _PREPARED.get(key)
    if p is None:
        with _lock:
            p = _PREPARED.get(key)
            if p is None:
                fn = _tc.make_attn_forward_tc(head_dim, t, causal, dtype)
                p = _PREPARED[key] = launch.Prepared(
                    fn, launch.signature("attn_forward", dtype), t.threads,
                    _tc.smem_elements(t, head_dim) // 2, device)
    return p


def try_forward(adapter, q, k, v, case):
    """``(o, lse)`` from the tensor-core kernel, or None when the case is not served here
    (the caller then runs the SIMT kernel)."""
    dev = _device_index(case)
    if not SIMULATOR and launch.device_cc(dev) < (8, 0):
        return None
    B, Hq, Hkv, Nq, Nk = case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k
    lay = case.layout
    keep = []
    vq, vk, vv = (adapter.view(x, lay, keep) for x in (q, k, v))
    if not (_rows_aligned(vq, (B, Hq, Nq)) and _rows_aligned(vk, (B, Hkv, Nk))
            and _rows_aligned(vv, (B, Hkv, Nk))):
        return None
    o = adapter.empty(q, tuple(q.shape), None, dev)
    lse = adapter.empty(q, (B, Hq, Nq), "float32", dev)
    if B * Hq * Nq == 0:
        return o, lse
    t = _tc.choose(case.head_dim)
    kern = forward_kernel(case.head_dim, case.dtype, case.causal, dev, t)
    stream = adapter.stream(q, dev)
    vo = adapter.view(o, lay, keep)
    vl = adapter.view(lse, None, keep)[0]
    bm = t.block_m
    kern(((Nq + bm - 1) // bm, B * Hq), stream,
         (vq[0], vk[0], vv[0], vo[0], vl, Nq, Nk, Hq, Hq // Hkv, Nk - Nq, *vq[1], *vk[1],
          *vv[1], *vo[1], float(case.scale)))
    return adapter.finish(stream, keep, o, lse)
