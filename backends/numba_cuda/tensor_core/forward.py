"""Tensor-core forward kernel for fp16/bf16: ``attn_forward_tc``, FlashAttention-2 partition.

One thread block per (query tile, batch * query head); the block's ``warps`` warps own 16
query rows each (no inter-warp reduction). Per key tile of ``block_n`` keys:

- ``S = Q Kᵀ`` with mma m16n8k16 (fp32 accumulators). Q's A fragments are loaded once with
  ldmatrix and stay in registers where they fit (else they are re-read at each k-step); K
  rows give B fragments through plain ldmatrix. With ``m_tiles`` 2 a warp owns 32 rows and
  each K fragment feeds two MMAs.
- Online softmax in fp32 on the accumulator fragments: only diagonal and tail tiles are
  masked; row maxima of the raw scores over the 4 lanes sharing a row by two xor shuffles,
  ``P = exp2(S c - m c)`` with ``c = scale * log2(e)`` (one FFMA and one ex2 per score),
  running max ``m`` and sum ``l`` per row (each lane owns rows ``g`` and ``g+8``).
- ``O += P V``: the fp32 P fragments, rounded to the input dtype and packed in pairs, are
  exactly the A fragments of the next MMA (the C layout of two adjacent n-tiles is the A
  layout of one k-step), so P never leaves registers; V rows give B fragments through
  ``ldmatrix.trans``.

K and V tiles are double-buffered in shared memory and filled with 16-byte ``cp.async``
copies one tile ahead (separate commit groups for K and V, so the ``S`` product waits only
for K). Rows are padded by 8 elements (16 bytes): a row stride of an odd number of 16-byte
units puts the 8 rows of each ldmatrix on distinct banks.

Needs sm_80+, head dim a multiple of 16 (32, 64, 96, 128 and 256 are routed here), unit
stride along the head dim and 16-byte aligned rows; launch arguments are those of
``attn_forward``, so the host side (launch.signature, the argument packing of
launch.run_forward) is shared.
"""
from __future__ import annotations

import math

from numba import cuda, float32, uint16, uint32

from ..device.constants import (
    DENSE,
    EMPTY,
    FLT_MIN,
    LN2,
    LOG2E,
    NEG_INF,
    PACKING,
    PAGED,
    PARTIAL,
    SMEM_ALIGN,
)
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import (
    cp_async_commit,
    cp_async_wait,
    exp2_fma,
    ldmatrix_x4,
    shfl_xor_f32,
)
from ..device.prologue import block_tile, split_heads
from ..device.seams import (
    alibi,
    distance,
    packed_tile,
    row_keys,
    score,
    sequence_rows,
    slope_of,
    softcap,
    split_range,
    tile_class,
    user_keeps,
    user_score,
    visited_keys,
)
from ..device.user_mods import kernel_mods
from ..tilings import PAD
from .fragments import load_key_rows, load_rows, mma, mma_frags_rows, store_frags


@device_function
def mask_row(s, base, n0, i, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq, MMOD, keeps,
             args, b, h, Nq):
    """Scores of one of this lane's rows (``s[base + 4 jn + e]``) at keys past ``Nk`` or
    hidden by the mask (causal, the window, the user's mask_mod ``keeps`` where ``MMOD``)
    set to -inf (diagonal, edge and tail tiles; every tile with a mask_mod). Without the
    mask_mod (``MMOD``: the tile is one of its partial ones) the bounds, causal and the
    window take the row's two bounds (:func:`mask_bounds`); with it, each score its own
    test, as the mask_mod needs its key anyway (the two bounds' registers made D=256's
    varlen variant with user mods spill 12 bytes more)."""
    if MMOD:
        j0 = n0 + 2 * tq
        for jn in range(NTILES):
            for e in range(2):
                j = j0 + 8 * jn + e
                x = score(s[base + 4 * jn + e], i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT)
                if not user_keeps(b, h, i, j, Nq, Nk, keeps, args):
                    x = NEG_INF
                s[base + 4 * jn + e] = x
        return
    mask_bounds(s, base, n0, i, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq)


