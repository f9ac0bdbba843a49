"""Host side of the tensor-core kernels (forward_tc_kernels.py, backward_tc_kernels.py):
which launches they serve and the prepared kernels. launch.run_forward and
launch.run_backward ask :func:`serves` and launch these kernels with the SIMT kernels'
arguments, or else the SIMT kernels; so every caller (the array adapters, the JAX
``buffer_callback`` path, the benchmarks) gets the same choice.

Served: fp16/bf16, head dims 32, 64, 96, 128 and 256, compute capability 8.0 or newer, and
buffers whose rows are 16-byte aligned with unit stride along the head dim (cp.async
copies 16 bytes) for every input the kernels copy (q, k, v; and dO in the backward). The
launch arguments are those of the SIMT kernels: the same signatures and packing.
"""
from __future__ import annotations

import functools
import os

from . import backward_tc_kernels as _bwd
from . import forward_tc_kernels as _fwd
from . import launch
from . import tile_product_tc as _tiles
from .convert import SIMULATOR

#: Environment switch: the tensor-core kernels serve fp16/bf16 by default (they passed the
#: numba_cuda GPU suite on an H100/H200, notes/tensor_cores.md); ``FLASHCORE_TENSOR_CORES=0``
#: selects the SIMT kernels instead.
ENV = "FLASHCORE_TENSOR_CORES"
_DTYPES = ("float16", "bfloat16")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def serves(case, device, q, k, v, do=None) -> bool:
    """Whether the tensor-core kernels take this launch; ``q, k, v, do`` are the launch's
    (handle, strides) views."""
    if case.dtype not in _DTYPES or case.head_dim not in _tiles.HEAD_DIMS or not enabled():
        return False
    if not SIMULATOR and launch.device_cc(device) < (8, 0):
        return False
    if not _has_tiles(do is not None, case.head_dim, case.dtype, case.causal, device):
        return False
    sq = (case.batch, case.heads_q, case.seqlen_q)
    skv = (case.batch, case.heads_kv, case.seqlen_k)
    return (launch.rows_aligned(q, sq, 8) and launch.rows_aligned(k, skv, 8)
            and launch.rows_aligned(v, skv, 8) and (do is None or launch.rows_aligned(do, sq, 8)))


@functools.cache
def _has_tiles(backward, head_dim, dtype, causal, device) -> bool:
    """Whether this GPU's shared memory holds a tiling of every kernel of the pass."""
    names = ("dkdv", "dq") if backward else ("forward",)
    return all(_tiles.choose(n, head_dim, causal, dtype, *_gpu(device)) is not None
               for n in names)


_MAKERS = {
    "forward": (_fwd.make_attn_forward_tc, "attn_forward"),
    "dkdv": (_bwd.make_attn_backward_dkdv_tc, "attn_backward_dkdv"),
    "dq": (_bwd.make_attn_backward_dq_tc, "attn_backward_dq"),
}


def kernel(name, head_dim, dtype, causal, device, t=None):
    """``(prepared kernel, block_m)`` of tensor-core kernel ``name`` ("forward", "dkdv",
    "dq") for one case class and device; tiling ``t``, or by default the autotuner's cached
    choice for this GPU, else the built-in table (tile_product_tc.choose)."""
    def build():
        tiles = t
        if tiles is None:
            tiles = _tiles.choose(name, head_dim, causal, dtype, *_gpu(device))
        make, sig_name = _MAKERS[name]
        return (launch.Prepared(make(head_dim, tiles, causal, dtype),
                                launch.signature(sig_name, dtype), tiles.threads,
                                _tiles.smem_elements(name, tiles, head_dim) // 2, device),
                tiles.block_m)

    return launch._prepared(("tc", name, head_dim, dtype, causal, device, t), build)


def _gpu(device):
    """(name, compute capability) of GPU ``device``; (None, None) in the simulator."""
    if SIMULATOR:
        return None, None
    return launch.device_name(device), launch.device_cc(device)


def forward_plan(case, device):
    """``(kernel, block_m)`` of the forward, as launch.run_forward launches it."""
    return kernel("forward", case.head_dim, case.dtype, case.causal, device)


def backward_plan(case, device):
    """``(dkdv kernel, its block_m, dq kernel, its block_m)``, as launch.run_backward
    launches them (after the SIMT preprocess kernel, whose delta they read)."""
    args = (case.head_dim, case.dtype, case.causal, device)
    return (*kernel("dkdv", *args), *kernel("dq", *args))


def variants(head_dim: int, dtype: str, causal: bool, cc=None):
    """``(name, python function, signature, shared-memory bytes, threads)`` of the
    tensor-core kernels of one case class, with the tilings chosen for compute capability
    ``cc`` (the built-in tables if None); the PTX tests compile exactly these."""
    out = []
    for name, (make, sig_name) in _MAKERS.items():
        t = _tiles.choose(name, head_dim, causal, dtype, cc=cc, simulator=False)
        if t is None:
            continue
        out.append((name, make(head_dim, t, causal, dtype), launch.signature(sig_name, dtype),
                    2 * _tiles.smem_elements(name, t, head_dim), t.threads))
    return out
