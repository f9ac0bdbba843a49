"""Tensor-core backward kernels for fp16/bf16: ``attn_backward_dkdv_tc`` (key tiles outer,
query tiles inner) and ``attn_backward_dq_tc`` (query tiles outer, key tiles inner).

The same two-kernel, atomic-free design as the SIMT kernels (backward_kernels.py), whose
preprocess kernel (``delta = rowsum(dO * O)``) runs first and whose launch arguments these
kernels take unchanged. Every tile product runs on mma m16n8k16 with fp32 accumulators
(tile_product_tc.py), with the FlashAttention-2 partition: each warp owns 16 rows of the
block's tile and no two warps add into the same element.

dK/dV: one block per (key tile, batch * key/value head); warp ``w`` owns keys
``k0 + 16 w .. + 16``. Per query tile of ``block_n`` queries (under GQA, for every query
head of the group in turn; Q and dO double-buffered by ``cp.async``):

- ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (A from the shared K, V rows; B from the Q, dO rows);
- ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse · log2 e)`` with lse per query column (rows that see
  no key have lse −inf, read as +inf: P = 0) and ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``;
- ``dV += Pᵀ dO`` and ``dK += dSᵀ Q``: the fp32 Pᵀ and dSᵀ fragments, rounded to the input
  dtype, are the A operands as they stand (as P is in the forward); dO and Q are read as
  row-major B operands through ``ldmatrix.trans``.

At head dim 256, dK and dV (128 fp32 registers per lane each) do not both fit registers: the
kernel makes ``d_splits`` passes over the query steps, accumulating columns ``d0 .. d0 + D /
d_splits`` of dK and dV in each and recomputing Sᵀ and dPᵀ (6 products per tile pair
instead of 4 over two passes, still on tensor cores).

dQ: one block per (query tile, batch * query head), warp ``w`` owns 16 query rows; per key
tile (K and V double-buffered): ``S = Q Kᵀ``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP − delta)``,
``dQ += dS K``.

Each output element is summed by one lane in a fixed order: the gradients are bitwise
deterministic. Rows past the ends are zero-filled in shared memory; queries past Nq read lse
as +inf (P = 0); keys past Nk are masked in the dQ kernel (in the dK/dV kernel they only
reach rows of dK and dV that are never stored); the causal mask applies on tiles that cross
the diagonal only. Needs what the tensor-core forward needs (sm_80+, head dims 32/64/96/128/256,
16-byte aligned rows of q, k, v and dO with unit stride along the head dim).
"""
from __future__ import annotations

import math

from numba import cuda, float32, uint16

from ..device.constants import DENSE, EMPTY, LOG2E, PACKING, PARTIAL, SMEM_ALIGN
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import cp_async_commit, cp_async_wait
from ..device.prologue import block_tile, query_stats, split_heads
from ..device.seams import (
    alibi,
    class_query_range,
    distance,
    hides,
    packed_tile,
    query_range,
    sequence_rows,
    slope_of,
    softcap,
    tile_class,
    user_keeps,
    user_score_slope,
    visible,
    visited_keys,
    window_query_range,
)
from ..device.user_mods import kernel_mods
from ..tilings import PAD
from .fragments import load_rows, mma_frags_rows, mma_rows_rows, store_frags


@device_function
def capped(x, CAP, modr):
    """``(score, d score / d raw score)`` through the softcap (``CAP``, compile-time;
    ``modr`` holds the modifiers' constants in raw-score units: the cap, its reciprocal,
    the ALiBi slope): ``(cap tanh(x / cap), 1 - tanh^2)``, else ``(x, 1)``."""
    if CAP:
        return softcap(x, modr[0], modr[1], True)
    return x, float32(1.0)


@device_function
def chain(ds, g, CAP):
    """dS through the softcap: ``ds * g`` (``CAP``), else ``ds`` as it is."""
    if CAP:
        return ds * g
    return ds


