"""The tile classes of a mask_mod, evaluated on the GPU: ``tile_classify`` asks the user's
``mask_mod`` (the same device function the attention kernels ask per score,
``device/user_mods.keeps``) about every element of each ``block x block`` tile and writes
the tile's class, EMPTY (no element kept), FULL (every element kept) or PARTIAL, as
``flashcore._mods.block_classes`` does on the host.

One thread block per tile of one (batch entry, head): each thread takes one key of the
tile and walks its rows, :data:`UNROLL` at a time (neighbouring threads on neighbouring
keys), keeping whether it saw a kept element and whether every element it saw was kept; a
thread that has seen both stops (the tile is PARTIAL whatever the rest holds). ``syncthreads_or`` and
``syncthreads_and`` then combine the threads' answers. The calls of a forward or backward
without a BlockMask launch it on their stream before the attention kernels, which read the
classes in stream order: no copy to the host and no wait.
"""
from __future__ import annotations

from numba import cuda, int8, int32

from ..device.constants import EMPTY, FULL, PARTIAL
from ..device.user_mods import kernel_mods

#: Rows each thread asks about per step, with no exit between them: their loads in flight
#: together (a step's exit test waits for its answers).
UNROLL = 4


def make_tile_classify(v):
    """The classification kernel of variant ``v`` (``v.user`` holds the mask_mod and the
    kinds of its mod_args; ``v.tiles`` threads per block, a power of two): ``classes``
    int8 ``(B, H, ceil(Nq / block), ceil(Nk / block))``, C-contiguous, one block per element
    of it; ``block`` is ``1 << lb``, at most ``v.tiles``. Thread ``t`` asks about key ``t %
    block`` of the tile, on every ``tiles / block``-th row from row ``t / block``. A varlen
    variant (``v.packed``) reads batch entry ``b``'s rows and keys from the offsets
    ``cu_q``, ``cu_k`` (int32), so the mask is asked only inside each sequence (tiles past
    its end are EMPTY), as the attention kernels ask it; ``Nq``, ``Nk`` bound the others."""
    NT = v.tiles
    VARLEN = v.packed == "varlen"
    _, _, VIEWS, _, _, KEEPS = kernel_mods(v)

    def tile_classify(classes, B, H, Nq, Nk, nqt, nkt, lb,
                      m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                      e12, e13, e14, e15, cu_q, cu_k):
        tile = cuda.blockIdx.x
        t = cuda.threadIdx.x
        kt = tile % nkt
        rest = tile // nkt
        qt = rest % nqt
        rest //= nqt
        h = rest % H
        b = rest // H
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        if VARLEN:  # (compile-time) sequence b's own rows and keys, as the kernels ask
            Nq = cu_q[b + 1] - cu_q[b]
            Nk = cu_k[b + 1] - cu_k[b]
        i0 = qt << lb
        j = (kt << lb) + (t & ((1 << lb) - 1))
        step = NT >> lb  # (rows apart)
        rows = min(1 << lb, Nq - i0)
        kept = int32(0)  # (integers: the barrier's predicate)
        every = int32(1)
        r = t >> lb
        if j < Nk:
            while r < rows:
                for u in range(UNROLL):
                    if r + u * step < rows:
                        if KEEPS(b, h, i0 + r + u * step, j, margs):
                            kept = int32(1)
                        else:
                            every = int32(0)
                if kept != 0 and every == 0:
                    break
                r += UNROLL * step
        kept = cuda.syncthreads_or(kept)
        every = cuda.syncthreads_and(every)
        if t == 0:
            classes[tile] = int8(EMPTY if kept == 0 else FULL if every != 0 else PARTIAL)

    tile_classify.__qualname__ = v.tag
    return tile_classify
