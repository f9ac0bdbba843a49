"""The element-wise ends of the backward's non-deterministic mode (the wgmma "dkdvq"
kernel, ``hopper/dq_atomic.py``), which adds dQ's parts into a float32 accumulator: zero
the accumulator before, then dQ = accumulator × scale in the output's dtype and strides.
One thread per element, ``v.tiles`` threads per block, no shared memory; the grid is
(elements of one head's rows, heads, batch), so a thread finds its element by a shift and
a mask (the head dim is a power of two): with the batch and head taken from a flat index
by 64-bit divisions the two passes took 0.24 ms where their 100 MB take 0.03 (H200, B=4
H=16 N=4096 D=64)."""
from __future__ import annotations

from numba import cuda, float32

from ..device.convert import store_f32


def make_dq_convert(v):
    """Variant ``v`` (head dim, output dtype; ``v.tiles`` threads per block): on a grid of
    (ceil(Nq D / threads), Hq, B) blocks (``rows`` = B Hq Nq, unused), the accumulator's
    element of (b, h, i, d) at ``b asb + h ash + i asn + (d + 4 i) mod D`` (rows rotated as
    ``hopper/dq_atomic.py`` stages them; ``D`` a power of two); ``zero`` 1: set it to 0;
    0: write it times ``scale`` to ``dq`` (strides in (B, H, N, D) order)."""
    D = v.head_dim
    NT = v.tiles
    if D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two for the dQ accumulator")

    def attn_backward_dq_convert(acc, dq, zero, rows, Hq, Nq, asb, ash, asn, qsb, qsh, qsn,
                                 qsd, scale):
        t = cuda.blockIdx.x * NT + cuda.threadIdx.x  # (element of this head's rows)
        if t >= Nq * D:
            return
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        i = t // D  # (D a compile-time power of two: a shift)
        d = t & (D - 1)
        a = b * asb + h * ash + i * asn + ((d + 4 * i) & (D - 1))
        if zero:
            acc[a] = float32(0.0)
        else:
            store_f32(dq, b * qsb + h * qsh + i * qsn + d * qsd, acc[a] * float32(scale))

    attn_backward_dq_convert.__qualname__ = v.tag
    return attn_backward_dq_convert