@device_function
def dkdv_scores(s, dp, lse, delta, lofs, lsn, dofs, sl2, NTILES, CAP, modr, ALIBI, d0,
                SMOD, slope, margs, b, h, i0, j0, Nq, Nk):
    """``Pᵀ`` into ``s`` and ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)`` into ``dp`` for a query step
    that needs no mask (every query of it exists, none is above the diagonal): element
    ``(4 jn + 2 r + e)`` of this lane is query column ``8 jn + e`` past ``lofs`` (lse,
    stride ``lsn``) and ``dofs`` (delta). ``d0`` (``ALIBI``): the distance of this lane's
    first query from its first key. ``SMOD``: the user's score_mod and its derivative
    (``slope``) for query ``i0 + 8 jn + e`` and key ``j0 + 8 r``, as in
    :func:`dkdv_scores_masked`."""
    for jn in range(NTILES):
        for e in range(2):
            ls, dl = query_stats(lse, delta, lofs + (8 * jn + e) * lsn, dofs + 8 * jn + e,
                                 True)
            for r in range(2):
                x = 4 * jn + 2 * r + e
                sx, g = capped(s[x], CAP, modr)
                if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                    sx = alibi(sx, d0 + float32(8 * jn + e - 8 * r), modr[2])
                if SMOD:  # (compile-time) the user's score_mod and its derivative
                    sx, gu = user_score_slope(sx, b, h, i0 + 8 * jn + e, j0 + 8 * r, Nq, Nk,
                                              modr[3], float32(1.0) / modr[3], slope, margs)
                    g = g * gu
                p = math.exp2(sx * sl2 - ls)
                s[x] = p
                dp[x] = chain(p * (dp[x] - dl), g, CAP or SMOD)


@device_function
def dkdv_scores_masked(s, dp, lse, delta, lbase, lsn, dbase, m0, Nq, j0, causal_offset,
                       sl2, CAUSAL, LEFT, RIGHT, NTILES, tq, CAP, modr, ALIBI, SMOD, MMOD,
                       value, slope, keeps, margs, b, h, Nk):
    """:func:`dkdv_scores` for a diagonal, tail or PARTIAL (mask_mod) step: queries
    past ``Nq`` read lse as +inf (P = 0); keys ``j0``, ``j0 + 8`` that the mask (or the
    user's mask_mod ``keeps``, ``MMOD``) hides from query ``i`` get P = 0 (keys past ``Nk``
    need not: their dK/dV rows are not stored). ``SMOD``: the user's score_mod (``value``)
    and its derivative (``slope``) after the softcap and ALiBi."""
    d0 = distance(m0 + 2 * tq, j0, causal_offset)  # (ALIBI) this lane's first distance
    for jn in range(NTILES):
        for e in range(2):
            i = m0 + 8 * jn + 2 * tq + e  # this element's query
            ls, dl = query_stats(lse, delta, lbase + i * lsn, dbase + i, i < Nq)
            for r in range(2):  # keys j0 and j0 + 8
                x = 4 * jn + 2 * r + e
                j = j0 + 8 * r
                sx, g = capped(s[x], CAP, modr)
                if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                    sx = alibi(sx, d0 + float32(8 * jn + e - 8 * r), modr[2])
                if SMOD:  # (compile-time) the user's score_mod and its derivative
                    sx, gu = user_score_slope(sx, b, h, i, j, Nq, Nk, modr[3],
                                              float32(1.0) / modr[3], slope, margs)
                    g = g * gu
                p = math.exp2(sx * sl2 - ls)
                if hides(i, j, causal_offset, CAUSAL, LEFT, RIGHT) or (
                        MMOD and not user_keeps(b, h, i, j, Nq, Nk, keeps, margs)):
                    p = float32(0.0)
                    if SMOD:  # (compile-time) a hidden score's slope need not be finite
                        g = float32(0.0)
                s[x] = p
                dp[x] = chain(p * (dp[x] - dl), g, CAP or SMOD)