@device_function
def mask_bounds(s, base, n0, i, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq):
    """Scores of one of this lane's rows (``s[base + 4 jn + e]``, key ``n0 + 8 jn + 2 tq +
    e``) past ``Nk`` or hidden by causal or the window set to -inf: each score's offset, a
    constant after unrolling, against the row's two bounds (``seams.row_keys``)."""
    lo, hi = row_keys(i, n0 + 2 * tq, Nk, causal_offset, CAUSAL, LEFT, RIGHT, 8 * NTILES)
    for jn in range(NTILES):
        for e in range(2):
            c = 8 * jn + e
            if c < lo or c > hi:
                s[base + 4 * jn + e] = NEG_INF


@device_function
def user_row(s, base, n0, i, Nk, NTILES, tq, value, args, b, h, Nq, unit, inv):
    """The user's score_mod (``value``) on one of this lane's rows (raw scores are natural
    ones times ``unit``, ``inv`` its reciprocal)."""
    for jn in range(NTILES):
        for e in range(2):
            x = base + 4 * jn + e
            s[x] = user_score(s[x], b, h, i, n0 + 8 * jn + 2 * tq + e, Nq, Nk, unit, inv,
                              value, args)


@device_function
def alibi_side(n0, BN, w0, rows, causal_offset, slope, CAUSAL, LINEAR):
    """``(side, linear)`` for key tile ``n0 .. n0 + BN - 1`` and the warp's rows ``w0 .. w0
    + rows - 1``: ``side`` is ``slope`` where every key is at or before every row's
    diagonal (distances ``d >= 0``: so for every key a causal row sees), ``-slope`` where
    every key is at or after it (``d <= 0``); ``linear`` says the tile is one of those
    (warp-uniform), so that the bias ``-slope |d| = -side d`` is linear in the key on the
    whole tile. Not where ``LINEAR`` (compile-time) is False (a score_mod must see the
    biased score), nor on a tile across the diagonal."""
    if CAUSAL:
        return slope, LINEAR
    if n0 + BN - 1 <= w0 + causal_offset:
        return slope, LINEAR
    if n0 >= w0 + rows - 1 + causal_offset:
        return -slope, LINEAR
    return slope, False


@device_function
def alibi_row(s, base, d0, slope, side, linear, NTILES):
    """The ALiBi bias (``slope`` in raw-score units) on one of this lane's rows, whose
    distance from this lane's first key is ``d0`` (:func:`distance`; an element's is
    ``d0 - k``, ``k = 8 jn + e`` a constant); returns the row's offset ``r``: the biased
    scores are the stored ones less ``r``.

    On a ``linear`` tile (:func:`alibi_side`) the bias is ``-side (d0 - k)``: the per-key
    part ``side k`` is added (one FFMA with an immediate per score, where the |.| form
    takes four instructions and the registers that made the kernel spill) and the per-row
    part ``side d0`` is returned as ``r``, for the softmax to take once per row
    (:func:`softmax_row`; it varies with the lane). The stored scores stay within
    ``(block_n - 1) |slope|`` of the raw ones: nothing large is added to them and taken
    off again, and the softmax rounds no larger numbers than with the |.| form. Otherwise
    ``s - slope |d0 - k|`` per element and ``r`` 0."""
    if linear:
        for jn in range(NTILES):
            for e in range(2):
                # (an explicit fma: a product and an add let LLVM hoist the 16 products
                # out of the key loop, 16 more registers live in a kernel that spills)
                x = base + 4 * jn + e
                s[x] = cuda.fma(side, float32(8 * jn + e), s[x])
        return side * d0
    for jn in range(NTILES):
        for e in range(2):
            s[base + 4 * jn + e] = alibi(s[base + 4 * jn + e], d0 - float32(8 * jn + e),
                                         slope)
    return float32(0.0)


