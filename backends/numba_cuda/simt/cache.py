"""The two steps of KV-cache attention around the forward kernel: ``cache_append`` writes
the new keys and values into the caches in place, and ``attn_merge_splits`` combines the
float32 partial outputs of split-KV ("flash-decoding") by their lse.

Both are element-wise: one thread per element, ``v.tiles`` threads per block, no shared
memory. The forward of a split variant (``Variant.split``) writes, for split ``z``, row
``r`` of the flattened ``(B, H, Nq)`` rows: ``o_z[r, :]`` normalized by its own sum, and
``lse_z[r]``; a split whose keys are all masked (or past the sequence) writes 0 and -inf.
The merge then takes ``M = max_z lse_z`` and

    o = sum_z exp(lse_z - M) o_z / sum_z exp(lse_z - M),   lse = M + log sum_z exp(lse_z - M)

which is exact (rounding aside) and gives 0 and -inf for a row that sees no key at all.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from ..device.constants import NEG_INF, PACKING, PAGED
from ..device.convert import store_f32
from ..device.seams import key_row


def make_attn_merge_splits(v):
    """The merge of variant ``v`` (head dim, output dtype; ``v.tiles`` threads per block):
    ``opart`` float32 ``(S, rows, D)``, ``lpart`` float32 ``(S, rows)`` -> ``o`` (strides in
    (B, H, N, D) order, ``rows = B H Nq``) and ``lse`` float32 ``(rows,)``."""
    D = v.head_dim
    NT = v.tiles

    def attn_merge_splits(opart, lpart, o, lse, S, rows, Hq, Nq, osb, osh, osn, osd):
        t = cuda.blockIdx.x * NT + cuda.threadIdx.x
        if t >= rows * D:
            return
        r = t // D
        d = t - r * D
        m = NEG_INF
        for z in range(S):
            m = max(m, lpart[z * rows + r])
        w = float32(0.0)
        acc = float32(0.0)
        if m != NEG_INF:
            for z in range(S):
                lz = lpart[z * rows + r]
                if lz != NEG_INF:  # (an empty split's partial is never read)
                    e = math.exp(lz - m)
                    w += e
                    acc += e * opart[(z * rows + r) * D + d]
        b = r // (Hq * Nq)
        rest = r - b * Hq * Nq
        h = rest // Nq
        i = rest - h * Nq
        store_f32(o, b * osb + h * osh + i * osn + d * osd,
                  acc / w if w > 0 else float32(0.0))
        if d == 0:
            lse[r] = m + math.log(w) if w > 0 else NEG_INF

    attn_merge_splits.__qualname__ = v.tag
    return attn_merge_splits


def make_cache_append(v):
    """The append of variant ``v`` (dtype; ``v.packed`` "cache" or "paged"; ``v.tiles``
    threads per block), keys and values in one launch: ``ksrc`` and ``vsrc`` ``(B, Nnew, H,
    D)`` (strides ``k*`` and ``v*`` in (B, N, H, D) order) go to positions ``seqlens[b] .. +
    Nnew - 1`` of the caches ``kdst`` and ``vdst`` (strides ``K*`` and ``V*``; paged: slots
    of the pages ``table[b * tsb + p // page]``, ``kpsp`` / ``vpsp`` apart, and ``Kb``,
    ``Vb`` 0). Where ``write_ends``, thread ``b < B`` also writes ``ends[b] = seqlens[b] +
    Nnew``, the key counts the attention then reads (so no other launch computes them)."""
    NT = v.tiles
    PAGEDK = PACKING[v.packed] == PAGED

    def cache_append(ksrc, kdst, vsrc, vdst, seqlens, ends, table, B, Nnew, H, D,
                     kb, kn, kh, kd, Kb, Kn, Kh, Kd, vb, vn, vh, vd, Vb, Vn, Vh, Vd,
                     tsb, page, kpsp, vpsp, write_ends):
        t = cuda.blockIdx.x * NT + cuda.threadIdx.x
        if write_ends != 0 and t < B:  # (the grid has B Nnew H D >= B threads)
            ends[t] = seqlens[t] + Nnew
        if t >= B * Nnew * H * D:
            return
        row = t // D
        d = t - row * D
        bn = row // H
        h = row - bn * H
        b = bn // Nnew
        n = bn - b * Nnew
        p = seqlens[b] + n
        tb = b * tsb
        at = key_row(b * Kb + h * Kh, p, Kn, table, tb, page, kpsp, PAGEDK)
        kdst[at + d * Kd] = ksrc[b * kb + n * kn + h * kh + d * kd]
        at = key_row(b * Vb + h * Vh, p, Vn, table, tb, page, vpsp, PAGEDK)
        vdst[at + d * Vd] = vsrc[b * vb + n * vn + h * vh + d * vd]

    cache_append.__qualname__ = v.tag
    return cache_append