@device_function
def dq_scores(s, dp, base, ls, dl, sl2, NTILES, CAP, modr, ALIBI, d0, SMOD, slope, margs, b,
              h, i, jl, Nq, Nk):
    """``dS = P ∘ (dP − delta)`` into ``dp`` for one of this lane's rows (``base`` 0 or 2;
    its lse ``ls`` in the log2 domain and its ``dl``) on a tile that needs no mask; ``d0``
    (``ALIBI``): the row's distance from this lane's first key. ``SMOD``: the user's
    score_mod and its derivative (``slope``) for row ``i`` and key ``jl + 8 jn + e``, as in
    :func:`dq_scores_masked`."""
    for jn in range(NTILES):
        for e in range(2):
            x = base + 4 * jn + e
            sx, g = capped(s[x], CAP, modr)
            if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                sx = alibi(sx, d0 - float32(8 * jn + e), modr[2])
            if SMOD:  # (compile-time) the user's score_mod and its derivative
                sx, gu = user_score_slope(sx, b, h, i, jl + 8 * jn + e, Nq, Nk, modr[3],
                                          float32(1.0) / modr[3], slope, margs)
                g = g * gu
            dp[x] = chain(math.exp2(sx * sl2 - ls) * (dp[x] - dl), g, CAP or SMOD)


@device_function
def dq_scores_masked(s, dp, base, ls, dl, n0, Nk, i, causal_offset, sl2, CAUSAL, LEFT, RIGHT,
                     NTILES, tq, CAP, modr, ALIBI, SMOD, MMOD, value, slope, keeps, margs, b,
                     h, Nq):
    """:func:`dq_scores` on a diagonal, tail or PARTIAL (mask_mod) tile: keys past
    ``Nk``, hidden from row ``i`` by the mask or by the user's mask_mod get P = 0; the
    user's score_mod as in :func:`dkdv_scores_masked`."""
    for jn in range(NTILES):
        for e in range(2):
            j = n0 + 8 * jn + 2 * tq + e  # this element's key
            x = base + 4 * jn + e
            sx, g = capped(s[x], CAP, modr)
            if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                sx = alibi(sx, distance(i, n0 + 2 * tq, causal_offset) - float32(8 * jn + e),
                           modr[2])
            if SMOD:  # (compile-time) the user's score_mod and its derivative
                sx, gu = user_score_slope(sx, b, h, i, j, Nq, Nk, modr[3],
                                          float32(1.0) / modr[3], slope, margs)
                g = g * gu
            p = math.exp2(sx * sl2 - ls)
            if not visible(i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT) or (
                    MMOD and not user_keeps(b, h, i, j, Nq, Nk, keeps, margs)):
                p = float32(0.0)
                if SMOD:  # (compile-time) a hidden score's slope need not be finite
                    g = float32(0.0)
            dp[x] = chain(p * (dp[x] - dl), g, CAP or SMOD)


