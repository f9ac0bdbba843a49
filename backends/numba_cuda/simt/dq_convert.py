"""The element-wise ends of the backward's non-deterministic mode (the wgmma "dkdvq"
kernel, ``hopper/dq_atomic.py``), which adds dQ's parts into a float32 accumulator: zero
the accumulator before, then dQ = accumulator × scale in the output's dtype and strides.
One thread per element, ``v.tiles`` threads per block, no shared memory."""
from __future__ import annotations

from numba import cuda, float32

from ..device.convert import store_f32


def make_dq_convert(v):
    """Variant ``v`` (head dim, output dtype; ``v.tiles`` threads per block): over ``rows``
    = B Hq Nq rows of ``D`` elements, the accumulator's element of (b, h, i, d) at
    ``b asb + h ash + i asn + (d + 4 i) mod D`` (rows rotated as ``hopper/dq_atomic.py``
    stages them; ``D`` a power of two); ``zero`` 1: set it to 0; 0: write it times
    ``scale`` to ``dq`` (strides in (B, H, N, D) order)."""
    D = v.head_dim
    NT = v.tiles

    def attn_backward_dq_convert(acc, dq, zero, rows, Hq, Nq, asb, ash, asn, qsb, qsh, qsn,
                                 qsd, scale):
        t = cuda.blockIdx.x * NT + cuda.threadIdx.x
        if t >= rows * D:
            return
        r = t // D
        d = t - r * D
        b = r // (Hq * Nq)
        rest = r - b * Hq * Nq
        h = rest // Nq
        i = rest - h * Nq
        a = b * asb + h * ash + i * asn + ((d + 4 * i) & (D - 1))
        if zero:
            acc[a] = float32(0.0)
        else:
            store_f32(dq, b * qsb + h * qsh + i * qsn + d * qsd, acc[a] * float32(scale))

    attn_backward_dq_convert.__qualname__ = v.tag
    return attn_backward_dq_convert
