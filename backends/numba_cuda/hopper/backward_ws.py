"""The non-deterministic backward's one kernel (``kernel`` "dkdvq") with a producer
warpgroup (``HopperTiles.producer``, two consumer warpgroups): FlashAttention 3's and
cuDNN's structure (notes/backward_steps_2026-11-27.md, section 6d), built from the dkdvq
steps of ``backward.py`` and ``dq_atomic.py`` and the producer of ``pingpong.py``.

A block owns 128 keys (64 per consumer warpgroup), K and V resident; query steps of
``block_n`` rows stream through, under GQA for every query head of the group in turn.

- **Producer** (warpgroup 0, ``setmaxnreg`` down): its first 64 threads copy each step's Q
  and dO tiles and lse and delta (``cp.async``) into a ring of ``stages`` stages, each
  waiting for the stage's "empty" barrier and arriving on its "full" one when its copies
  land (``cp.async.mbarrier.arrive.noinc``). Lane 0 of its third warp adds each step's dQ
  part into the float32 accumulator: it waits for the step's "dq full" barrier (every
  consumer thread staged its rows), issues one bulk reduction of the step's rows, waits
  until the copy engine has read them and arrives on "dq empty".
- **Consumers** (warpgroups 1 and 2): per step, wait for "full"; ``Sᵀ``, ``dPᵀ``, ``Pᵀ``,
  ``dV += Pᵀ dO``, ``dSᵀ``, ``dK += dSᵀ Q`` as the dK/dV kernel (its overlapped form);
  ``dSᵀ``, from the registers that ``dK += dSᵀ Q`` reads, by ``stmatrix`` into one of two dS
  tiles (so that a step's store cannot reach the tile the other
  warpgroup's previous product still reads); a barrier of the 256 consumer threads; ``dQᵀ``
  for this warpgroup's half of the queries over the block's 128 keys; every product waited
  for, the stage released ("empty": lane 0 of each warp); then, once the reduction of two
  steps back has read the staging buffer ("dq empty"), its rows staged and "dq full"
  arrived on. No block-wide barrier in the loop, and no consumer waits for a reduction.

Kernel "dkdv" (the deterministic pair's dK/dV kernel in this form): the same without dQ's
parts: no dS tile, ``dQᵀ`` product, staging or reduction; each consumer step ends with its
four products, and the producer's reducing lane has nothing to do.

Dense rows, no window, softcap or ALiBi (as the one-warpgroup dkdvq); head dims 64 and 128
(at 128 a copying thread's pass moves 4 lines, half the swizzle's period: two shared
offsets, ``copy_step_rows``).
"""
from __future__ import annotations

from numba import cuda, float32, int32, int64, uint16, uint32

from ..device.constants import HEAD_GROUP, LOG2E, PACKING, SMEM_ALIGN
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import (
    cp_async4,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    warp_uniform,
)
from ..device.pipeline import (
    bulk_wait,
    bulk_wait_read,
    cp_async_arrive,
    empty_parity,
    full_parity,
    mbarrier_arrive,
    mbarrier_init,
    mbarrier_wait,
    named_sync,
    setmaxnreg_dec,
    setmaxnreg_inc,
    stage_of,
)
from ..device.prologue import block_tile, split_heads
from ..device.seams import query_range, sequence_rows
from ..device.user_mods import kernel_mods
from ..device.wgmma import (
    acc_to_local,
    fence_proxy_async,
    opaque,
    smem_address,
    wgmma_fence_acc,
    wgmma_wait_group_acc,
    zero_accumulators,
)
from ..tilings import HOPPER_ALIGN
from .backward_scores import grads_t, probs_t, read_stats
from .dq_atomic import issue_dqt, reduce_dq, stage_dq, store_ds_packed
from .epilogue import store_o
from .forward import LINE, issue_pv, issue_qk, load_tile, pack_p

#: Elements (16-bit) of one mbarrier in the shared array.
BAR = 4
#: Producer threads that copy (two warps: a tile's rows in passes of 16); the lane that
#: adds dQ is lane 0 of warp 2.
COPIERS = 64
REDUCER = 64
PRODUCER_REGS, CONSUMER_REGS = 56, 224