@device_function
def dkdv_pass(smem, q, do, lse, delta, dk, dv, dk_acc, dv_acc, s, dp, d0, b, hk, group,
              per_head, n_steps, m_begin, m_full, Nq, Nk, sb0, causal_offset, qb0, qsh, qsn,
              gb0, gsh, gsn, dkb0, dksh, dksn, dksd, dvb0, dvsh, dvsn, dvsd, lb0, lsh, lsn,
              j0, warp, lane, tq, tid, sl2, scale, BN, LDS, CH, NT, KSTEPS, NTILES, PSTEPS,
              DTILES, NACC, K_OFF, V_OFF, Q_OFF, DO_OFF, BUF, CAUSAL, BF16, m_last, LEFT, RIGHT,
              WINDOW, CAP, modr, ALIBI, slopes, ssb, ssh, SMOD, MMOD, value, slope, keeps,
              margs, k0, cls, csb, csh, csq, sstep):
    """One pass of the dK/dV kernel over every query step of its key tile (K and V are in
    shared memory or in flight; their copies complete with the first step's Q and dO,
    committed here; ``qb0``, ``gb0``, ``lb0``, ``dkb0``, ``dvb0``: the batch entry's offsets in
    Q, dO, lse, dK and dV, its rows' included; ``sb0 + h * sstep``: head ``h``'s first row of
    delta, :func:`..device.seams.stat_rows`): accumulates columns ``d0 .. d0 + 8 DTILES`` of dK and dV in ``dk_acc``,
    ``dv_acc`` (``NACC`` fp32 each; ``s``, ``dp`` hold a step's score tiles) and stores them."""
    if n_steps > 0:
        h = hk * group
        load_rows(smem, Q_OFF, q, qb0 + h * qsh, m_begin, Nq, qsn, BN, LDS, CH, tid, NT)
        load_rows(smem, DO_OFF, do, gb0 + h * gsh, m_begin, Nq, gsn, BN, LDS, CH, tid,
                  NT)
    cp_async_commit()
    for e in range(NACC):
        dk_acc[e] = float32(0.0)
        dv_acc[e] = float32(0.0)
    wrow = warp * 16 * LDS

    for it in range(n_steps):
        gi = it // per_head
        m0 = m_begin + (it - gi * per_head) * BN
        h = hk * group + gi
        cp_async_wait(0)  # Q, dO of step it
        cuda.syncthreads()
        # Every warp is past step it-1: its buffers take step it+1.
        if it + 1 < n_steps:
            gn = (it + 1) // per_head
            mn = m_begin + (it + 1 - gn * per_head) * BN
            hn = hk * group + gn
            nb = (1 - (it & 1)) * BUF
            load_rows(smem, Q_OFF + nb, q, qb0 + hn * qsh, mn, Nq, qsn, BN, LDS, CH, tid,
                      NT)
            load_rows(smem, DO_OFF + nb, do, gb0 + hn * gsh, mn, Nq, gsn, BN, LDS, CH,
                      tid, NT)
        cp_async_commit()
        qb = Q_OFF + (it & 1) * BUF
        gb = DO_OFF + (it & 1) * BUF

        partial = MMOD
        if MMOD:  # (compile-time) the step's class: an empty step is skipped (the next
            # step's wait and barrier cover the copies issued above)
            # (the block's keys: 16 per warp, NT // 2)
            cl = tile_class(cls, b * csb + h * csh, csq, m0, BN, Nq, k0, NT // 2, Nk)
            if cl == EMPTY:
                continue
            partial = cl == PARTIAL
        mma_rows_rows(BF16, s, smem, K_OFF + wrow, qb, LDS, KSTEPS, NTILES, lane)
        mma_rows_rows(BF16, dp, smem, V_OFF + wrow, gb, LDS, KSTEPS, NTILES, lane)

        lbase = lb0 + h * lsh
        dbase = sb0 + h * sstep
        if ALIBI:  # (compile-time) this step's query head's slope, in raw-score units
            modr = (modr[0], modr[1], slope_of(slopes, b, h, ssb, ssh, modr[3], ALIBI), modr[3])
        edge = CAUSAL and m0 < m_full
        if WINDOW:  # (compile-time) rows that miss some of our keys, left or right
            edge = m0 < m_full or m0 + BN - 1 > m_last
        if partial or edge or m0 + BN > Nq:  # a diagonal, edge or tail step
            dkdv_scores_masked(s, dp, lse, delta, lbase, lsn, dbase, m0, Nq, j0,
                               causal_offset, sl2, CAUSAL, LEFT, RIGHT, NTILES, tq, CAP, modr,
                               ALIBI, SMOD, partial, value, slope, keeps, margs, b, h,
                               Nk)
        else:
            dkdv_scores(s, dp, lse, delta, lbase + (m0 + 2 * tq) * lsn, lsn,
                        dbase + m0 + 2 * tq, sl2, NTILES, CAP, modr, ALIBI,
                        distance(m0 + 2 * tq, j0, causal_offset), SMOD, slope, margs, b, h,
                        m0 + 2 * tq, j0, Nq, Nk)

        mma_frags_rows(BF16, dv_acc, s, smem, gb + d0, LDS, PSTEPS, DTILES, lane, 1, 0, 0)
        mma_frags_rows(BF16, dk_acc, dp, smem, qb + d0, LDS, PSTEPS, DTILES, lane, 1, 0, 0)
    cp_async_wait(0)

    sc = float32(scale)
    one = float32(1.0)
    store_frags(dk, dkb0 + hk * dksh + d0 * dksd, j0, Nk, dksn, dksd, dk_acc, 0, sc, sc,
                DTILES, tq)
    store_frags(dv, dvb0 + hk * dvsh + d0 * dvsd, j0, Nk, dvsn, dvsd, dv_acc, 0, one, one,
                DTILES, tq)


def _sizes(v):
    """The compile-time constants both kernels of variant ``v`` share."""
    head_dim, t, causal, dtype = v.head_dim, v.tiles, v.causal, v.dtype
    if head_dim % 16:
        raise ValueError(f"{head_dim=} must be a multiple of 16 for the tensor-core kernels")
    if t.m_tiles != 1:
        raise ValueError(f"the backward kernels take m_tiles=1, not {t}")
    if head_dim % (16 * t.d_splits):
        raise ValueError(f"{head_dim=} does not split into {t.d_splits} passes of whole "
                         "16-column steps")
    D = head_dim
    DOUT = D // t.d_splits  # output columns per pass (dK/dV: per column pass)
    return (t.block_m, t.block_n, t.threads, D + PAD, D // 8, D // 16, t.block_n // 8,
            t.block_n // 16, DOUT // 8, 4 * (DOUT // 8), 4 * (t.block_n // 8), bool(causal),
            dtype == "bfloat16")


def make_attn_backward_dkdv_tc(v):
    """dK, dV of variant ``v``: one key tile of ``t.block_m`` keys per block, query steps
    of ``t.block_n`` (tilings.TCTiles)."""
    head_dim, t = v.head_dim, v.tiles
    # (rows per block, steps, threads, row stride, 16-byte chunks, k-steps, n-tiles of the
    # scores, k-steps of the second product, n-tiles of the output, register fragments)
    (BM, BN, NT, LDS, CH, KSTEPS, NTILES, PSTEPS, DTILES, NACC, NS, CAUSAL,
     BF16) = _sizes(v)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap c: raw scores s -> (c / scale) tanh(s scale / c)
    CAP_C = float32(v.softcap) if CAP else float32(1.0)
    ALIBI = v.alibi  # slopes in raw-score units here: slope / scale
    SMOD, MMOD, VIEWS, VALUE, SLOPE, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    PACKED = PACKING[v.packed]  # dense or varlen rows (device/seams.sequence)
    SPLITS = t.d_splits
    DOUT = head_dim // SPLITS  # dK, dV columns per pass (DTILES, NACC count these)
    K_OFF = 0
    V_OFF = BM * LDS
    Q_OFF = 2 * BM * LDS
    DO_OFF = Q_OFF + 2 * BN * LDS
    BUF = BN * LDS

    def attn_backward_dkdv_tc(q, k, v, do, lse, delta, dk, dv, Nq, Nk, Hq, Hkv, group,
                              causal_offset, qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                              vsb, vsh, vsn, vsd, gsb, gsh, gsn, gsd,
                              dksb, dksh, dksn, dksd, dvsb, dvsh, dvsn, dvsd,
                              lsb, lsh, lsn, scale, slopes, ssb, ssh, m0, m1, m2, m3, e0, e1,
                              e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15,
                              cls, csb, csh, csq, cu_q, cu_k, seqk, table, tsb, page, psp, TQ,
                              chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        # (causal: heaviest first; the first key tile is seen by the most queries)
        kt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, False, 0)
        b, hk, _ = split_heads(bh, Hkv, 1)
        b, kt = packed_tile(b, kt, cu_k, nseq, BM, cuda.threadIdx.x & 31,
                            True, PACKED)
        k0 = kt * BM
        # this batch entry's rows (varlen: its sequence's) and where they start
        q_row0, k_row0, Nq, Nk, causal_offset, sb0, sstep = sequence_rows(
            b, 0, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and k0 >= Nk:  # (compile-time test first) past the sequence
            return
        sl2 = float32(scale * LOG2E)
        # the cap in raw-score units and its reciprocal (used where CAP), the ALiBi slope
        # (set per query head where ALIBI) and the factor to raw-score units
        modr = (CAP_C / float32(scale), float32(scale) / CAP_C, float32(0.0),
                float32(1.0) / float32(scale))
        kbase = b * ksb + hk * ksh + k_row0 * ksn
        vbase = b * vsb + hk * vsh + k_row0 * vsn
        qb0 = b * qsb + q_row0 * qsn
        gb0 = b * gsb + q_row0 * gsn
        lb0 = b * lsb + q_row0 * lsn
        dkb0 = b * dksb + k_row0 * dksn
        dvb0 = b * dvsb + k_row0 * dvsn
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))

        # Query tiles before m_begin see none of our keys; from m_full on, all (no mask).
        m_begin, m_full = query_range(k0, BM, BN, causal_offset, CAUSAL)
        m_end = Nq
        m_last = Nq
        if WINDOW:  # (compile-time) the window also ends the rows that see our keys
            m_begin, m_end, m_full, m_last = window_query_range(k0, BM, BN, Nq, causal_offset,
                                                                CAUSAL, LEFT, RIGHT)
        if MMOD:  # (compile-time) only the query tiles the group's classes leave
            m_begin, m_end = class_query_range(cls, b * csb + hk * group * csh, csh, group,
                                               csq, k0, BM, Nq, Nk, BN, m_begin, m_end)
        per_head = (m_end - m_begin + BN - 1) // BN if m_end > m_begin else 0
        n_steps = group * per_head

        load_rows(smem, K_OFF, k, kbase, k0, Nk, ksn, BM, LDS, CH, tid, NT)
        load_rows(smem, V_OFF, v, vbase, k0, Nk, vsn, BM, LDS, CH, tid, NT)

        j0 = k0 + warp * 16 + g  # this lane's two keys: j0, j0 + 8
        dk_acc = cuda.local.array(NACC, float32)
        dv_acc = cuda.local.array(NACC, float32)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        # dK, dV columns 0 .. DOUT; at head dim 256 a second pass takes DOUT .. 2 DOUT
        # (written out, not as a loop: a loop around the pass, even of one trip, costs the
        # single-pass kernels registers and spills)
        dkdv_pass(smem, q, do, lse, delta, dk, dv, dk_acc, dv_acc, s, dp, 0, b, hk, group,
                  per_head, n_steps, m_begin, m_full, Nq, Nk, sb0, causal_offset, qb0, qsh, qsn,
                  gb0, gsh, gsn, dkb0, dksh, dksn, dksd, dvb0, dvsh, dvsn, dvsd, lb0, lsh, lsn,
                  j0, warp, lane, tq, tid, sl2, scale, BN, LDS, CH, NT, KSTEPS, NTILES, PSTEPS,
                  DTILES, NACC, K_OFF, V_OFF, Q_OFF, DO_OFF, BUF, CAUSAL, BF16, m_last, LEFT,
                  RIGHT, WINDOW, CAP, modr, ALIBI, slopes, ssb, ssh, SMOD, MMOD, VALUE, SLOPE,
                  KEEPS, margs, k0, cls, csb, csh, csq, sstep)
        if SPLITS > 1:
            cuda.syncthreads()  # every warp is done with the first pass's Q, dO buffers
            dkdv_pass(smem, q, do, lse, delta, dk, dv, dk_acc, dv_acc, s, dp, DOUT, b, hk,
                      group, per_head, n_steps, m_begin, m_full, Nq, Nk, sb0, causal_offset,
                      qb0, qsh, qsn, gb0, gsh, gsn, dkb0, dksh, dksn, dksd, dvb0, dvsh, dvsn,
                      dvsd, lb0, lsh, lsn, j0, warp, lane, tq, tid, sl2, scale, BN, LDS, CH,
                      NT, KSTEPS, NTILES, PSTEPS, DTILES, NACC, K_OFF, V_OFF, Q_OFF, DO_OFF,
                      BUF, CAUSAL, BF16, m_last, LEFT, RIGHT, WINDOW, CAP, modr, ALIBI, slopes,
                      ssb, ssh, SMOD, MMOD, VALUE, SLOPE, KEEPS, margs, k0, cls, csb, csh, csq,
                      sstep)

    attn_backward_dkdv_tc.__qualname__ = v.tag
    return attn_backward_dkdv_tc