@device_function
def softmax_row(s, base, m_old, sl2, NTILES, r, ALIBI, POLY):
    """One of this lane's rows of a score tile (``s[base + 4 jn + e]``, masked already):
    new running max (of the scores) over the 4 lanes sharing the row, then
    ``P = exp2(S * sl2 - max * sl2)`` in place, one FFMA and one ex2 per score. Returns
    ``(new max, rescale factor of the old accumulators, this lane's sum of P)``.
    ``POLY`` (compile-time; 0: none): every ``POLY``-th n-tile takes its exp2 from the FMA
    pipe (``intrinsics.exp2_fma``) instead of the MUFU unit, for kernels whose MUFU is busy
    with a softcap's tanh too.
    ``ALIBI`` (compile-time): the row's scores are the stored ones less this lane's ``r``
    (:func:`alibi_row`); the lane's max is taken on the stored ones and moved by ``r``
    before the shuffles, and P's FFMA subtracts ``(max + r) sl2``."""
    mx = m_old
    if ALIBI:
        mx = NEG_INF
    for jn in range(NTILES):
        mx = max(mx, s[base + 4 * jn])
        mx = max(mx, s[base + 4 * jn + 1])
    if ALIBI:
        mx = max(m_old, mx - r)
    mx = max(mx, shfl_xor_f32(mx, 1))
    mx = max(mx, shfl_xor_f32(mx, 2))
    # a row that has seen no key yet keeps m = -inf; subtract 0 instead
    mu = mx * sl2 if mx != NEG_INF else float32(0.0)
    alpha = math.exp2(m_old * sl2 - mu)
    mus = mu
    if ALIBI:  # (a row with no key: its stored scores are -inf, any finite mus gives 0)
        mus = (mx + r) * sl2 if mx != NEG_INF else float32(0.0)
    ps = float32(0.0)
    for jn in range(NTILES):
        for e in range(2):
            x = base + 4 * jn + e
            if POLY and jn % POLY == POLY - 1:
                pv = exp2_fma(s[x] * sl2 - mus)
            else:
                pv = math.exp2(s[x] * sl2 - mus)
            s[x] = pv
            ps += pv
    return mx, alpha, ps


@device_function
def rescale_row(acc, off, alpha, DTILES):
    """Multiply one row's accumulators (``acc[off + 4 dn]``, ``+1``) by ``alpha``."""
    for dn in range(DTILES):
        acc[off + 4 * dn] *= alpha
        acc[off + 4 * dn + 1] *= alpha


@device_function
def finish_row(lse, lrow, i, Nq, m, sl2, lsum, tq):
    """The row's total (the 4 lanes' sums added), its lse written by lane ``tq`` 0, and
    the factor that normalizes its output (0 for a row that saw no key)."""
    lv = lsum
    lv += shfl_xor_f32(lv, 1)
    lv += shfl_xor_f32(lv, 2)
    if tq == 0 and i < Nq:
        val = NEG_INF
        if lv > 0:
            val = (m * sl2 + math.log2(lv)) * float32(LN2)
        lse[lrow + i] = val
    return float32(1.0) / lv if lv > 0 else float32(0.0)


@device_function
def load_q_frags(qf, smem, qrow, LDS, mt, kk, NQF):
    """Q's A fragments of m-tile ``mt`` at k-step ``kk`` into ``qf[mt * NQF + 4 kk:]``."""
    x0, x1, x2, x3 = ldmatrix_x4(smem, qrow + 16 * LDS * mt + 16 * kk)
    f = mt * NQF + 4 * kk
    qf[f] = x0
    qf[f + 1] = x1
    qf[f + 2] = x2
    qf[f + 3] = x3


