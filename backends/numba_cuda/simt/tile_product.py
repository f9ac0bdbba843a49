"""The one tile product every kernel is built from (SIMT, CUDA cores).

``acc[a, b] += sum_k A(k, tr * RM + a) * B(k, column(tc, b))`` over shared-memory tiles:
thread ``(tr, tc)`` owns a block of ``RM`` consecutive rows of A and ``RN`` columns of B.
Element ``(k, i)`` of A lives at ``smem[a_off + k * a_ks + i]`` (rows contiguous, so a
thread's rows come in 16-byte vector loads that the lanes sharing ``tr`` receive as one
broadcast), and element ``(k, j)`` of B at ``smem[b_off + k * b_ks + j * b_js]``. How B is
read follows from its strides (compile-time constants; :func:`b_mode`):

- ``b_ks == 1`` with ``b_js`` a multiple of 4 (a B tile stored ``[column][k]``, 16-byte
  rows): each column's next 4 words of k come in one 16-byte load; columns ``tc + TC * b``;
- ``b_js == 1`` with ``b_ks`` a multiple of 4 and ``RN`` a multiple of 4 (stored ``[k][column]``,
  16-byte rows): the thread's columns come in groups of 4 adjacent ones, ``4 * tc + (b % 4) +
  4 * TC * (b // 4)``, one 16-byte load per group, the lanes on consecutive 16 bytes;
- otherwise one word per column, columns ``tc + TC * b`` (lanes on consecutive columns: with
  ``b_js`` 1 or odd, on distinct banks).

The same function computes ``Q Kᵀ``, ``P V``, ``Pᵀ dO``, ``dSᵀ Q`` and ``dS K``.

This is the seam for tensor cores: a warp-level MMA version with the same arguments can
replace it without touching the kernels around it. It is inlined into its callers, where
the sizes are compile-time constants, so the loops unroll and ``acc``, ``xa`` and ``xb``
live in registers.
"""
from __future__ import annotations

from ..device.convert import device_function, ld4

#: How a B operand is read (:func:`b_mode`).
B_WORDS, B_ALONG_K, B_GROUPED = 0, 1, 2


@device_function
def b_mode(b_ks, b_js, RN):
    """B_ALONG_K, B_GROUPED or B_WORDS for a B operand of strides ``b_ks``, ``b_js`` (see
    the module docstring)."""
    if b_ks == 1 and b_js % 4 == 0:
        return B_ALONG_K
    if b_js == 1 and b_ks % 4 == 0 and RN % 4 == 0:
        return B_GROUPED
    return B_WORDS


@device_function
def column(tc, b, b_ks, b_js, RN, TC):
    """The B column that thread column ``tc`` holds in its slot ``b``: what the kernels
    store an output slot to. (Score products never read B grouped, so the kernels' masks
    and P/dS stores use ``tc + TC * b`` directly.)"""
    if b_mode(b_ks, b_js, RN) == B_GROUPED:
        return 4 * tc + (b & 3) + 4 * TC * (b >> 2)
    return tc + TC * b


@device_function
def _ld4_into(x, j, smem, i):
    """``x[j:j+4] = smem[i:i+4]`` in one 16-byte load."""
    v = ld4(smem, i)
    x[j] = v[0]
    x[j + 1] = v[1]
    x[j + 2] = v[2]
    x[j + 3] = v[3]


