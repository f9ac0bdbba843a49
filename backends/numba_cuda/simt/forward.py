"""Forward kernel: ``attn_forward``, FlashAttention-2 with an online softmax.

One thread block per (query tile, batch * query head). The query tile is loaded once into
shared memory (pre-multiplied by ``scale * log2(e)``, so the softmax runs on ``exp2``), key
and value tiles stream through one shared buffer; the running row max ``m_i`` and sum
``l_i`` stay in fp32 registers, and the output is normalized once at the end.

Causal masking is bottom-right aligned (query ``i`` sees key ``j`` iff
``j <= i + causal_offset``): key tiles wholly above the diagonal are never visited, and
masks are applied only on tiles that cross the diagonal or the end of the keys.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int64

from .. import tilings as _tiles
from ..device.constants import (
    DENSE,
    EMPTY,
    LN2,
    LOG2E,
    NEG_INF,
    PACKING,
    PAGED,
    PARTIAL,
    SMEM_ALIGN,
)
from ..device.convert import device_function, ld4, load_f32, smem_pointer, store_f32
from ..device.intrinsics import cp_async16, cp_async_commit, cp_async_wait, shfl_xor_f32
from ..device.prologue import block_tile, split_heads
from ..device.seams import (
    alibi,
    distance,
    key_row,
    packed_tile,
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
from .tile_product import column, tile_product


@device_function
def _tile_element(src, base, n0, nvalid, sn, sd, ld, e, rows, D, DP, mult, EVEN):
    """(shared-memory offset, fp32 value) of element ``e`` of a transposed tile load."""
    if EVEN:  # 32-element blocks of 8 columns x 4 rows, row blocks fastest
        blk = e >> 5
        lane = e & 31
        db = blk // (rows >> 2)
        j = (blk - db * (rows >> 2)) * 4 + (lane >> 3)
        d = db * 8 + (lane & 7)
    else:  # along d
        j = e // DP
        d = e - j * DP
    val = float32(0.0)
    if d < D and n0 + j < nvalid:
        val = load_f32(src[base + (n0 + j) * sn + d * sd]) * mult
    return d * ld + j, val


@device_function
def load_tile_t(smem, off, ld, src, base, n0, nvalid, sn, sd, rows, D, DP, mult, tid, NT):
    """smem[off + d * ld + j] = src[row n0 + j, column d] * mult, transposed, in fp32; rows
    past ``nvalid`` and columns past ``D`` (up to ``DP``) are zero.

    Lanes read along d (coalesced). With an odd ``ld``, consecutive d land on distinct
    banks; with ``ld`` a multiple of 4, a warp takes 8 columns x 4 rows so that its stores
    still cover all 32 banks. Each thread issues four global loads before its four stores:
    the compiler cannot move a load above a store through a generic pointer, so a loop of
    load-then-store would wait out one memory latency per element. (Walking incremental
    indices over a constant trip count was slower: notes/numba_cuda.md, v3.)"""
    EVEN = ld % 2 == 0
    total = rows * DP
    last = total - 1
    for e in range(tid, total, 4 * NT):
        # past the end, repeat the last element (the same value to the same place)
        i0, v0 = _tile_element(src, base, n0, nvalid, sn, sd, ld, e, rows, D, DP, mult,
                               EVEN)
        i1, v1 = _tile_element(src, base, n0, nvalid, sn, sd, ld, min(e + NT, last), rows,
                               D, DP, mult, EVEN)
        i2, v2 = _tile_element(src, base, n0, nvalid, sn, sd, ld, min(e + 2 * NT, last),
                               rows, D, DP, mult, EVEN)
        i3, v3 = _tile_element(src, base, n0, nvalid, sn, sd, ld, min(e + 3 * NT, last),
                               rows, D, DP, mult, EVEN)
        smem[off + i0] = v0
        smem[off + i1] = v1
        smem[off + i2] = v2
        smem[off + i3] = v3


@device_function
def copy_rows(smem, off, ld, src, base, n0, nvalid, sn, rows, D, DP, tid, NT):
    """``smem[off + j * ld + d] = src[base + (n0 + j) * sn + d]`` for ``j < rows``,
    ``d < DP``: fp32 rows as they are, 16 bytes per ``cp.async`` (global rows contiguous and
    16-byte aligned: launch.rows_aligned), zeros past ``nvalid`` rows and ``D`` columns. The
    copies are in flight until ``cp_async_wait``, so the caller computes meanwhile. Where
    the threads divide the tile evenly, each keeps one 16-byte column of the rows and steps
    its addresses by a constant."""
    C = DP // 4  # 16-byte chunks per row
    if NT % C == 0 and rows % (NT // C) == 0:  # (compile-time constants)
        RS = NT // C
        j = tid // C
        c4 = 4 * (tid - j * C)
        nb = 4 * max(0, min(4, D - c4))
        g = base + (n0 + j) * sn + c4
        at = off + j * ld + c4
        for r in range(rows // RS):
            ok = n0 + j + r * RS < nvalid and nb > 0
            cp_async16(smem, at + r * RS * ld, src, g if ok else base, nb if ok else 0)
            g += RS * sn
    else:
        for e in range(tid, rows * C, NT):
            j = e // C
            c4 = 4 * (e - j * C)
            nb = 4 * max(0, min(4, D - c4)) if n0 + j < nvalid else 0
            cp_async16(smem, off + j * ld + c4, src, base + (n0 + j) * sn + c4 if nb > 0
                       else base, nb)


@device_function
def load_key_tile_t(smem, off, ld, src, base, n0, nvalid, sn, sd, rows, D, DP, mult, tid, NT,
                   table, tb, page, psp, PAGED):
    """:func:`load_tile_t` for key and value tiles: rows through a block table where
    ``PAGED`` (compile-time; :func:`..device.seams.key_row`), one element per step."""
    if not PAGED:
        load_tile_t(smem, off, ld, src, base, n0, nvalid, sn, sd, rows, D, DP, mult, tid, NT)
        return
    p = n0 // page
    if (n0 + rows - 1) // page == p:  # inside one page: the dense load from its start
        load_tile_t(smem, off, ld, src, base + int64(table[tb + p]) * psp, n0 - p * page,
                    nvalid - p * page, sn, sd, rows, D, DP, mult, tid, NT)
        return
    for e in range(tid, rows * DP, NT):
        j = e // DP
        d = e - j * DP
        val = float32(0.0)
        if d < D and n0 + j < nvalid:
            val = load_f32(src[key_row(base, n0 + j, sn, table, tb, page, psp, True)
                               + d * sd]) * mult
        smem[off + d * ld + j] = val


@device_function
def copy_key_rows(smem, off, ld, src, base, n0, nvalid, sn, rows, D, DP, tid, NT, table, tb,
                  page, psp, PAGED):
    """:func:`copy_rows` for key and value tiles: rows through a block table where
    ``PAGED`` (compile-time; pages 16-byte aligned, as rows are)."""
    if not PAGED:
        copy_rows(smem, off, ld, src, base, n0, nvalid, sn, rows, D, DP, tid, NT)
        return
    p = n0 // page
    if (n0 + rows - 1) // page == p:  # inside one page: the dense copy from its start
        copy_rows(smem, off, ld, src, base + int64(table[tb + p]) * psp, n0 - p * page,
                  nvalid - p * page, sn, rows, D, DP, tid, NT)
        return
    C = DP // 4  # 16-byte chunks per row
    for e in range(tid, rows * C, NT):
        j = e // C
        c4 = 4 * (e - j * C)
        nb = 4 * max(0, min(4, D - c4)) if n0 + j < nvalid else 0
        at = base
        if nb > 0:
            at = key_row(base, n0 + j, sn, table, tb, page, psp, True) + c4
        cp_async16(smem, off + j * ld + c4, src, at, nb)


def make_attn_forward(v):
    """The forward kernel of variant ``v`` (variant.Variant: head dim, tiling ``t``, mask);
    ``v.streamed``: K and V (fp32, 16-byte aligned rows) arrive by cp.async, K one tile
    ahead, and are stored as rows (tilings.streams, tilings.b_tile)."""
    D, t = v.head_dim, v.tiles
    DP = t.dpad(D)
    BM, BN, TR, TC, RM, RN = t.block_m, t.block_n, t.rows, t.cols, t.rm, t.rn
    KU = t.k_unroll  # k steps per trip of the products (tile_product.k_step)
    RD = DP // TC
    NT = TR * TC
    XB = 4 * RN  # B words a thread holds: 4 per column where B is read along k
    ASYNC = bool(v.streamed)
    lay = _tiles.forward_layout(t, D, ASYNC)
    LDQ, LDP = lay["LDQ"], lay["LDP"]  # Q [d][i], P [j][i]
    KJ, KD = lay["KJ"], lay["KD"]  # K and V: strides along keys j and along d
    Q_OFF, K_OFF, V_OFF, P_OFF = lay["Q"], lay["K"], lay["V"], lay["P"]
    RED_OFF = lay["RED"]  # [i][tc]: per-thread partial row max / row sum
    CAUSAL = bool(v.causal)
    LEFT, RIGHT = v.bounds  # the window (-1: unbounded side)
    WINDOW = bool(v.window)
    CAP = bool(v.softcap)  # softcap c; scores here are in log2 units: c log2(e) tanh(s / that)
    CAP_L2 = float32(v.softcap * LOG2E) if CAP else float32(1.0)
    CAP_INV = float32(1.0 / (v.softcap * LOG2E)) if CAP else float32(1.0)
    APPROX = v.dtype != "float32"  # tanh.approx where the inputs are 16-bit
    ALIBI = v.alibi  # slopes in log2 units here: slope log2(e)
    SMOD, MMOD, VIEWS, VALUE, _, KEEPS = kernel_mods(v)  # the user's score_mod, mask_mod
    # With several blocks per SM (min_blocks > 1), row maxima by warp shuffles where a
    # row's TC threads are lanes of one warp (and the block whole warps), and the barrier
    # between S and the softmax, which then only guards K, goes: the next K is copied after
    # the P barrier, during P V only, while other blocks keep the SM busy (D=64: -1 to -5%).
    # With one block per SM (D=128) that copy is exposed: the shared-memory maxima and the
    # early copy stay (notes/numba_cuda.md, v13).
    SHFL = ASYNC and 32 % TC == 0 and NT % 32 == 0 and t.min_blocks > 1
    PACKED = PACKING[v.packed]  # dense, varlen or a KV cache (device/seams.sequence)
    PAGEDK = PACKED == PAGED  # K, V rows through a block table
    SPLIT = v.split  # split-KV: one key range per blockIdx.z, float32 partial o and lse

    def attn_forward(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                     qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                     vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale, slopes, ssb, ssh,
                     m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12,
                     e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table, tsb, page,
                     psp, TQ, chunk, oss, lss, nseq):
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
        sl2 = float32(scale * LOG2E)
        slope = slope_of(slopes, b, h, ssb, ssh, float32(LOG2E), ALIBI)
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        cbase = b * csb + h * csh  # (MMOD) this head's tile classes

        load_tile_t(smem, Q_OFF, LDQ, q, qbase, q0, Nq, qsn, qsd, BM, D, DP, sl2, tid, NT)

        s = cuda.local.array((RM, RN), float32)
        acc = cuda.local.array((RM, RD), float32)
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)
        xa = cuda.local.array(RM, float32)
        xb = cuda.local.array(XB, float32)
        xd = cuda.local.array(RD, float32)  # the V row slice in the P V product
        rmx = cuda.local.array(RM, float32)  # (SHFL) this tile's row maxima
        for a in range(RM):
            m_i[a] = NEG_INF
            l_i[a] = float32(0.0)
            for dd in range(RD):
                acc[a, dd] = float32(0.0)

        # Keys this tile visits, and those every row sees (tiles there need no mask).
        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)
        n_begin, n_end = split_range(n_begin, n_end, split, chunk, SPLIT)

        if ASYNC:
            copy_key_rows(smem, K_OFF, KJ, k, kbase, n_begin, Nk, ksn, BN, D, DP, tid, NT,
                          table, tb, page, psp, PAGEDK)
            cp_async_commit()
        for n0 in range(n_begin, n_end, BN):
            if ASYNC:  # V of this tile in flight during S = Q Kᵀ
                copy_key_rows(smem, V_OFF, KJ, v, vbase, n0, Nk, vsn, BN, D, DP, tid, NT,
                              table, tb, page, psp, PAGEDK)
                cp_async_commit()
                cp_async_wait(1)  # this tile's K
            else:
                load_key_tile_t(smem, K_OFF, KD, k, kbase, n0, Nk, ksn, ksd, BN, D, DP,
                                float32(1.0), tid, NT, table, tb, page, psp, PAGEDK)
            cuda.syncthreads()
            # the tile's class under a mask_mod: an empty tile is all -inf (its products
            # skipped, its copies and barriers kept), a full one takes no mask_mod
            live = True
            partial = MMOD
            if MMOD:  # (compile-time)
                cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                live = cl != EMPTY
                partial = cl == PARTIAL
            for a in range(RM):
                for bb in range(RN):
                    s[a, bb] = float32(0.0) if live else NEG_INF
            if live:
                tile_product(s, xa, xb, smem, Q_OFF, LDQ, K_OFF, KD, KJ, DP, tr, tc,
                             RM, RN, TC, KU)
            if CAP and live:  # (CAP compile-time) the softcap, before the masks
                for a in range(RM):
                    for bb in range(RN):
                        s[a, bb], _ = softcap(s[a, bb], CAP_L2, CAP_INV, APPROX)
            if ALIBI and live:  # (ALIBI compile-time) the distance bias, after the softcap
                for a in range(RM):
                    i = q0 + tr * RM + a
                    for bb in range(RN):
                        s[a, bb] = alibi(s[a, bb], distance(i, n0 + tc + TC * bb, causal_offset),
                                         slope)
            if SMOD and live:  # (SMOD compile-time) the user's score_mod, after the others
                for a in range(RM):
                    i = q0 + tr * RM + a
                    for bb in range(RN):
                        s[a, bb] = user_score(s[a, bb], b, h, i, n0 + tc + TC * bb, Nq, Nk,
                                              float32(LOG2E), float32(1.0 / LOG2E), VALUE,
                                              margs)
            # a diagonal, edge or tail tile; with a mask_mod, every partial tile
            if partial or n0 + BN > n_full or (WINDOW and n0 < n_lo):
                for a in range(RM):
                    i = q0 + tr * RM + a
                    for bb in range(RN):
                        j = n0 + tc + TC * bb
                        x = score(s[a, bb], i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT)
                        if partial and not user_keeps(b, h, i, j, Nq, Nk, KEEPS, margs):
                            x = NEG_INF
                        s[a, bb] = x
            for a in range(RM):
                mx = s[a, 0]
                for bb in range(1, RN):
                    mx = max(mx, s[a, bb])
                if SHFL:  # (compile-time) across the row's TC lanes
                    w = TC >> 1
                    while w > 0:
                        mx = max(mx, shfl_xor_f32(mx, w))
                        w >>= 1
                    rmx[a] = mx
                else:
                    smem[RED_OFF + (tr * RM + a) * TC + tc] = mx
            if not SHFL:
                cuda.syncthreads()
                # K is consumed: the next K (async) or this V goes in while the softmax runs.
                if ASYNC:
                    if n0 + BN < n_end:
                        copy_key_rows(smem, K_OFF, KJ, k, kbase, n0 + BN, Nk, ksn, BN, D, DP,
                                      tid, NT, table, tb, page, psp, PAGEDK)
                    cp_async_commit()
                else:
                    load_key_tile_t(smem, V_OFF, KD, v, vbase, n0, Nk, vsn, vsd, BN, D, DP,
                                    float32(1.0), tid, NT, table, tb, page, psp, PAGEDK)
            for a in range(RM):
                row = tr * RM + a
                mx = m_i[a]
                if SHFL:
                    mx = max(mx, rmx[a])
                elif TC % 4 == 0:  # (compile-time) the row's partial maxima in 16-byte loads
                    for c4 in range(TC // 4):
                        w = ld4(smem, RED_OFF + row * TC + 4 * c4)
                        mx = max(mx, max(max(w[0], w[1]), max(w[2], w[3])))
                else:
                    for c in range(TC):
                        mx = max(mx, smem[RED_OFF + row * TC + c])
                # A row that has seen no key yet keeps m = -inf; subtract 0 instead.
                m_use = mx if mx != NEG_INF else float32(0.0)
                alpha = math.exp2(m_i[a] - m_use)
                m_i[a] = mx
                lsum = l_i[a] * alpha
                for dd in range(RD):
                    acc[a, dd] *= alpha
                for bb in range(RN):
                    p = math.exp2(s[a, bb] - m_use)
                    lsum += p
                    smem[P_OFF + (tc + TC * bb) * LDP + row] = p
                l_i[a] = lsum
            if SHFL:
                cp_async_wait(0)  # this tile's V
            elif ASYNC:
                cp_async_wait(1)  # this tile's V (the next K may be in flight)
            cuda.syncthreads()
            if SHFL:  # K is consumed: the next K goes in during P V
                if n0 + BN < n_end:
                    copy_key_rows(smem, K_OFF, KJ, k, kbase, n0 + BN, Nk, ksn, BN, D, DP, tid,
                                  NT, table, tb, page, psp, PAGEDK)
                cp_async_commit()
            if live:  # (an empty tile's P is 0)
                tile_product(acc, xa, xd, smem, P_OFF, LDP, V_OFF, KJ, KD, BN, tr, tc, RM, RD,
                             TC, KU)
            cuda.syncthreads()
        if ASYNC:
            cp_async_wait(0)

        # Each thread summed its own columns; add up the row sums across the TC threads.
        for a in range(RM):
            smem[RED_OFF + (tr * RM + a) * TC + tc] = l_i[a]
        cuda.syncthreads()
        obase = b * osb + h * osh + q_row0 * osn
        if SPLIT:  # (compile-time) this split's partial output and lse
            obase += split * oss
            lrow += split * lss
        for a in range(RM):
            row = tr * RM + a
            i = q0 + row
            lsum = float32(0.0)
            for c in range(TC):
                lsum += smem[RED_OFF + row * TC + c]
            if i < Nq:
                inv = float32(1.0) / lsum if lsum > 0 else float32(0.0)
                for dd in range(RD):
                    d = column(tc, dd, KJ, KD, RD, TC)
                    if d < D:
                        store_f32(o, obase + i * osn + d * osd, acc[a, dd] * inv)
                if tc == 0:
                    val = NEG_INF
                    if lsum > 0:
                        val = (m_i[a] + math.log2(lsum)) * float32(LN2)
                    lse[lrow + i] = val

    attn_forward.__qualname__ = v.tag
    return attn_forward