def make_attn_forward_tc(v):
    """The forward kernel of variant ``v``: head dim, tiling (tilings.TCTiles), mask and
    input dtype (fp16 or bf16)."""
    head_dim, t, dtype = v.head_dim, v.tiles, v.dtype
    if head_dim % 16:
        raise ValueError(f"{head_dim=} must be a multiple of 16 for the tensor-core kernel")
    if t.d_splits != 1:
        raise ValueError(f"the forward takes d_splits=1, not {t}")
    D = head_dim
    BN, MT = t.block_n, t.m_tiles
    BM, NT = t.block_m, t.threads
    LDS = D + PAD
    CH = D // 8  # 16-byte chunks per row
    KSTEPS = D // 16  # k-steps of Q Kᵀ
    NTILES = BN // 8  # 8-key n-tiles of S
    PSTEPS = BN // 16  # k-steps of P V
    DTILES = D // 8  # 8-column n-tiles of O
    NQF, NACC, NS = 4 * KSTEPS, 4 * DTILES, 4 * NTILES  # register fragments per m-tile
    NQF_ALL, NACC_ALL, NS_ALL = MT * NQF, MT * NACC, MT * NS
    # Q's A fragments stay in registers unless that would take more than 32 per lane (two
    # m-tiles at head dim 128): then they are read from shared memory at each k-step.
    QREG = MT * D <= 128
    Q_OFF = 0
    K_OFF = BM * LDS
    V_OFF = K_OFF + 2 * BN * LDS
    BUF = BN * LDS
    CAUSAL = bool(v.causal)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap c: raw scores s -> (c / scale) tanh(s scale / c)
    CAP_C = float32(v.softcap) if CAP else float32(1.0)
    ALIBI = v.alibi  # slopes in raw-score units here: slope / scale
    SMOD, MMOD, VIEWS, VALUE, _, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    BF16 = dtype == "bfloat16"
    PACKED = PACKING[v.packed]  # dense, varlen or a KV cache (device/seams.sequence)
    PAGEDK = PACKED == PAGED  # K, V rows through a block table
    SPLIT = v.split  # split-KV: one key range per blockIdx.z, float32 partial o and lse
    # ALiBi's per-row part leaves the scores for the softmax (alibi_row) unless a score_mod
    # must see the biased score
    LINEAR = ALIBI and not SMOD

    def attn_forward_tc(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                        qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                        vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale, slopes, ssb, ssh,
                        m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                        e12, e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table, tsb,
                        page, psp, TQ, chunk, oss, lss, nseq):
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
        # this batch entry's rows (packed: its sequence's; a cache: its key count)
        q_row0, k_row0, Nq, Nk, causal_offset, lrow, _ = sequence_rows(
            b, h, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        split = cuda.blockIdx.z  # (SPLIT) this block's key range
        qbase = b * qsb + h * qsh + q_row0 * qsn
        kbase = b * ksb + hk * ksh + k_row0 * ksn
        vbase = b * vsb + hk * vsh + k_row0 * vsn
        tb = b * tsb  # (PAGEDK) this sequence's row of the block table
        # scores to the log2 domain; kept a normal fp32 number (-inf * sl2 stays -inf)
        sl2 = float32(max(scale * LOG2E, FLT_MIN))
        capr = CAP_C / float32(scale)  # (used where CAP) the cap in raw-score units
        rcapr = float32(scale) / CAP_C
        slope = slope_of(slopes, b, h, ssb, ssh, float32(1.0) / float32(scale), ALIBI)
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        unit = float32(1.0) / float32(scale)  # (SMOD) natural scores to raw ones
        cbase = b * csb + h * csh  # (MMOD) this head's tile classes

        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)
        n_begin, n_end = split_range(n_begin, n_end, split, chunk, SPLIT)
        n_tiles = (n_end + BN - 1) // BN  # (n_begin is 0 here: plain variants keep this)
        if WINDOW or MMOD or SPLIT:  # (compile-time)
            n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0

        # groups in flight, oldest first: {Q, K0}, {V0}
        load_rows(smem, Q_OFF, q, qbase, q0, Nq, qsn, BM, LDS, CH, tid, NT)
        if n_tiles > 0:
            load_key_rows(smem, K_OFF, k, kbase, n_begin, Nk, ksn, BN, LDS, CH, tid, NT, table,
                          tb, page, psp, PAGEDK)
        cp_async_commit()
        if n_tiles > 0:
            load_key_rows(smem, V_OFF, v, vbase, n_begin, Nk, vsn, BN, LDS, CH, tid, NT, table,
                          tb, page, psp, PAGEDK)
        cp_async_commit()
        cp_async_wait(1)
        cuda.syncthreads()

        # this warp's rows: m-tile mt holds rows r0 + 16 mt + g and + 8 (lane's two rows)
        r0 = warp * 16 * MT
        qf = cuda.local.array(NQF_ALL, uint32)
        qrow = Q_OFF + (r0 + (lane & 15)) * LDS + 8 * (lane >> 4)  # + 16 * LDS * mt
        if QREG:
            for mt in range(MT):
                for kk in range(KSTEPS):
                    load_q_frags(qf, smem, qrow, LDS, mt, kk, NQF)

        acc = cuda.local.array(NACC_ALL, float32)
        for e in range(NACC_ALL):
            acc[e] = float32(0.0)
        s = cuda.local.array(NS_ALL, float32)
        # running max (of the raw scores) and this lane's running sum of each of its rows
        ma = mb = mc = md = NEG_INF
        la = lb = lc = ld = float32(0.0)
        # lane-dependent parts of the ldmatrix addresses
        krow = (lane & 7) + 8 * (lane >> 4)
        kcol = 8 * ((lane >> 3) & 1)

        for it in range(n_tiles):
            n0 = n_begin + it * BN
            kb = K_OFF + (it & 1) * BUF
            vb = V_OFF + (it & 1) * BUF
            if it > 0:
                cp_async_wait(1)  # K[it] (V[it] may still be in flight)
                cuda.syncthreads()
            # Every warp is past tile it-1: its buffers take tile it+1.
            nb = (1 - (it & 1)) * BUF
            if it + 1 < n_tiles:
                load_key_rows(smem, K_OFF + nb, k, kbase, n0 + BN, Nk, ksn, BN, LDS, CH, tid,
                              NT, table, tb, page, psp, PAGEDK)
            cp_async_commit()
            if it + 1 < n_tiles:
                load_key_rows(smem, V_OFF + nb, v, vbase, n0 + BN, Nk, vsn, BN, LDS, CH, tid,
                              NT, table, tb, page, psp, PAGEDK)
            cp_async_commit()

            # the tile's class under a mask_mod: an empty tile is skipped (its copies were
            # issued above; the next tile's wait covers them, and its barrier the reuse of
            # this tile's buffers), a full one takes no mask_mod
            partial = MMOD
            if MMOD:  # (compile-time)
                cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                if cl == EMPTY:
                    continue
                partial = cl == PARTIAL
            # S = Q Kᵀ: each K fragment pair feeds every m-tile of the warp
            for e in range(NS_ALL):
                s[e] = float32(0.0)
            for kk in range(KSTEPS):
                if not QREG:
                    for mt in range(MT):
                        load_q_frags(qf, smem, qrow, LDS, mt, kk, NQF)
                for jp in range(NTILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kb + (16 * jp + krow) * LDS
                                                 + 16 * kk + kcol)
                    for mt in range(MT):
                        f = mt * NQF + 4 * kk
                        a0 = qf[f]
                        a1 = qf[f + 1]
                        a2 = qf[f + 2]
                        a3 = qf[f + 3]
                        j = mt * NS + 8 * jp
                        s[j], s[j + 1], s[j + 2], s[j + 3] = mma(
                            BF16, a0, a1, a2, a3, b0, b1, s[j], s[j + 1], s[j + 2], s[j + 3])
                        s[j + 4], s[j + 5], s[j + 6], s[j + 7] = mma(
                            BF16, a0, a1, a2, a3, b2, b3, s[j + 4], s[j + 5], s[j + 6],
                            s[j + 7])

            if CAP:  # (compile-time) the softcap, before the masks
                for e in range(NS_ALL):
                    s[e], _ = softcap(s[e], capr, rcapr, True)
            # online softmax, in the log2 domain, row by row of this lane (rows written out
            # so that every index is a constant: m-tile 0 rows g, g + 8; m-tile 1 likewise)
            i = q0 + r0 + g
            ra = rb = rc = rd = float32(0.0)  # (ALIBI) each row's offset, alibi_row
            if ALIBI:  # (compile-time) the distance bias, after the softcap
                side, lin = alibi_side(n0, BN, q0 + r0, 16 * MT, causal_offset, slope,
                                       CAUSAL, LINEAR)
                d0 = distance(i, n0 + 2 * tq, causal_offset)  # rows i + 8, 16, 24: + 8, 16, 24
                ra = alibi_row(s, 0, d0, slope, side, lin, NTILES)
                rb = alibi_row(s, 2, d0 + float32(8.0), slope, side, lin, NTILES)
                if MT > 1:
                    rc = alibi_row(s, NS, d0 + float32(16.0), slope, side, lin, NTILES)
                    rd = alibi_row(s, NS + 2, d0 + float32(24.0), slope, side, lin, NTILES)
            if SMOD:  # (compile-time) the user's score_mod, after the softcap and ALiBi
                sc = float32(scale)
                user_row(s, 0, n0, i, Nk, NTILES, tq, VALUE, margs, b, h, Nq, unit, sc)
                user_row(s, 2, n0, i + 8, Nk, NTILES, tq, VALUE, margs, b, h, Nq, unit, sc)
                if MT > 1:
                    user_row(s, NS, n0, i + 16, Nk, NTILES, tq, VALUE, margs, b, h, Nq,
                             unit, sc)
                    user_row(s, NS + 2, n0, i + 24, Nk, NTILES, tq, VALUE, margs, b, h, Nq,
                             unit, sc)
            # a diagonal, edge or tail tile; with a mask_mod, every tile
            if partial or n0 + BN > n_full or (WINDOW and n0 < n_lo):
                mask_row(s, 0, n0, i, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq,
                         partial, KEEPS, margs, b, h, Nq)
                mask_row(s, 2, n0, i + 8, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq,
                         partial, KEEPS, margs, b, h, Nq)
                if MT > 1:
                    mask_row(s, NS, n0, i + 16, Nk, causal_offset, CAUSAL, LEFT, RIGHT,
                             NTILES, tq, partial, KEEPS, margs, b, h, Nq)
                    mask_row(s, NS + 2, n0, i + 24, Nk, causal_offset, CAUSAL, LEFT, RIGHT,
                             NTILES, tq, partial, KEEPS, margs, b, h, Nq)
            ma, al, ps = softmax_row(s, 0, ma, sl2, NTILES, ra, ALIBI, 0)
            la = la * al + ps
            rescale_row(acc, 0, al, DTILES)
            mb, al, ps = softmax_row(s, 2, mb, sl2, NTILES, rb, ALIBI, 0)
            lb = lb * al + ps
            rescale_row(acc, 2, al, DTILES)
            if MT > 1:
                mc, al, ps = softmax_row(s, NS, mc, sl2, NTILES, rc, ALIBI, 0)
                lc = lc * al + ps
                rescale_row(acc, NACC, al, DTILES)
                md, al, ps = softmax_row(s, NS + 2, md, sl2, NTILES, rd, ALIBI, 0)
                ld = ld * al + ps
                rescale_row(acc, NACC + 2, al, DTILES)

            cp_async_wait(2)  # V[it] (K and V of it+1 may still be in flight)
            cuda.syncthreads()
            # O += P V, P straight from the S fragments; each V fragment feeds every m-tile
            mma_frags_rows(BF16, acc, s, smem, vb, LDS, PSTEPS, DTILES, lane, MT, NS, NACC)
        cp_async_wait(0)

        obase = b * osb + h * osh + q_row0 * osn
        if SPLIT:  # (compile-time) this split's partial output and lse
            obase += split * oss
            lrow += split * lss
        i = q0 + r0 + g
        inv0 = finish_row(lse, lrow, i, Nq, ma, sl2, la, tq)
        inv1 = finish_row(lse, lrow, i + 8, Nq, mb, sl2, lb, tq)
        store_frags(o, obase, i, Nq, osn, osd, acc, 0, inv0, inv1, DTILES, tq)
        if MT > 1:
            inv0 = finish_row(lse, lrow, i + 16, Nq, mc, sl2, lc, tq)
            inv1 = finish_row(lse, lrow, i + 24, Nq, md, sl2, ld, tq)
            store_frags(o, obase, i + 16, Nq, osn, osd, acc, NACC, inv0, inv1, DTILES, tq)

    attn_forward_tc.__qualname__ = v.tag
    return attn_forward_tc
