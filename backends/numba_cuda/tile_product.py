"""The one tile product every kernel is built from (SIMT, CUDA cores).

``acc[a, b] += sum_k A(k, tr * RM + a) * B(k, tc + TC * b)`` over shared-memory tiles:
thread ``(tr, tc)`` owns a block of ``RM`` consecutive rows of A and ``RN`` columns of B
strided by ``TC``. Element ``(k, i)`` of A lives at ``smem[a_off + k * a_ks + i]`` (rows
contiguous, so a thread's rows come in 16-byte vector loads that the lanes sharing ``tr``
receive as one broadcast), and element ``(k, j)`` of B at ``smem[b_off + k * b_ks +
j * b_js]`` (lanes on consecutive columns: with ``b_js`` 1 or odd, on distinct banks). The
same function computes ``Q Kᵀ``, ``P V``, ``Pᵀ dO``, ``dSᵀ Q`` and ``dS K``.

This is the seam for tensor cores: a warp-level MMA version with the same arguments can
replace it without touching the kernels around it. It is inlined into its callers, where
the sizes are compile-time constants, so the loops unroll and ``acc``, ``xa`` and ``xb``
live in registers.
"""
from __future__ import annotations

from .convert import device_function, ld4


@device_function
def _rank1_step(acc, xa, xb, smem, ak, bk, b_js, RM, RN, TC):
    """acc += A[k] (x) B[k] for one k: A's RM words at ``smem[ak:]``, B's RN words at
    ``smem[bk + TC * b * b_js]``."""
    if RM % 4 == 0:  # (a compile-time constant: one branch survives)
        for a4 in range(RM // 4):
            v = ld4(smem, ak + 4 * a4)
            xa[4 * a4] = v[0]
            xa[4 * a4 + 1] = v[1]
            xa[4 * a4 + 2] = v[2]
            xa[4 * a4 + 3] = v[3]
    else:
        for a in range(RM):
            xa[a] = smem[ak + a]
    for b in range(RN):
        xb[b] = smem[bk + TC * b * b_js]
    for a in range(RM):
        for b in range(RN):
            acc[a, b] += xa[a] * xb[b]


@device_function
def _four_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC):
    """Rank-1 steps k .. k+3 (A's words from ``smem[ak:]``, B's from ``smem[bk:]``)."""
    _rank1_step(acc, xa, xb, smem, ak, bk, b_js, RM, RN, TC)
    _rank1_step(acc, xa, xb, smem, ak + a_ks, bk + b_ks, b_js, RM, RN, TC)
    _rank1_step(acc, xa, xb, smem, ak + 2 * a_ks, bk + 2 * b_ks, b_js, RM, RN, TC)
    _rank1_step(acc, xa, xb, smem, ak + 3 * a_ks, bk + 3 * b_ks, b_js, RM, RN, TC)


@device_function
def tile_product(acc, xa, xb, smem, a_off, a_ks, b_off, b_ks, b_js, depth, tr, tc,
                 RM, RN, TC):
    """``depth`` must be a multiple of 4: the k loop is unrolled by hand (LLVM leaves
    numba's range loops rolled, and each trip carries 64-bit bookkeeping), by 8 where the
    thread's tile is small (RM * RN <= 32) and ``depth`` allows, else by 4."""
    ra = a_off + tr * RM
    cb = b_off + tc * b_js
    if RM * RN <= 32 and depth % 8 == 0:  # (compile-time constants)
        for k in range(0, depth, 8):
            ak = ra + k * a_ks
            bk = cb + k * b_ks
            _four_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC)
            _four_steps(acc, xa, xb, smem, ak + 4 * a_ks, bk + 4 * b_ks, a_ks, b_ks, b_js,
                        RM, RN, TC)
    else:
        for k in range(0, depth, 4):
            _four_steps(acc, xa, xb, smem, ra + k * a_ks, cb + k * b_ks, a_ks, b_ks, b_js,
                        RM, RN, TC)
