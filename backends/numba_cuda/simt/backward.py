"""Backward kernels: ``attn_backward_preprocess`` (``delta = rowsum(dO * O)``), then
``attn_backward_dkdv`` (key tiles outer, query tiles inner) and ``attn_backward_dq``
(query tiles outer, key tiles inner).

Both passes recompute ``P = exp(S - lse)`` tile by tile (in base 2: the resident operand of
``S``, K in the dK/dV pass and Q in the dQ pass, is pre-multiplied by ``scale * log2(e)``,
and lse by ``log2(e)``) and use ``dS = P * (dP - delta)``. With a streaming tiling
(``tiles.streams``: fp32 inputs with 16-byte aligned rows on sm_80+), the streamed tiles
(Q and dO, or K and V) arrive by ``cp.async`` one tile ahead into a second stage of shared
memory, stored as rows (``tiles.b_tile``). Each output element is owned by exactly one
thread of one block, which sums its terms in a fixed order: no atomics, so the gradients
are bitwise deterministic. Under GQA a dK/dV block loops over
all query heads of its key/value head.

Rows that see no key have ``lse = -inf``; they are read as ``+inf`` so that ``P = 0`` and
they contribute nothing. Rows and columns past the ends are zero in shared memory; only the
causal mask and, in the dQ pass, the end of the keys need explicit masks (rows of dK and dV
past the end are never stored).
"""
from __future__ import annotations

import math

from numba import cuda, float32

from .. import tilings as _tiles
from ..device.constants import DENSE, EMPTY, LOG2E, PACKING, PARTIAL, SMEM_ALIGN
from ..device.convert import dot16, load_f32, smem_pointer, store_f32
from ..device.intrinsics import cp_async_commit, cp_async_wait, shfl_xor_f32
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
from .forward import copy_rows, load_tile_t
from .tile_product import column, tile_product


def make_attn_backward_preprocess(v):
    """delta = rowsum(dO * O) for variant ``v`` (``v.tiles``: a tilings.RowTiles):
    ``LANES`` consecutive lanes per row, each taking ``VEC`` consecutive elements per step
    (16 bytes of a vector tiling), then a shuffle sum. With ``vec`` (launch_args checks that
    both arrays' rows are contiguous and 16-byte aligned) a step is one 16-byte load of O
    and one of dO (``dot16``); otherwise ``VEC`` scalar loads at the rows' strides, the same
    elements in the same order (the two may round differently in the last bits: the
    compiler contracts each form's products and sums into FMAs its own way). The scalar form with a warp per row (each lane 2
    bytes per load) ran at 1.4 TB/s on an H200, 0.166 ms of a 2.5 ms varlen backward."""
    D = v.head_dim
    LANES = v.tiles.lanes
    ROWS = v.tiles.block_m  # rows per block
    VEC = v.tiles.elements(v.dtype)
    VECTOR = v.tiles.vector and D % VEC == 0  # (else every row by scalar loads)
    STEPS = (D + LANES * VEC - 1) // (LANES * VEC)  # steps per lane

    def attn_backward_preprocess(o, do, delta, Nq, Hq, osb, osh, osn, osd,
                                 gsb, gsh, gsn, gsd, vec):
        """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d], LANES lanes per row."""
        lane = cuda.threadIdx.x % LANES
        i = cuda.blockIdx.x * ROWS + cuda.threadIdx.x // LANES
        bh = cuda.blockIdx.y
        b = bh // Hq
        h = bh - b * Hq
        acc = float32(0.0)
        if i < Nq:
            ob = b * osb + h * osh + i * osn
            gb = b * gsb + h * gsh + i * gsn
            if VECTOR and vec:
                for c in range(STEPS):
                    d = (c * LANES + lane) * VEC
                    if d < D:
                        acc += dot16(o, ob + d, do, gb + d)
            else:
                for c in range(STEPS):
                    for e in range(VEC):
                        d = (c * LANES + lane) * VEC + e
                        if d < D:
                            acc += load_f32(o[ob + d * osd]) * load_f32(do[gb + d * gsd])
        m = LANES >> 1
        while m:  # (every lane of the warp shuffles, rows past Nq too)
            acc += shfl_xor_f32(acc, m)
            m >>= 1
        if lane == 0 and i < Nq:
            delta[bh * Nq + i] = acc

    attn_backward_preprocess.__qualname__ = v.tag
    return attn_backward_preprocess


