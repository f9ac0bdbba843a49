"""Warp-level tile products on tensor cores, the building blocks of the tensor-core kernels
(forward_tc_kernels.py, backward_tc_kernels.py), and their tilings as data.

Shared tiles are 16-bit elements stored row by row (``[row][k]``) with rows padded by
``PAD`` elements (16 bytes): a row stride of an odd number of 16-byte units puts the eight
rows of each ``ldmatrix`` on distinct banks. Register tiles are fp32 C fragments of mma
m16n8k16 (mma.py gives the layout), four values per lane per 8-column n-tile, kept in local
arrays whose indices are constants after unrolling (so they stay in registers).

- :func:`mma_rows_rows` computes ``A Bᵀ`` for one warp, both operands read from shared rows
  (``S = Q Kᵀ``, ``dP = dO Vᵀ`` and their transposes in the backward).
- :func:`mma_frags_rows` accumulates ``P B`` where ``P`` is a register tile (the C
  fragments of two adjacent n-tiles are exactly the A fragment of one k-step, once rounded
  to the input dtype and packed in pairs) and ``B`` is row-major in shared memory, read
  through ``ldmatrix.trans`` (``O += P V``, ``dV += Pᵀ dO``, ``dK += dSᵀ Q``, ``dQ += dS K``).
- :func:`load_rows` fills a shared tile from global memory with 16-byte ``cp.async`` copies;
  :func:`store_frags` writes a register tile's rows to global memory in the output dtype.

Sizes (``LDS``, ``KSTEPS``, ...) are arguments; the kernels pass their compile-time
constants, and after inlining the loops unroll completely.
"""
from __future__ import annotations

from numba import float32, int64

from ..device.convert import device_function, store_f32
from ..device.intrinsics import (
    cp_async16,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
)
from ..device.seams import key_row


