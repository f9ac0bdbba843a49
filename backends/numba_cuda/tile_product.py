"""The one tile product every kernel is built from (SIMT, CUDA cores).

``acc[a, b] += sum_k A(k, a) * B(k, b)`` over shared-memory tiles, where thread ``(tr, tc)``
owns rows ``tr + TR * a`` of A and columns ``tc + TC * b`` of B. Element ``(k, i)`` of A
lives at ``smem[a_off + k * a_ks + i * a_is]`` and element ``(k, j)`` of B at
``smem[b_off + k * b_ks + j * b_js]``, so the same function computes ``Q Kᵀ``, ``P V``,
``Pᵀ dO``, ``dSᵀ Q`` and ``dS K`` from tiles stored either way round.

This is the seam for tensor cores: a warp-level MMA version with the same arguments can
replace it without touching the kernels around it. It is inlined into its callers
(``inline="always"``), where the sizes are compile-time constants, so the loops unroll and
``acc``, ``xa`` and ``xb`` live in registers.
"""
from __future__ import annotations

from .convert import device_function


@device_function
def tile_product(acc, xa, xb, smem, a_off, a_ks, a_is, b_off, b_ks, b_js, depth, tr, tc,
                 RM, RN, TR, TC):
    for k in range(depth):
        for a in range(RM):
            xa[a] = smem[a_off + k * a_ks + (tr + TR * a) * a_is]
        for b in range(RN):
            xb[b] = smem[b_off + k * b_ks + (tc + TC * b) * b_js]
        for a in range(RM):
            for b in range(RN):
                acc[a, b] += xa[a] * xb[b]
