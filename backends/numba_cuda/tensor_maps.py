"""Tensor maps of the bulk tensor copies (``HopperTiles.tma``): Q, K and V of a dense
launch as 4-D tensors (D, N, H, B) (innermost first; row, head and batch strides in bytes,
unit stride along D), boxes of 64 columns (128 bytes: the 128-byte swizzle, the layout of
``device/wgmma``'s tiles) and ``block_n`` rows, rows past N zero-filled. The strides are
multiples of 16 bytes wherever the tensor-core kernels serve (``launch.rows_aligned``), as
the driver requires.

The three maps (384 bytes) are the kernel's last parameter, by value (``driver.Prepared``'s
``tail_bytes``): nothing is allocated, copied or synchronized per call. The driver encodes
a map (``cuTensorMapEncodeTiled``, about 8 µs); a call keeps, per geometry (dtype, box,
shapes, strides: :data:`MAX_KEPT` of them), the encoded maps and writes its own addresses
into them: a map holds its tensor's address as its first 8 bytes, little-endian, which is
checked once per geometry (a second encoding at another address must differ there and only
there), else every call encodes its maps. The simulator takes
``device/sim_pipeline.sim_tensor_map``'s descriptions instead, in the block table's place.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict

import numpy as np

from .device.convert import SIMULATOR

#: CUtensorMapDataType of the 16-bit dtypes; CUtensorMapSwizzle 128B; L2 promotion 256B.
_DTYPE = {"float16": 6, "bfloat16": 9}
_SWIZZLE_128B = 3
_L2_256B = 3
#: Columns of one box: 128 bytes of 16-bit elements (the 128-byte swizzle's width).
BOX_COLUMNS = 64
#: Bytes of the kernel parameter: Q's, K's and V's maps.
MAPS_BYTES = 3 * 128
#: Geometries whose encoded maps are kept.
MAX_KEPT = 256

_kept: OrderedDict = OrderedDict()  # (dtype, block_n, shapes and strides) -> (bytes, ok)
_kept_lock = threading.Lock()
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


def _encode_set(dtype, geo, block_n) -> bytes:
    host = (ctypes.c_uint8 * (MAPS_BYTES + 64))()
    at = -ctypes.addressof(host) % 64  # (the struct is 64-byte aligned in C)
    for n, (address, dims, strides) in enumerate(geo):
        _encode_map(ctypes.addressof(host) + at + 128 * n, dtype, address, dims, strides,
                    block_n)
    return bytes(host)[at:at + MAPS_BYTES]


def _addresses_patchable(data: bytes, dtype, geo, block_n) -> bool:
    """Whether each map of ``data`` (encoded for ``geo``) holds its address as its first 8
    bytes and nothing else of it: encoded again 64 KiB further on, the maps differ there
    and only there."""
    moved = tuple((a + (1 << 16), d, s) for a, d, s in geo)
    other = _encode_set(dtype, moved, block_n)
    for n, (a, _, _) in enumerate(geo):
        one, two = data[128 * n:128 * (n + 1)], other[128 * n:128 * (n + 1)]
        if (one[8:] != two[8:] or int.from_bytes(one[:8], "little") != a
                or int.from_bytes(two[:8], "little") != a + (1 << 16)):
            return False
    return True


def maps(case, q, k, v, block_n):
    """Q's, K's and V's tensor maps (boxes of ``block_n`` rows) for views ``q``, ``k``,
    ``v`` ((handle, strides) pairs): :data:`MAPS_BYTES` bytes, the kernel's by-value
    parameter; under the simulator an int64 array of simulated maps."""
    if SIMULATOR:
        from .device.sim_pipeline import sim_tensor_map

        out = []
        for view, dims in _views(case, q, k, v):
            flat, (sb, sh, sn, _) = view
            B, H, N, D = dims
            out.append(sim_tensor_map(flat, (D, N, H, B), (sn, sh, sb),
                                      (BOX_COLUMNS, block_n)))
        return np.concatenate(out)
    geo = tuple(_geometry(view, dims) for view, dims in _views(case, q, k, v))
    key = (case.dtype, block_n, tuple(g[1:] for g in geo))
    with _kept_lock:
        kept = _kept.get(key)
        if kept is not None:
            _kept.move_to_end(key)
    if kept is None:
        data = _encode_set(case.dtype, geo, block_n)
        kept = (data, _addresses_patchable(data, case.dtype, geo, block_n))
        with _kept_lock:
            _kept[key] = kept
            if len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
        return data
    data, ok = kept
    if not ok:
        return _encode_set(case.dtype, geo, block_n)
    out = bytearray(data)
    for n, g in enumerate(geo):
        struct.pack_into("<Q", out, 128 * n, g[0])
    return bytes(out)