def make_attn_backward_dq_tc(v):
    """dQ of variant ``v``: one query tile of ``t.block_m`` rows per block, key steps of
    ``t.block_n``."""
    t = v.tiles
    # (rows per block, steps, threads, row stride, 16-byte chunks, k-steps, n-tiles of the
    # scores, k-steps of the second product, n-tiles of the output, register fragments)
    (BM, BN, NT, LDS, CH, KSTEPS, NTILES, PSTEPS, DTILES, NACC, NS, CAUSAL,
     BF16) = _sizes(v)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap c: raw scores s -> (c / scale) tanh(s scale / c)
    CAP_C = float32(v.softcap) if CAP else float32(1.0)
    ALIBI = v.alibi  # slopes in raw-score units here: slope / scale
    SMOD, MMOD, VIEWS, VALUE, SLOPE, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    PACKED = PACKING[v.packed]  # dense or varlen rows (device/seams.sequence)
    if t.d_splits != 1:
        raise ValueError(f"the dQ kernel takes d_splits=1, not {t}")
    Q_OFF = 0
    DO_OFF = BM * LDS
    K_OFF = 2 * BM * LDS
    V_OFF = K_OFF + 2 * BN * LDS
    BUF = BN * LDS

    def attn_backward_dq_tc(q, k, v, do, lse, delta, dq, Nq, Nk, Hq, group, causal_offset,
                            qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd, vsb, vsh, vsn, vsd,
                            gsb, gsh, gsn, gsd, dqsb, dqsh, dqsn, dqsd, lsb, lsh, lsn, scale,
                            slopes, ssb, ssh, m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7,
                            e8, e9, e10, e11, e12, e13, e14, e15, cls, csb, csh, csq, cu_q,
                            cu_k, seqk, table, tsb, page, psp, TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        # (causal: heaviest first; the last query tile sees the most keys)
        qt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, True, 0)
        b, h, hk = split_heads(bh, Hq, group)
        b, qt = packed_tile(b, qt, cu_q, nseq, BM, cuda.threadIdx.x & 31,
                            True, PACKED)
        q0 = qt * BM
        # this batch entry's rows (varlen: its sequence's) and where they start
        q_row0, k_row0, Nq, Nk, causal_offset, srow, _ = sequence_rows(
            b, h, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        sl2 = float32(scale * LOG2E)
        # the cap in raw-score units and its reciprocal (used where CAP), the ALiBi slope
        # (set per query head where ALIBI) and the factor to raw-score units
        modr = (CAP_C / float32(scale), float32(scale) / CAP_C, float32(0.0),
                float32(1.0) / float32(scale))
        if ALIBI:  # (compile-time) this query head's slope, in raw-score units
            modr = (modr[0], modr[1], slope_of(slopes, b, h, ssb, ssh, modr[3], ALIBI), modr[3])
        kbase = b * ksb + hk * ksh + k_row0 * ksn
        vbase = b * vsb + hk * vsh + k_row0 * vsn
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        cbase = b * csb + h * csh  # (MMOD) this head's tile classes

        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)
        n_tiles = (n_end + BN - 1) // BN  # (n_begin is 0 here: plain variants keep this)
        if WINDOW or MMOD:  # (compile-time)
            n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0

        load_rows(smem, Q_OFF, q, b * qsb + h * qsh + q_row0 * qsn, q0, Nq, qsn, BM, LDS, CH,
                  tid, NT)
        load_rows(smem, DO_OFF, do, b * gsb + h * gsh + q_row0 * gsn, q0, Nq, gsn, BM, LDS, CH,
                  tid, NT)
        if n_tiles > 0:
            load_rows(smem, K_OFF, k, kbase, n_begin, Nk, ksn, BN, LDS, CH, tid, NT)
            load_rows(smem, V_OFF, v, vbase, n_begin, Nk, vsn, BN, LDS, CH, tid, NT)
        cp_async_commit()

        i0 = q0 + warp * 16 + g  # this lane's two rows: i0, i0 + 8
        i1 = i0 + 8
        lbase = b * lsb + h * lsh + q_row0 * lsn
        ls0, dl0 = query_stats(lse, delta, lbase + i0 * lsn, srow + i0, i0 < Nq)
        ls1, dl1 = query_stats(lse, delta, lbase + i1 * lsn, srow + i1, i1 < Nq)

        acc = cuda.local.array(NACC, float32)
        for e in range(4 * DTILES):
            acc[e] = float32(0.0)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        wrow = warp * 16 * LDS

        for it in range(n_tiles):
            n0 = n_begin + it * BN
            cp_async_wait(0)  # K, V of tile it
            cuda.syncthreads()
            if it + 1 < n_tiles:
                nb = (1 - (it & 1)) * BUF
                load_rows(smem, K_OFF + nb, k, kbase, n0 + BN, Nk, ksn, BN, LDS, CH, tid, NT)
                load_rows(smem, V_OFF + nb, v, vbase, n0 + BN, Nk, vsn, BN, LDS, CH, tid, NT)
            cp_async_commit()
            kb = K_OFF + (it & 1) * BUF
            vb = V_OFF + (it & 1) * BUF

            partial = MMOD
            if MMOD:  # (compile-time) the tile's class: an empty tile is skipped (as in
                # the dK/dV pass)
                cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                if cl == EMPTY:
                    continue
                partial = cl == PARTIAL
            mma_rows_rows(BF16, s, smem, Q_OFF + wrow, kb, LDS, KSTEPS, NTILES, lane)
            mma_rows_rows(BF16, dp, smem, DO_OFF + wrow, vb, LDS, KSTEPS, NTILES, lane)

            # Zero K rows past the end give S = 0, whose P may overflow: mask them too.
            # a diagonal, edge or tail tile, or a PARTIAL one of a mask_mod
            if partial or n0 + BN > n_full or (WINDOW and n0 < n_lo):
                dq_scores_masked(s, dp, 0, ls0, dl0, n0, Nk, i0, causal_offset, sl2,
                                 CAUSAL, LEFT, RIGHT, NTILES, tq, CAP, modr, ALIBI, SMOD,
                                 partial, VALUE, SLOPE, KEEPS, margs, b, h, Nq)
                dq_scores_masked(s, dp, 2, ls1, dl1, n0, Nk, i1, causal_offset, sl2,
                                 CAUSAL, LEFT, RIGHT, NTILES, tq, CAP, modr, ALIBI, SMOD,
                                 partial, VALUE, SLOPE, KEEPS, margs, b, h, Nq)
            else:
                d0 = distance(i0, n0 + 2 * tq, causal_offset)  # (used where ALIBI)
                dq_scores(s, dp, 0, ls0, dl0, sl2, NTILES, CAP, modr, ALIBI, d0, SMOD, SLOPE,
                          margs, b, h, i0, n0 + 2 * tq, Nq, Nk)
                dq_scores(s, dp, 2, ls1, dl1, sl2, NTILES, CAP, modr, ALIBI, d0 + float32(8),
                          SMOD, SLOPE, margs, b, h, i1, n0 + 2 * tq, Nq, Nk)

            mma_frags_rows(BF16, acc, dp, smem, kb, LDS, PSTEPS, DTILES, lane, 1, 0, 0)
        cp_async_wait(0)

        sc = float32(scale)
        store_frags(dq, b * dqsb + h * dqsh + q_row0 * dqsn, i0, Nq, dqsn, dqsd, acc, 0, sc, sc, DTILES, tq)

    attn_backward_dq_tc.__qualname__ = v.tag
    return attn_backward_dq_tc
