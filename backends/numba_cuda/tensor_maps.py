"""Tensor maps of the bulk tensor copies (``HopperTiles.tma``): Q, K and V of a dense
launch as 4-D tensors (D, N, H, B) (innermost first; row, head and batch strides in bytes,
unit stride along D), boxes of 64 columns (128 bytes: the 128-byte swizzle, the layout of
``device/wgmma``'s tiles) and ``block_n`` rows, rows past N zero-filled. The driver encodes
each (``cuTensorMapEncodeTiled``); the kernel reads them from global memory (three 128-byte
maps, 64-byte aligned) through the block-table argument, which the wgmma kernels do not
otherwise read. The strides are multiples of 16 bytes wherever the tensor-core kernels
serve (``launch.rows_aligned``), as the driver requires.

Maps are kept per (addresses, shapes, strides, box) in each device's memory (a call on the
same arrays reuses them; :data:`MAX_MAPS` sets a device). Dropping the oldest set waits
for the device first (a kernel still in flight may read it): the candidates that take these
maps (``g2n128op3t``, ``g2n64op3t``) are slower than the table's tilings on the H100/H200
(notes/tma_2026-11-26.md), so only the tools and tests reach this, and a serving loop with
new arrays every call would want the maps passed by value instead. The simulator takes
``device/sim_pipeline.sim_tensor_map``'s description.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict

import numpy as np

from .device.convert import SIMULATOR

#: CUtensorMapDataType of the 16-bit dtypes; CUtensorMapSwizzle 128B; L2 promotion 256B.
_DTYPE = {"float16": 6, "bfloat16": 9}
_SWIZZLE_128B = 3
_L2_256B = 3
#: Columns of one box: 128 bytes of 16-bit elements (the 128-byte swizzle's width).
BOX_COLUMNS = 64
#: Sets of maps kept on each device.
MAX_MAPS = 256

_kept: dict = {}  # device -> OrderedDict of map sets
_encode = None


def _encoder():
    global _encode
    if _encode is None:
        from .driver import _libcuda

        fn = _libcuda().cuTensorMapEncodeTiled
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                       u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode = fn
    return _encode


def _geometry(view, dims):
    """(address, dims (D, N, H, B), byte strides (row, head, batch)) of a (handle, strides)
    view of a (B, H, N, D) array with ``dims`` (B, H, N, D); a dim of extent 1 takes the
    stride of the dims inside it (never stepped; the driver wants multiples of 16)."""
    handle, (sb, sh, sn, _) = view
    B, H, N, D = dims
    row = 2 * sn if N > 1 else 2 * D
    head = 2 * sh if H > 1 else row * N
    batch = 2 * sb if B > 1 else head * H
    return int(handle), (D, N, H, B), (row, head, batch)


def _encode_map(out, dtype, address, dims, strides, rows):
    gd = (ctypes.c_uint64 * 4)(*dims)
    gs = (ctypes.c_uint64 * 3)(*strides)
    box = (ctypes.c_uint32 * 4)(BOX_COLUMNS, rows, 1, 1)
    es = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    err = _encoder()(out, _DTYPE[dtype], 4, address, gd, gs, box, es, 0, _SWIZZLE_128B,
                     _L2_256B, 0)
    if err:
        from .driver import error_text

        raise RuntimeError(f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, "
                           f"box=({BOX_COLUMNS}, {rows})) failed: {error_text(err)}")


def _views(case, q, k, v):
    B, D = case.batch, case.head_dim
    return ((q, (B, case.heads_q, case.seqlen_q, D)), (k, (B, case.heads_kv, case.seqlen_k, D)),
            (v, (B, case.heads_kv, case.seqlen_k, D)))


def tensor_maps(case, device, q, k, v, block_n):
    """The handle of Q's, K's and V's tensor maps (boxes of ``block_n`` rows) on
    ``device``: an int64 array of simulated maps under the simulator."""
    if SIMULATOR:
        from .device.sim_pipeline import sim_tensor_map

        maps = []
        for view, dims in _views(case, q, k, v):
            flat, (sb, sh, sn, _) = view
            B, H, N, D = dims
            maps.append(sim_tensor_map(flat, (D, N, H, B), (sn, sh, sb),
                                       (BOX_COLUMNS, block_n)))
        return np.concatenate(maps)
    geo = tuple(_geometry(view, dims) for view, dims in _views(case, q, k, v))
    key = (case.dtype, block_n, geo)
    kept = _kept.setdefault(device, OrderedDict())
    arr = kept.get(key)
    if arr is not None:
        kept.move_to_end(key)
        return arr.device_ctypes_pointer.value
    host = (ctypes.c_uint8 * (3 * 128 + 64))()
    at = -ctypes.addressof(host) % 64  # (the struct is 64-byte aligned in C)
    for n, (address, dims, strides) in enumerate(geo):
        _encode_map(ctypes.addressof(host) + at + 128 * n, case.dtype, address, dims,
                    strides, block_n)
    from numba import cuda

    data = np.frombuffer(host, np.uint8)[at:at + 3 * 128].copy()
    with cuda.gpus[device]:
        arr = cuda.to_device(data)
        if len(kept) >= MAX_MAPS:
            cuda.synchronize()  # (no kernel in flight reads the set dropped)
            kept.popitem(last=False)
    kept[key] = arr
    return arr.device_ctypes_pointer.value