@device_function
def load_rows(smem, off, src, base, n0, nvalid, sn, ROWS, LDS, CH, tid, NT):
    """``smem[off + r * LDS + c] = src[base + (n0 + r) * sn + c]`` for ``r < ROWS``,
    ``c < 8 * CH``, in 16-byte cp.async copies; rows at or past ``nvalid`` are zero-filled
    (their source address stays at ``base``, which is never read).

    Thread ``tid`` copies one fixed 16-byte column (``tid % CH``) of every ``NT // CH``-th
    row from row ``tid // CH`` on (threads past the last whole row of the block's pass
    idle): its addresses are set up once and then stepped, one add per copy, and a tile
    wholly inside ``nvalid`` whose rows the passes cover exactly skips the row tests."""
    RS = NT // CH  # rows per pass
    r = tid // CH
    if r < RS:
        c8 = 8 * (tid - r * CH)
        so = off + r * LDS + c8
        row = n0 + r
        go = base + row * sn + c8
        if ROWS % RS == 0 and n0 + ROWS <= nvalid:
            for _ in range(ROWS // RS):
                cp_async16(smem, so, src, go, 16)
                so += RS * LDS
                go += RS * sn
        else:
            for p in range((ROWS + RS - 1) // RS):
                if r + p * RS < ROWS:
                    if row < nvalid:
                        cp_async16(smem, so, src, go, 16)
                    else:
                        cp_async16(smem, so, src, base, 0)
                so += RS * LDS
                go += RS * sn
                row += RS


@device_function
def load_key_rows(smem, off, src, base, n0, nvalid, sn, ROWS, LDS, CH, tid, NT, table, tb,
                  page, psp, PAGED):
    """:func:`load_rows` for key and value tiles: rows through a block table where
    ``PAGED`` (compile-time; :func:`..device.seams.key_row`: row ``j`` is slot ``j % page``
    of page ``table[tb + j // page]``, ``base`` the head's offset): a tile inside one page
    (pages a multiple of the tile) is one :func:`load_rows` from the page's start, a tile
    across pages (small pages) looks up each row; else exactly :func:`load_rows`."""
    if not PAGED:
        load_rows(smem, off, src, base, n0, nvalid, sn, ROWS, LDS, CH, tid, NT)
        return
    p = n0 // page
    if (n0 + ROWS - 1) // page == p:  # the tile lies in one page: its rows as one block
        at = base + int64(table[tb + p]) * psp
        load_rows(smem, off, src, at, n0 - p * page, nvalid - p * page, sn, ROWS, LDS, CH,
                  tid, NT)
        return
    RS = NT // CH  # rows per pass
    r = tid // CH
    if r < RS:
        c8 = 8 * (tid - r * CH)
        for p in range((ROWS + RS - 1) // RS):
            rr = r + p * RS
            if rr < ROWS:
                so = off + rr * LDS + c8
                row = n0 + rr
                if row < nvalid:
                    cp_async16(smem, so, src, key_row(base, row, sn, table, tb, page, psp,
                                                      True) + c8, 16)
                else:
                    cp_async16(smem, so, src, base, 0)


@device_function
def mma(BF16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma m16n8k16 in the input dtype (``BF16`` is a compile-time constant after
    inlining). Kernels call this rather than capture the intrinsic in their closure: numba's
    disk cache pickles closure contents into its index key."""
    if BF16:
        return mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    return mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@device_function
def pack(BF16, lo, hi):
    """Two fp32 values rounded to the input dtype, in one register (``lo`` low)."""
    if BF16:
        return pack_bf16x2(lo, hi)
    return pack_f16x2(lo, hi)


@device_function
def mma_rows_rows(BF16, out, smem, a_off, b_off, LDS, KSTEPS, NTILES, lane):
    """``out = A Bᵀ`` for one warp: ``A`` is the 16 shared rows at ``a_off``, ``B`` the
    ``8 * NTILES`` shared rows at ``b_off``, both ``16 * KSTEPS`` elements long; ``out``
    holds ``4 * NTILES`` fp32 values (C fragments, n-tile by n-tile). ``NTILES`` is even."""
    arow = a_off + (lane & 15) * LDS + 8 * (lane >> 4)
    brow = b_off + ((lane & 7) + 8 * (lane >> 4)) * LDS + 8 * ((lane >> 3) & 1)
    for e in range(4 * NTILES):
        out[e] = float32(0.0)
    for kk in range(KSTEPS):
        a0, a1, a2, a3 = ldmatrix_x4(smem, arow + 16 * kk)
        for jp in range(NTILES // 2):
            # matrices 0, 1: k halves of n-tile 2jp; 2, 3: those of n-tile 2jp + 1
            r0, r1, r2, r3 = ldmatrix_x4(smem, brow + 16 * jp * LDS + 16 * kk)
            j = 8 * jp
            out[j], out[j + 1], out[j + 2], out[j + 3] = mma(
                BF16, a0, a1, a2, a3, r0, r1, out[j], out[j + 1], out[j + 2], out[j + 3])
            out[j + 4], out[j + 5], out[j + 6], out[j + 7] = mma(
                BF16, a0, a1, a2, a3, r2, r3, out[j + 4], out[j + 5], out[j + 6], out[j + 7])


@device_function
def mma_frags_rows(BF16, acc, p, smem, b_off, LDS, PSTEPS, DTILES, lane, MT, PST, AST):
    """``acc += P B`` for one warp and ``MT`` (1 or 2) m-tiles: P of m-tile ``mt`` is a 16 x
    ``16 * PSTEPS`` register tile (``p[mt * PST:]``: C fragments of ``2 * PSTEPS``
    n-tiles, rounded to the input dtype here), ``B`` the ``16 * PSTEPS`` shared rows at
    ``b_off`` of ``8 * DTILES`` elements ([k][n], read through ``ldmatrix.trans`` once for
    both m-tiles); m-tile ``mt`` accumulates into ``acc[mt * AST:]`` (``4 * DTILES`` fp32
    values). ``DTILES`` is even. Past 16 n-tiles (128 columns) the columns go in two
    blocks: NVVM leaves longer loops rolled, which would put ``acc`` in local memory."""
    if DTILES > 16:
        _mma_frags_cols(BF16, acc, 0, p, smem, b_off, LDS, PSTEPS, 16, lane, MT, PST, AST)
        _mma_frags_cols(BF16, acc, 64, p, smem, b_off + 128, LDS, PSTEPS, DTILES - 16,
                        lane, MT, PST, AST)
    else:
        _mma_frags_cols(BF16, acc, 0, p, smem, b_off, LDS, PSTEPS, DTILES, lane, MT, PST,
                        AST)


@device_function
def _mma_frags_cols(BF16, acc, AOFF, p, smem, b_off, LDS, PSTEPS, DTILES, lane, MT, PST,
                    AST):
    """:func:`mma_frags_rows` for ``DTILES`` n-tiles accumulated at ``acc[AOFF:]``."""
    brow = b_off + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LDS + 8 * (lane >> 4)
    for kk in range(PSTEPS):
        j = 8 * kk
        a0 = pack(BF16, p[j], p[j + 1])
        a1 = pack(BF16, p[j + 2], p[j + 3])
        a2 = pack(BF16, p[j + 4], p[j + 5])
        a3 = pack(BF16, p[j + 6], p[j + 7])
        e0, e1, e2, e3 = a0, a1, a2, a3
        if MT > 1:
            x = PST + j
            e0 = pack(BF16, p[x], p[x + 1])
            e1 = pack(BF16, p[x + 2], p[x + 3])
            e2 = pack(BF16, p[x + 4], p[x + 5])
            e3 = pack(BF16, p[x + 6], p[x + 7])
        for dp in range(DTILES // 2):
            # matrices 0, 1: k halves of n-tile 2dp; 2, 3: those of n-tile 2dp + 1
            r0, r1, r2, r3 = ldmatrix_x4_trans(smem, brow + 16 * kk * LDS + 16 * dp)
            c = AOFF + 8 * dp
            acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(
                BF16, a0, a1, a2, a3, r0, r1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
            acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(
                BF16, a0, a1, a2, a3, r2, r3, acc[c + 4], acc[c + 5], acc[c + 6],
                acc[c + 7])
            if MT > 1:
                c += AST
                acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(
                    BF16, e0, e1, e2, e3, r0, r1, acc[c], acc[c + 1], acc[c + 2],
                    acc[c + 3])
                acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(
                    BF16, e0, e1, e2, e3, r2, r3, acc[c + 4], acc[c + 5], acc[c + 6],
                    acc[c + 7])


@device_function
def store_frags(dst, base, r0, nvalid, sn, sd, acc, aoff, mul0, mul1, DTILES, tq):
    """Rows ``r0`` (scaled by ``mul0``) and ``r0 + 8`` (by ``mul1``) of the register tile
    at ``acc[aoff:]`` (``DTILES`` n-tiles) to ``dst[base + row * sn + col * sd]``, rows at
    or past ``nvalid`` skipped; each lane writes its own fragment elements (columns
    ``8 n + 2 tq``, ``+1``). In blocks of at most 16 n-tiles, as in :func:`mma_frags_rows`."""
    if DTILES > 16:
        _store_cols(dst, base, r0, nvalid, sn, sd, acc, aoff, mul0, mul1, 16, tq)
        _store_cols(dst, base + 128 * sd, r0, nvalid, sn, sd, acc, aoff + 64, mul0, mul1,
                    DTILES - 16, tq)
    else:
        _store_cols(dst, base, r0, nvalid, sn, sd, acc, aoff, mul0, mul1, DTILES, tq)


@device_function
def _store_cols(dst, base, r0, nvalid, sn, sd, acc, aoff, mul0, mul1, DTILES, tq):
    r1 = r0 + 8
    for dn in range(DTILES):
        d = 8 * dn + 2 * tq
        x = aoff + 4 * dn
        if r0 < nvalid:
            store_f32(dst, base + r0 * sn + d * sd, acc[x] * mul0)
            store_f32(dst, base + r0 * sn + (d + 1) * sd, acc[x + 1] * mul0)
        if r1 < nvalid:
            store_f32(dst, base + r1 * sn + d * sd, acc[x + 2] * mul1)
            store_f32(dst, base + r1 * sn + (d + 1) * sd, acc[x + 3] * mul1)