@device_function
def copy_step_rows(smem, off, so, so_odd, src, g, left, sn, passes, RS):
    """One copying thread's share of a step's tile (``pingpong.copy_rows``' copies, in
    fewer instructions where the producer has 56 registers, not 24): ``passes`` (known
    when compiled: the loop unrolls) 16-byte copies, to shared element ``off + so + 64 p
    RS`` (``off`` the tile's stage; ``so_odd`` for odd passes: where a pass moves 4 lines,
    half the swizzle's period, as at head dim 128, odd passes' lines swizzle the other
    way) from source element ``g + p RS sn``; passes from ``left`` (the rows left at and
    after the first pass's row) on are zero-filled, source size 0, so nothing is read
    there and the address past the rows does not matter (CUTLASS's zero-fill copies). A
    pass is a copy, an add and a compare: copy_rows' multiply and second, predicated copy
    cost this kernel about 20 instructions a copy, and made its two copying warps its
    bottleneck (notes/ws_copies_2026-11-27.md)."""
    for p in range(passes):
        cp_async16(smem, off + (so_odd if p & 1 else so) + 64 * p * RS, src, g,
                   uint32(16) if p * RS < left else uint32(0))
        g += RS * sn


@device_function
def copy_stats(smem, e0, lse, delta, lbase, lsn, dbase, m, Nq, BN, wtid):
    """A step's lse and delta (``BN`` columns from query ``m``) into the stage's stats
    (lse of column ``c`` at element ``e0 + 2 c``, delta at ``e0 + 2 (BN + c)``) by the
    copying threads, ``cp.async`` only (their completion is what the stage's "full"
    barrier counts): queries past ``Nq`` get 0, harmless there (their Q and dO rows are
    zero, so P = 1 meets zeros in every product, and their dQ rows are not added)."""
    for k in range((2 * BN + COPIERS - 1) // COPIERS):  # (a known trip count, unrolled)
        c = wtid + k * COPIERS
        if c < 2 * BN:
            i = m + (c if c < BN else c - BN)
            live = uint32(4) if i < Nq else uint32(0)  # (size 0: nothing read)
            if c < BN:
                cp_async4(smem, e0 + 2 * c, lse, lbase + i * lsn, live)
            else:
                cp_async4(smem, e0 + 2 * c, delta, dbase + i, live)


@device_function
def next_step(gi, mq, BN, m_begin, m_end):
    """``(gi, mq)`` of the step after query rows ``mq..`` of the group's ``gi``-th head:
    the head's next ``BN`` rows, or the next head's first (each role walks the steps in
    the same order, counting rather than dividing the step number)."""
    mq += BN
    if mq >= m_end:
        return gi + 1, m_begin
    return gi, mq


def make_attn_backward_dkdvq_ws(var, sizes):
    """The warp-specialized dkdvq (or dkdv) kernel of variant ``var`` (``sizes``:
    ``backward._sizes``' constants for the consumers' 128 threads)."""
    (D, BM, BN, _NT, CH, KSTEPS, PSTEPS, NTILES, NP, CAUSAL, BF16, OVERLAP,
     PACKED, CAP, _CAP_C, ALIBI) = sizes
    t = var.tiles
    if (t.warpgroups != 2 or not OVERLAP or PACKED != PACKING[""] or CAP or ALIBI
            or var.window or var.user is not None or D not in (64, 128) or BN % 16):
        raise ValueError(f"the warp-specialized dkdv(q) kernel takes two consumer warpgroups "
                         f"with the overlap, dense rows, no window or modifiers, head dim "
                         f"64 or 128, query steps of 16..64: {var.tag}")
    # (compile-time) False: kernel "dkdv", the deterministic pair's dK/dV kernel in this
    # form (no dS tile, dQ product, staging or reduction; the producer's reducing lane idle)
    DQ = var.kernel == "dkdvq"
    if not DQ and t.own_dq:
        raise ValueError(f"own_dq is a form of the dQ parts (dkdvq): {var.tag}")
    _, _, _, _, VS, KEEPS = kernel_mods(var)  # (none here: device_mods' trivial ones)
    STAGES = t.stages
    OWN = t.own_dq  # (compile-time) each consumer adds its own keys' dQ part
    WGQ = 1 if OWN else 2  # consumers whose dQ parts share a staging buffer
    TILE = BN * D * 2
    K_OFF = 0
    V_OFF = BM * D * 2
    Q_OFF = 2 * BM * D * 2
    DO_OFF = Q_OFF + STAGES * TILE
    STATS = 2 * BN * 4  # bytes of one stage's lse and delta
    STATS_OFF = DO_OFF + STAGES * TILE
    DS_OFF = STATS_OFF + (STAGES * STATS + HOPPER_ALIGN - 1) // HOPPER_ALIGN * HOPPER_ALIGN
    # a dS tile: two blocks of BN lines x 64 keys, two of them (own_dq: one tile, each
    # consumer reading only its own block)
    DS_BUF = 2 * BN * LINE
    QN = BN // WGQ  # queries of a consumer's dQ part
    QTILES = QN // 8
    HALVES = D // 64
    DQ_BUF = BN * D * 4  # a staging buffer: the step's BN rows (QN per consumer)
    DQ_OFF = DS_OFF + ((1 if OWN else 2) * DS_BUF if DQ else 0)
    # staging buffers: two (own_dq: two per consumer), each with its "dq full" and "dq
    # empty" barriers (dkdv: none)
    NQB = 2 * (3 - WGQ) if DQ else 0
    BAR_OFF = DQ_OFF + NQB * DQ_BUF
    B_LBO = BN * LINE
    NS = BN // 2
    NO = D // 2
    RS = COPIERS // CH  # rows per pass of a tile copy: 8 at D=64, 4 at D=128 (copy_step_rows)
    if BN % RS or RS % 4:
        raise ValueError(f"dkdvq (producer): query steps of {BN} rows are not whole passes "
                         f"of {COPIERS} copying threads: {var.tag}")

    def attn_backward_dkdv_wgmma(q, k, v, do, lse, delta, dk, dv, Nq, Nk, Hq, Hkv, group,
                                 causal_offset, qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                                 vsb, vsh, vsn, vsd, gsb, gsh, gsn, gsd,
                                 dksb, dksh, dksn, dksd, dvsb, dvsh, dvsn, dvsd,
                                 lsb, lsh, lsn, scale, slopes, ssb, ssh, m0, m1, m2, m3, e0,
                                 e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14,
                                 e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table, tsb, page,
                                 psp, TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        wtid = tid & 127
        wg = warp_uniform((tid >> 7) - 1)  # consumer warpgroup 0 or 1; -1: the producer
        warp = (tid >> 5) & 3
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        kt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, False, HEAD_GROUP)
        b, hk, _ = split_heads(bh, Hkv, 1)
        k0 = kt * BM
        q_row0, k_row0, Nq, Nk, causal_offset, sb0, sstep = sequence_rows(
            b, 0, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        qb0 = b * qsb + q_row0 * qsn
        gb0 = b * gsb + q_row0 * gsn
        lb0 = b * lsb + q_row0 * lsn
        sl2 = float32(scale * LOG2E)

        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad
        el = pad >> 1
        full = el + BAR_OFF // 2
        empty = full + BAR * STAGES
        dq_full = empty + BAR * STAGES
        dq_empty = dq_full + NQB * BAR

        m_begin, m_full = query_range(k0, BM, BN, causal_offset, CAUSAL)
        m_end = Nq
        per_head = (m_end - m_begin + BN - 1) // BN if m_end > m_begin else 0
        n_steps = group * per_head

        if tid == 0:
            for st in range(STAGES):
                mbarrier_init(smem, full + BAR * st, COPIERS)
                mbarrier_init(smem, empty + BAR * st, 8)  # (lane 0 of each consumer warp)
            for bb in range(NQB):
                mbarrier_init(smem, dq_full + BAR * bb, 128 * WGQ)
                mbarrier_init(smem, dq_empty + BAR * bb, 1)
        if wg >= 0:  # K and V, by the consumers' 256 threads
            load_tile(smem, el + K_OFF // 2, k, b * ksb + hk * ksh + k_row0 * ksn, k0, Nk,
                      ksn, BM, CH, tid - 128, 256)
            load_tile(smem, el + V_OFF // 2, v, b * vsb + hk * vsh + k_row0 * vsn, k0, Nk,
                      vsn, BM, CH, tid - 128, 256)
            cp_async_commit()
            cp_async_wait(0)
            fence_proxy_async()
        cuda.syncthreads()  # the barriers initialized, K and V landed

        if wg < 0:
            setmaxnreg_dec(PRODUCER_REGS)
            if wtid < COPIERS:  # the copies, a stage as soon as it is free
                # (chunk c of rows r + p RS, as pingpong.copy_rows, the shared offset computed
                # once)
                c = wtid % CH
                r = wtid // CH
                line = el + (c >> 3) * (BN * 64) + r * 64
                so = line + (((c & 7) ^ (r & 7)) << 3)
                so_odd = line + (((c & 7) ^ ((r + RS) & 7)) << 3)
                passes = BN // RS
                gi = 0
                mq = m_begin
                for it in range(n_steps):
                    h = hk * group + gi
                    st = stage_of(it, STAGES)
                    if it >= STAGES:
                        mbarrier_wait(smem, empty + BAR * st, empty_parity(it, STAGES))
                    copy_step_rows(smem, (Q_OFF + st * TILE) // 2, so, so_odd, q,
                                   qb0 + h * qsh + (mq + r) * qsn + 8 * c, Nq - mq - r, qsn,
                                   passes, RS)
                    copy_step_rows(smem, (DO_OFF + st * TILE) // 2, so, so_odd, do,
                                   gb0 + h * gsh + (mq + r) * gsn + 8 * c, Nq - mq - r, gsn,
                                   passes, RS)
                    copy_stats(smem, el + (STATS_OFF + st * STATS) // 2, lse, delta,
                               lb0 + h * lsh, lsn, sb0 + h * sstep, mq, Nq, BN, wtid)
                    cp_async_arrive(smem, full + BAR * st)
                    gi, mq = next_step(gi, mq, BN, m_begin, m_end)
                cp_async_commit()
                cp_async_wait(0)
            elif DQ and wtid == REDUCER:  # dQ's parts, added as the consumers stage them
                gi = 0
                mq = m_begin
                for it in range(n_steps):
                    h = hk * group + gi
                    for w in range(3 - WGQ):  # (own_dq: each consumer's buffer in turn)
                        bb = (it & 1) + 2 * w
                        mbarrier_wait(smem, dq_full + BAR * bb, int32_parity(it >> 1))
                        reduce_dq(smem, el + (DQ_OFF + bb * DQ_BUF) // 2, slopes,
                                  b * ssb + h * ssh + (q_row0 + mq) * D, D, Nq - mq, BN)
                    bulk_wait_read(0)
                    for w in range(3 - WGQ):
                        mbarrier_arrive(smem, dq_empty + BAR * ((it & 1) + 2 * w))
                    gi, mq = next_step(gi, mq, BN, m_begin, m_end)
                bulk_wait(0)
        else:
            setmaxnreg_inc(CONSUMER_REGS)
            ka = at + K_OFF + 64 * wg * LINE  # this warpgroup's 64 keys of K and of V
            va = at + V_OFF + 64 * wg * LINE
            j0 = k0 + 64 * wg + 16 * warp + g
            s = cuda.local.array(NS, float32)
            dp = cuda.local.array(NS, float32)
            gc = cuda.local.array(NS, float32)
            mods = cuda.local.array(5, float32)
            ls = cuda.local.array(NP, float32)
            dl = cuda.local.array(NP, float32)
            pf = cuda.local.array(NP, uint32)
            dsf = cuda.local.array(NP, uint32)
            dka = zero_accumulators(D)
            dva = zero_accumulators(D)
            mq = m_begin
            for it in range(n_steps):
                st = stage_of(it, STAGES)
                mbarrier_wait(smem, full + BAR * st, full_parity(it, STAGES))
                fence_proxy_async()  # (the copies are generic-proxy writes)
                qb = at + Q_OFF + st * TILE
                gb = at + DO_OFF + st * TILE
                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(ka), qb,
                                KSTEPS, BM, BN)
                pacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(va), gb,
                                KSTEPS, BM, BN)
                read_stats(ls, dl, smem, el + (STATS_OFF + st * STATS) // 2, BN, NTILES, tq)
                mask = CAUSAL and mq < m_full
                sacc = wgmma_wait_group_acc(1, sacc)  # Sᵀ (dPᵀ may still run)
                acc_to_local(sacc, s)
                if mask:
                    probs_t(s, gc, ls, mq, j0, causal_offset, sl2, True, CAUSAL, -1, -1,
                            NTILES, tq, mods, False, False, False, False, VS, KEEPS,
                            (0, 0, 0, 0, ()))
                else:
                    probs_t(s, gc, ls, mq, j0, causal_offset, sl2, False, CAUSAL, -1, -1,
                            NTILES, tq, mods, False, False, False, False, VS, KEEPS,
                            (0, 0, 0, 0, ()))
                pack_p(BF16, pf, s, NP)
                dva = issue_pv(BF16, wgmma_fence_acc(dva), pf, gb, PSTEPS, B_LBO)
                pacc = wgmma_wait_group_acc(1, pacc)  # dPᵀ (dV += Pᵀ dO may still run)
                acc_to_local(pacc, dp)
                grads_t(s, gc, dp, dl, NTILES, False)
                pack_p(BF16, dsf, dp, NP)
                dka = issue_pv(BF16, wgmma_fence_acc(dka), dsf, qb, PSTEPS, B_LBO)
                if DQ and OWN:  # (compile-time) dQᵀ over this warpgroup's keys, all BN queries
                    ds = DS_OFF + wg * BN * LINE
                    store_ds_packed(smem, el + ds // 2, dsf, warp, lane, NTILES)
                    fence_proxy_async()
                    if wg == 0:
                        named_sync(4, 128)
                    else:
                        named_sync(5, 128)
                    qa0, qa1 = issue_dqt(BF16, wgmma_fence_acc(zero_accumulators(QN)),
                                         wgmma_fence_acc(zero_accumulators(QN)), ka, at + ds,
                                         BM, BN, HALVES, 4)
                elif DQ:
                    # dSᵀ into this step's dS tile (two: the other warpgroup's dQᵀ of the
                    # step before may still read the other), published to both warpgroups
                    ds = DS_OFF + (it & 1) * DS_BUF
                    store_ds_packed(smem, el + (ds + wg * BN * LINE) // 2, dsf, warp, lane,
                                    NTILES)
                    fence_proxy_async()
                    named_sync(3, 256)
                    qa0, qa1 = issue_dqt(BF16, wgmma_fence_acc(zero_accumulators(QN)),
                                         wgmma_fence_acc(zero_accumulators(QN)), at + K_OFF,
                                         at + ds + wg * QN * LINE, BM, BN, HALVES, 8)
                dka = wgmma_wait_group_acc(0, dka)
                dva = wgmma_wait_group_acc(0, dva)
                if DQ:
                    qa0 = wgmma_wait_group_acc(0, qa0)
                if lane == 0:  # (every product that read the stage is done)
                    mbarrier_arrive(smem, empty + BAR * st)
                if DQ:  # (compile-time; dkdv: the step ends with its products)
                    # (own_dq: this warpgroup's own buffers, its rows from query 0)
                    bb = (it & 1) + (2 * wg if OWN else 0)
                    i0 = 0 if OWN else wg * QN
                    if it >= 2:  # the reduction of two steps back has read the buffer
                        mbarrier_wait(smem, dq_empty + BAR * bb, int32_parity((it >> 1) - 1))
                    stage = el + (DQ_OFF + bb * DQ_BUF + i0 * D * 4) // 2
                    acc_to_local(qa0, s)
                    stage_dq(smem, stage, s, 0, D, warp, g, tq, QTILES, i0)
                    if HALVES == 2:
                        qa1 = wgmma_wait_group_acc(0, qa1)
                        acc_to_local(qa1, s)
                        stage_dq(smem, stage, s, 1, D, warp, g, tq, QTILES, i0)
                    fence_proxy_async()
                    mbarrier_arrive(smem, dq_full + BAR * bb)
                _, mq = next_step(0, mq, BN, m_begin, m_end)
            if DQ and not OWN:  # the other warpgroup's last dQᵀ read this one's K
                named_sync(3, 256)  # rows, which its epilogue stages dK through
            out = cuda.local.array(NO, float32)
            sc = float32(scale)
            one = float32(1.0)
            acc_to_local(dka, out)
            store_o(BF16, smem, el + K_OFF // 2, dk, b * dksb + hk * dksh + k_row0 * dksn,
                    k0 + 64 * wg, j0, Nk, dksn, dksd, out, sc, sc, D, BM, wg, warp, g, tq,
                    wtid)
            acc_to_local(dva, out)
            store_o(BF16, smem, el + V_OFF // 2, dv, b * dvsb + hk * dvsh + k_row0 * dvsn,
                    k0 + 64 * wg, j0, Nk, dvsn, dvsd, out, one, one, D, BM, wg, warp, g, tq,
                    wtid)

    attn_backward_dkdv_wgmma.__qualname__ = var.tag
    return attn_backward_dkdv_wgmma


@device_function
def int32_parity(n):
    """The parity of phase ``n`` of a barrier (its ``n``-th completion, from 0)."""
    return int32(uint32(n) & uint32(1))

