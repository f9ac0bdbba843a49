"""The arguments every kernel launch takes for what a call does not use (no ALiBi slopes,
no mod_args, dense rows, no tile classes) or builds from its arrays (packed rows, mod_args,
strides in (B, H, N, D) order, flat host views for the simulator); ``launch`` re-exports
them."""
from __future__ import annotations

import numpy as np

from .device.convert import SIMULATOR
from .device.user_mods import MAX_ARGS, MAX_DIMS


def no_slopes(buffer):
    """The slopes argument of a call without ALiBi: a float32 buffer of the call (its
    variants never read it) with zero strides. The simulator copies each array argument
    back after the launch, so there it is a buffer of its own, not one the kernel writes."""
    if SIMULATOR:
        return np.zeros(1, np.float32), (0, 0)
    return buffer, (0, 0)


def no_mod_args(buffer):
    """The mod_args arguments of a call without them (:func:`no_slopes`'s buffer)."""
    return (no_slopes(buffer)[0],) * MAX_ARGS + (0,) * (MAX_ARGS * MAX_DIMS)


def no_packed(buffer):
    """The packed-rows arguments of a dense call (never read)."""
    h = no_slopes(buffer)[0]
    return (h, h, h, h, 0, 1, 0, 0, 0, 0, 0, 0)


def packed_args(cu_q=None, cu_k=None, seqk=None, table=None, tsb=0, page=1, psp=0,
                total_q=0, chunk=0, oss=0, lss=0, nseq=0, buffer=None):
    """The packed-rows arguments (:data:`PACKED_SIG`) of a varlen or KV-cache call: int32
    handles (``buffer``'s, never read, where a layout has none), the block table's batch
    stride, the page size and the page stride (paged), the packed query rows (varlen),
    split-KV's keys per split and the partials' split strides, and the number of
    sequences (varlen)."""
    h = no_slopes(buffer)[0]
    return (h if cu_q is None else cu_q, h if cu_k is None else cu_k,
            h if seqk is None else seqk, h if table is None else table, tsb, page, psp,
            total_q, chunk, oss, lss, nseq)


def no_classes(buffer):
    """The tile-classes arguments of a call without a mask_mod (never read)."""
    return (no_slopes(buffer)[0], 0, 0, 0)


def mod_args(views) -> tuple:
    """The mod_args arguments of a call from ``views``, a ``(handle, shape)`` per C-
    contiguous array: MAX_ARGS handles (the first again past them), then each array's
    extents padded with 1 to MAX_DIMS (and 1s past the arrays)."""
    handles = [h for h, _ in views]
    handles += [handles[0]] * (MAX_ARGS - len(handles))
    ext = []
    for _, shape in views:
        ext += list(shape) + [1] * (MAX_DIMS - len(shape))
    ext += [1] * (MAX_ARGS * MAX_DIMS - len(ext))
    return (*handles, *ext)


def bhnd(strides, layout):
    """Strides of a (B, H, N, D) or (B, N, H, D) array, in (B, H, N, D) order."""
    s0, s1, s2, s3 = strides
    return (s0, s1, s2, s3) if layout == "bhnd" else (s0, s2, s1, s3)


def host_flat(x: np.ndarray):
    """A flat NumPy view over the memory of ``x`` (simulator launches index it like a
    pointer) and ``x``'s strides in elements; bf16 is viewed as its uint16 bits."""
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    item = x.itemsize
    if any(s < 0 for s in x.strides) or any(s % item for s in x.strides):
        x = np.ascontiguousarray(x)
    strides = tuple(s // item for s in x.strides)
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, strides)) if x.size else 0
    flat = np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(item,))
    return flat, strides