@device_function
def _load_a(xa, smem, ak, RM):
    if RM % 4 == 0:  # (a compile-time constant: one branch survives)
        for a4 in range(RM // 4):
            _ld4_into(xa, 4 * a4, smem, ak + 4 * a4)
    else:
        for a in range(RM):
            xa[a] = smem[ak + a]


@device_function
def _rank1_step(acc, xa, xb, smem, ak, bk, b_js, RM, RN, TC, MODE):
    """acc += A[k] (x) B[k] for one k: A's RM words at ``smem[ak:]``, B's RN words of row k
    at ``smem[bk:]`` (strided by ``TC * b_js``, or grouped)."""
    _load_a(xa, smem, ak, RM)
    if MODE == B_GROUPED:
        for g in range(RN // 4):
            _ld4_into(xb, 4 * g, smem, bk + 4 * TC * g)
    else:
        for b in range(RN):
            xb[b] = smem[bk + TC * b * b_js]
    for a in range(RM):
        for b in range(RN):
            acc[a, b] += xa[a] * xb[b]


@device_function
def _four_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC, MODE):
    """Rank-1 steps k .. k+3 (A's words from ``smem[ak:]``, B's from ``smem[bk:]``)."""
    if MODE == B_ALONG_K:
        # xb holds 4 words of k per column: xb[4 * b + kk]
        for b in range(RN):
            _ld4_into(xb, 4 * b, smem, bk + TC * b * b_js)
        for kk in range(4):
            _load_a(xa, smem, ak + kk * a_ks, RM)
            for a in range(RM):
                for b in range(RN):
                    acc[a, b] += xa[a] * xb[4 * b + kk]
    else:
        _rank1_step(acc, xa, xb, smem, ak, bk, b_js, RM, RN, TC, MODE)
        _rank1_step(acc, xa, xb, smem, ak + a_ks, bk + b_ks, b_js, RM, RN, TC, MODE)
        _rank1_step(acc, xa, xb, smem, ak + 2 * a_ks, bk + 2 * b_ks, b_js, RM, RN, TC, MODE)
        _rank1_step(acc, xa, xb, smem, ak + 3 * a_ks, bk + 3 * b_ks, b_js, RM, RN, TC, MODE)


@device_function
def _eight_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC, MODE):
    """Rank-1 steps k .. k+7."""
    _four_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC, MODE)
    _four_steps(acc, xa, xb, smem, ak + 4 * a_ks, bk + 4 * b_ks, a_ks, b_ks, b_js, RM, RN, TC,
                MODE)


@device_function
def k_step(k_unroll, tile, depth):
    """k steps per loop trip of a product (16, 8 or 4; it must divide ``depth``):
    ``k_unroll`` (Tiles.k_unroll) where it divides, else the next smaller that does; with
    ``k_unroll`` 0, 8 where the thread's tile (``tile`` = RM * RN) is small, else 4."""
    u = k_unroll
    if u == 0:
        u = 8 if tile <= 32 else 4
    if u >= 16 and depth % 16 == 0:
        return 16
    if u >= 8 and depth % 8 == 0:
        return 8
    return 4


@device_function
def tile_product(acc, xa, xb, smem, a_off, a_ks, b_off, b_ks, b_js, depth, tr, tc,
                 RM, RN, TC, KU):
    """``depth`` must be a multiple of 4, ``xb`` hold ``4 * RN`` words. The k loop is
    unrolled by hand (LLVM leaves numba's range loops rolled, and each trip carries 64-bit
    bookkeeping) by :func:`k_step` (``KU``: the tiling's k_unroll); the more steps a trip
    has, the fewer trips begin by waiting on their first shared-memory loads."""
    MODE = b_mode(b_ks, b_js, RN)
    ra = a_off + tr * RM
    cb = b_off + (4 * tc if MODE == B_GROUPED else tc * b_js)
    STEP = k_step(KU, RM * RN, depth)
    # (the steps are written out as calls: LLVM would leave a range loop rolled)
    if STEP == 16:  # (compile-time constants)
        for k in range(0, depth, 16):
            ak = ra + k * a_ks
            bk = cb + k * b_ks
            _eight_steps(acc, xa, xb, smem, ak, bk, a_ks, b_ks, b_js, RM, RN, TC, MODE)
            _eight_steps(acc, xa, xb, smem, ak + 8 * a_ks, bk + 8 * b_ks, a_ks, b_ks, b_js,
                         RM, RN, TC, MODE)
    elif STEP == 8:
        for k in range(0, depth, 8):
            _eight_steps(acc, xa, xb, smem, ra + k * a_ks, cb + k * b_ks, a_ks, b_ks, b_js,
                         RM, RN, TC, MODE)
    else:
        for k in range(0, depth, 4):
            _four_steps(acc, xa, xb, smem, ra + k * a_ks, cb + k * b_ks, a_ks, b_ks, b_js,
                        RM, RN, TC, MODE)