def make_attn_backward_dkdv(v):
    """dK, dV for one key tile of ``t.block_m`` keys per block; query tiles of ``t.block_n``
    (``v.streamed``: Q and dO by cp.async, one tile ahead)."""
    head_dim, t = v.head_dim, v.tiles
    D = head_dim
    DP = t.dpad(D)
    BM, BN, TR, TC, RM, RN = t.block_m, t.block_n, t.rows, t.cols, t.rm, t.rn
    KU = t.k_unroll  # k steps per trip of the products (tile_product.k_step)
    RD = DP // TC
    NT = TR * TC
    XB = 4 * RN  # B words a thread holds: 4 per column where B is read along k
    ASYNC = bool(v.streamed)
    lay = _tiles.dkdv_layout(t, D, ASYNC)
    LDK, LDP = lay["LDK"], lay["LDP"]  # K, V [d][key]
    QJ, QD = lay["QJ"], lay["QD"]  # Q, dO: strides along queries and along d
    K_OFF, V_OFF, Q_OFF, DO_OFF = lay["K"], lay["V"], lay["Q"], lay["DO"]
    P_OFF, DS_OFF, LS_OFF, DL_OFF = lay["P"], lay["DS"], lay["LS"], lay["DL"]  # [query][key]
    STAGE = lay["STAGE"]
    ONE_PS = DS_OFF == P_OFF  # (t.one_ps_buffer) P and dS take turns in one buffer
    CAUSAL = bool(v.causal)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap in log2 units (scores carry scale * log2 e)
    CAP_L2 = float32(v.softcap * LOG2E) if CAP else float32(1.0)
    CAP_INV = float32(1.0 / (v.softcap * LOG2E)) if CAP else float32(1.0)
    ALIBI = v.alibi  # slopes in log2 units here: slope log2(e)
    SMOD, MMOD, VIEWS, VALUE, SLOPE, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    PACKED = PACKING[v.packed]  # dense or varlen rows (device/seams.sequence)
    GRAD = CAP or SMOD  # dS takes a factor
    APPROX = v.dtype != "float32"  # tanh.approx where the inputs are 16-bit

    def attn_backward_dkdv(q, k, v, do, lse, delta, dk, dv, Nq, Nk, Hq, Hkv, group,
                           causal_offset, qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                           vsb, vsh, vsn, vsd, gsb, gsh, gsn, gsd,
                           dksb, dksh, dksn, dksd, dvsb, dvsh, dvsn, dvsd,
                           lsb, lsh, lsn, scale, slopes, ssb, ssh, m0, m1, m2, m3, e0, e1, e2,
                           e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15, cls, csb,
                           csh, csq, cu_q, cu_k, seqk, table, tsb, page, psp,
                           TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, float32, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        tr = tid // TC
        tc = tid - tr * TC
        # (causal: heaviest first; the first key tile is seen by the most queries)
        kt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, False, 0)
        b, hk, _ = split_heads(bh, Hkv, 1)
        b, kt = packed_tile(b, kt, cu_k, nseq, BM, cuda.threadIdx.x & 31,
                            NT % 32 == 0, PACKED)
        k0 = kt * BM
        # this batch entry's rows (varlen: its sequence's) and where they start
        q_row0, k_row0, Nq, Nk, causal_offset, sb0, sstep = sequence_rows(
            b, 0, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and k0 >= Nk:  # (compile-time test first) past the sequence
            return
        qb0 = b * qsb + q_row0 * qsn
        gb0 = b * gsb + q_row0 * gsn
        lb0 = b * lsb + q_row0 * lsn
        kb0 = b * ksb + k_row0 * ksn
        vb0 = b * vsb + k_row0 * vsn
        dkb0 = b * dksb + k_row0 * dksn
        dvb0 = b * dvsb + k_row0 * dvsn
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        sl2 = float32(scale * LOG2E)
        kbase = kb0 + hk * ksh
        vbase = vb0 + hk * vsh
        load_tile_t(smem, K_OFF, LDK, k, kbase, k0, Nk, ksn, ksd, BM, D, DP, sl2, tid, NT)
        load_tile_t(smem, V_OFF, LDK, v, vbase, k0, Nk, vsn, vsd, BM, D, DP, float32(1.0),
                    tid, NT)

        s = cuda.local.array((RM, RN), float32)
        dp = cuda.local.array((RM, RN), float32)
        dk_acc = cuda.local.array((RM, RD), float32)
        dv_acc = cuda.local.array((RM, RD), float32)
        xa = cuda.local.array(RM, float32)
        xb = cuda.local.array(XB, float32)
        xd = cuda.local.array(RD, float32)
        for a in range(RM):
            for dd in range(RD):
                dk_acc[a, dd] = float32(0.0)
                dv_acc[a, dd] = float32(0.0)

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
        # One step per (query head of the group, query tile), in that order.
        n_m = (m_end - m_begin + BN - 1) // BN if m_end > m_begin else 0
        steps = group * n_m
        if ASYNC and steps > 0:
            h = hk * group
            copy_rows(smem, Q_OFF, QJ, q, qb0 + h * qsh, m_begin, Nq, qsn, BN, D, DP,
                      tid, NT)
            copy_rows(smem, DO_OFF, QJ, do, gb0 + h * gsh, m_begin, Nq, gsn, BN, D, DP,
                      tid, NT)
            cp_async_commit()

        for it in range(steps):
            g = it // n_m
            m0 = m_begin + (it - g * n_m) * BN
            h = hk * group + g
            slope = slope_of(slopes, b, h, ssb, ssh, float32(LOG2E), ALIBI)
            qbase = qb0 + h * qsh
            gbase = gb0 + h * gsh
            lbase = lb0 + h * lsh
            q_off = Q_OFF
            do_off = DO_OFF
            if ASYNC:
                stage = it & 1
                q_off += stage * STAGE
                do_off += stage * STAGE
                if it + 1 < steps:  # the next step's Q and dO into the other stage
                    g2 = (it + 1) // n_m
                    m2 = m_begin + (it + 1 - g2 * n_m) * BN
                    h2 = hk * group + g2
                    copy_rows(smem, q_off + STAGE - 2 * stage * STAGE, QJ, q,
                              qb0 + h2 * qsh, m2, Nq, qsn, BN, D, DP, tid, NT)
                    copy_rows(smem, do_off + STAGE - 2 * stage * STAGE, QJ, do,
                              gb0 + h2 * gsh, m2, Nq, gsn, BN, D, DP, tid, NT)
                cp_async_commit()
                cp_async_wait(1)  # this step's Q and dO
            else:
                load_tile_t(smem, Q_OFF, QD, q, qbase, m0, Nq, qsn, qsd, BN, D, DP,
                            float32(1.0), tid, NT)
                load_tile_t(smem, DO_OFF, QD, do, gbase, m0, Nq, gsn, gsd, BN, D, DP,
                            float32(1.0), tid, NT)
            for e in range(tid, BN, NT):
                i = m0 + e
                ls, dl = query_stats(lse, delta, lbase + i * lsn, sb0 + h * sstep + i,
                                     i < Nq)
                smem[LS_OFF + e] = ls
                smem[DL_OFF + e] = dl
            cuda.syncthreads()
            for a in range(RM):
                for bb in range(RN):
                    s[a, bb] = float32(0.0)
                    dp[a, bb] = float32(0.0)
            # the step's class under a mask_mod: an empty step has P = 0 (its products
            # skipped), a full one takes no mask_mod
            live = True
            partial = MMOD
            if MMOD:  # (compile-time)
                cl = tile_class(cls, b * csb + h * csh, csq, m0, BN, Nq, k0, BM, Nk)
                live = cl != EMPTY
                partial = cl == PARTIAL
            if live:
                tile_product(s, xa, xb, smem, K_OFF, LDK, q_off, QD, QJ, DP, tr, tc, RM, RN,
                             TC, KU)
                tile_product(dp, xa, xb, smem, V_OFF, LDK, do_off, QD, QJ, DP, tr, tc, RM, RN,
                             TC, KU)
            masked = CAUSAL and m0 < m_full
            if WINDOW:
                masked = m0 < m_full or m0 + BN - 1 > m_last
            for bb in range(RN):
                col = tc + TC * bb
                ls = smem[LS_OFF + col]
                dl = smem[DL_OFF + col]
                i = m0 + col
                for a in range(RM):
                    row = tr * RM + a
                    x = s[a, bb]
                    g = float32(1.0)
                    if CAP:  # (compile-time) through the softcap: dS times 1 - tanh^2
                        x, g = softcap(x, CAP_L2, CAP_INV, APPROX)
                    if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                        x = alibi(x, distance(i, k0 + row, causal_offset), slope)
                    if SMOD:  # (compile-time) the user's score_mod and its derivative
                        x, gu = user_score_slope(x, b, h, i, k0 + row, Nq, Nk, float32(LOG2E),
                                                 float32(1.0 / LOG2E), SLOPE, margs)
                        g *= gu
                    p = math.exp2(x - ls)
                    if not live or (masked and hides(i, k0 + row, causal_offset, CAUSAL, LEFT,
                                                     RIGHT)) or (
                            partial and not user_keeps(b, h, i, k0 + row, Nq, Nk, KEEPS, margs)):
                        p = float32(0.0)
                        if SMOD:  # (compile-time) a hidden score's slope need not be finite
                            g = float32(0.0)
                    smem[P_OFF + col * LDP + row] = p
                    ds = p * (dp[a, bb] - dl)
                    if GRAD:
                        ds *= g
                    if ONE_PS:  # dS waits in registers until P V has been read
                        dp[a, bb] = ds
                    else:
                        smem[DS_OFF + col * LDP + row] = ds
            cuda.syncthreads()
            if live:  # (an empty step adds nothing)
                tile_product(dv_acc, xa, xd, smem, P_OFF, LDP, do_off, QJ, QD, BN, tr, tc,
                             RM, RD, TC, KU)
            if ONE_PS:
                cuda.syncthreads()
                for bb in range(RN):
                    for a in range(RM):
                        smem[DS_OFF + (tc + TC * bb) * LDP + tr * RM + a] = dp[a, bb]
                cuda.syncthreads()
            if live:
                tile_product(dk_acc, xa, xd, smem, DS_OFF, LDP, q_off, QJ, QD, BN, tr, tc,
                             RM, RD, TC, KU)
            cuda.syncthreads()
        if ASYNC:
            cp_async_wait(0)

        dkbase = dkb0 + hk * dksh
        dvbase = dvb0 + hk * dvsh
        for a in range(RM):
            j = k0 + tr * RM + a
            if j < Nk:
                for dd in range(RD):
                    d = column(tc, dd, QJ, QD, RD, TC)
                    if d < D:
                        store_f32(dk, dkbase + j * dksn + d * dksd,
                                  dk_acc[a, dd] * float32(scale))
                        store_f32(dv, dvbase + j * dvsn + d * dvsd, dv_acc[a, dd])

    attn_backward_dkdv.__qualname__ = v.tag
    return attn_backward_dkdv


def make_attn_backward_dq(v):
    """dQ for one query tile of ``t.block_m`` rows per block; key tiles of ``t.block_n``
    (``v.streamed``: K and V by cp.async, one tile ahead)."""
    head_dim, t = v.head_dim, v.tiles
    D = head_dim
    DP = t.dpad(D)
    BM, BN, TR, TC, RM, RN = t.block_m, t.block_n, t.rows, t.cols, t.rm, t.rn
    KU = t.k_unroll  # k steps per trip of the products (tile_product.k_step)
    RD = DP // TC
    NT = TR * TC
    XB = 4 * RN  # B words a thread holds: 4 per column where B is read along k
    ASYNC = bool(v.streamed)
    lay = _tiles.dq_layout(t, D, ASYNC)
    LDQ, LDP = lay["LDQ"], lay["LDP"]  # Q, dO [d][query]
    KJ, KD = lay["KJ"], lay["KD"]  # K, V: strides along keys and along d
    Q_OFF, DO_OFF, K_OFF, V_OFF, DS_OFF = lay["Q"], lay["DO"], lay["K"], lay["V"], lay["DS"]
    STAGE = lay["STAGE"]
    CAUSAL = bool(v.causal)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap in log2 units (scores carry scale * log2 e)
    CAP_L2 = float32(v.softcap * LOG2E) if CAP else float32(1.0)
    CAP_INV = float32(1.0 / (v.softcap * LOG2E)) if CAP else float32(1.0)
    ALIBI = v.alibi  # slopes in log2 units here: slope log2(e)
    SMOD, MMOD, VIEWS, VALUE, SLOPE, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    PACKED = PACKING[v.packed]  # dense or varlen rows (device/seams.sequence)
    GRAD = CAP or SMOD  # dS takes a factor
    APPROX = v.dtype != "float32"  # tanh.approx where the inputs are 16-bit

    def attn_backward_dq(q, k, v, do, lse, delta, dq, Nq, Nk, Hq, group, causal_offset,
                         qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd, vsb, vsh, vsn, vsd,
                         gsb, gsh, gsn, gsd, dqsb, dqsh, dqsn, dqsd, lsb, lsh, lsn, scale,
                         slopes, ssb, ssh, m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8,
                         e9, e10, e11, e12, e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k,
                         seqk, table, tsb, page, psp, TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, float32, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        tr = tid // TC
        tc = tid - tr * TC
        # (causal: heaviest first; the last query tile sees the most keys)
        qt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, True, 0)
        b, h, hk = split_heads(bh, Hq, group)
        b, qt = packed_tile(b, qt, cu_q, nseq, BM, cuda.threadIdx.x & 31,
                            NT % 32 == 0, PACKED)
        q0 = qt * BM
        # this batch entry's rows (varlen: its sequence's) and where they start
        q_row0, k_row0, Nq, Nk, causal_offset, srow, _ = sequence_rows(
            b, h, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        qb0 = b * qsb + q_row0 * qsn
        gb0 = b * gsb + q_row0 * gsn
        lb0 = b * lsb + q_row0 * lsn
        kb0 = b * ksb + k_row0 * ksn
        vb0 = b * vsb + k_row0 * vsn
        dqb0 = b * dqsb + q_row0 * dqsn
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        cbase = b * csb + h * csh  # (MMOD) this head's tile classes
        sl2 = float32(scale * LOG2E)
        slope = slope_of(slopes, b, h, ssb, ssh, float32(LOG2E), ALIBI)
        qbase = qb0 + h * qsh
        gbase = gb0 + h * gsh
        kbase = kb0 + hk * ksh
        vbase = vb0 + hk * vsh
        load_tile_t(smem, Q_OFF, LDQ, q, qbase, q0, Nq, qsn, qsd, BM, D, DP, sl2, tid, NT)
        load_tile_t(smem, DO_OFF, LDQ, do, gbase, q0, Nq, gsn, gsd, BM, D, DP,
                    float32(1.0), tid, NT)

        s = cuda.local.array((RM, RN), float32)
        dp = cuda.local.array((RM, RN), float32)
        dq_acc = cuda.local.array((RM, RD), float32)
        ls = cuda.local.array(RM, float32)
        dl = cuda.local.array(RM, float32)
        xa = cuda.local.array(RM, float32)
        xb = cuda.local.array(XB, float32)
        xd = cuda.local.array(RD, float32)
        for a in range(RM):
            i = q0 + tr * RM + a
            ls[a], dl[a] = query_stats(lse, delta, lb0 + h * lsh + i * lsn, srow + i,
                                       i < Nq)
            for dd in range(RD):
                dq_acc[a, dd] = float32(0.0)

        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)

        if ASYNC:
            copy_rows(smem, K_OFF, KJ, k, kbase, n_begin, Nk, ksn, BN, D, DP, tid, NT)
            copy_rows(smem, V_OFF, KJ, v, vbase, n_begin, Nk, vsn, BN, D, DP, tid, NT)
            cp_async_commit()
        for n0 in range(n_begin, n_end, BN):
            k_off = K_OFF
            v_off = V_OFF
            if ASYNC:
                stage = ((n0 - n_begin) // BN) & 1
                k_off += stage * STAGE
                v_off += stage * STAGE
                if n0 + BN < n_end:  # the next K and V into the other stage
                    other = STAGE - 2 * stage * STAGE
                    copy_rows(smem, k_off + other, KJ, k, kbase, n0 + BN, Nk, ksn, BN, D,
                              DP, tid, NT)
                    copy_rows(smem, v_off + other, KJ, v, vbase, n0 + BN, Nk, vsn, BN, D,
                              DP, tid, NT)
                cp_async_commit()
                cp_async_wait(1)  # this tile's K and V
            else:
                load_tile_t(smem, K_OFF, KD, k, kbase, n0, Nk, ksn, ksd, BN, D, DP,
                            float32(1.0), tid, NT)
                load_tile_t(smem, V_OFF, KD, v, vbase, n0, Nk, vsn, vsd, BN, D, DP,
                            float32(1.0), tid, NT)
            cuda.syncthreads()
            for a in range(RM):
                for bb in range(RN):
                    s[a, bb] = float32(0.0)
                    dp[a, bb] = float32(0.0)
            # the tile's class under a mask_mod (as in the dK/dV kernel)
            live = True
            partial = MMOD
            if MMOD:  # (compile-time)
                cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                live = cl != EMPTY
                partial = cl == PARTIAL
            if live:
                tile_product(s, xa, xb, smem, Q_OFF, LDQ, k_off, KD, KJ, DP, tr, tc, RM, RN,
                             TC, KU)
                tile_product(dp, xa, xb, smem, DO_OFF, LDQ, v_off, KD, KJ, DP, tr, tc, RM, RN,
                             TC, KU)
            # Zero K rows past the end give S = 0, whose P may overflow: mask them too.
            masked = n0 + BN > n_full or (WINDOW and n0 < n_lo)
            for a in range(RM):
                row = tr * RM + a
                i = q0 + row
                for bb in range(RN):
                    col = tc + TC * bb
                    x = s[a, bb]
                    g = float32(1.0)
                    if CAP:  # (compile-time) through the softcap: dS times 1 - tanh^2
                        x, g = softcap(x, CAP_L2, CAP_INV, APPROX)
                    if ALIBI:  # (compile-time) the distance bias (its derivative is 1)
                        x = alibi(x, distance(i, n0 + col, causal_offset), slope)
                    if SMOD:  # (compile-time) the user's score_mod and its derivative
                        x, gu = user_score_slope(x, b, h, i, n0 + col, Nq, Nk, float32(LOG2E),
                                                 float32(1.0 / LOG2E), SLOPE, margs)
                        g *= gu
                    p = math.exp2(x - ls[a])
                    if not live or (masked and not visible(i, n0 + col, Nk, causal_offset,
                                                           CAUSAL, LEFT, RIGHT)) or (
                            partial and not user_keeps(b, h, i, n0 + col, Nq, Nk, KEEPS, margs)):
                        p = float32(0.0)
                        if SMOD:  # (compile-time) a hidden score's slope need not be finite
                            g = float32(0.0)
                    ds = p * (dp[a, bb] - dl[a])
                    if GRAD:
                        ds *= g
                    smem[DS_OFF + col * LDP + row] = ds
            cuda.syncthreads()
            if live:  # (an empty tile adds nothing)
                tile_product(dq_acc, xa, xd, smem, DS_OFF, LDP, k_off, KJ, KD, BN, tr, tc,
                             RM, RD, TC, KU)
            cuda.syncthreads()
        if ASYNC:
            cp_async_wait(0)

        dqbase = dqb0 + h * dqsh
        sc = float32(scale)
        for a in range(RM):
            i = q0 + tr * RM + a
            if i < Nq:
                for dd in range(RD):
                    d = column(tc, dd, KJ, KD, RD, TC)
                    if d < D:
                        store_f32(dq, dqbase + i * dqsn + d * dqsd, dq_acc[a, dd] * sc)

    attn_backward_dq.__qualname__ = v.tag
    return attn_backward_dq
