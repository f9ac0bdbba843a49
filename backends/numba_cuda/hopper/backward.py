"""Hopper (sm_90a) backward kernels for fp16/bf16 with warpgroup MMAs: ``attn_backward_dkdv_
wgmma`` (key tiles outer, query tiles inner) and ``attn_backward_dq_wgmma`` (query tiles
outer, key tiles inner).

The two-kernel, atomic-free scheme of ``tensor_core/backward.py``, with the same launch
arguments (``launch.signature``), after the same preprocess (``delta = rowsum(dO ∘ O)``,
the SIMT ``attn_backward_preprocess``); each output element is summed by one thread in a
fixed order, so the gradients are bitwise deterministic. Every product takes operand
layouts the forward (``hopper/forward.py``) already uses: shared tiles in the 128-byte
swizzle, read K-major as the A operand or as Bᵀ (``issue_qk``), MN-major as B
(``issue_pv``), and the second product's A from registers. To land the first products'
results in registers as the A fragments of the second, the dK/dV kernel computes the
transposed quantities (keys as rows):

- dK/dV: one block per (key tile of ``64 * warpgroups`` keys, batch * key/value head);
  warpgroup ``wg`` owns 64 keys. At D=256 their dK and dV would hold 256 fp32 accumulators
  per thread, all a thread has: two blocks (grid z, ``tilings.dkdv_passes``) each make 128
  of the head dim's columns of dK and dV, each computing Sᵀ and dPᵀ over the whole head
  dim (the mma.sync backward makes two passes over its query tiles at D=256 likewise).
  Per query step of ``block_n`` queries (under GQA, for every query head of the group in
  turn; Q and dO double-buffered):
  ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (SS: K, V rows as A, the Q, dO tiles as Bᵀ);
  ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse · log2 e)`` with lse per query column (a row that
  sees no key has lse −inf, read as +inf: P = 0; queries past Nq too);
  ``dV += Pᵀ dO`` (RS: Pᵀ packed, dO MN-major); ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``;
  ``dK += dSᵀ Q`` (RS, Q MN-major); dK is scaled by ``scale`` when stored.
- dQ: one block per (query tile of ``64 * warpgroups`` rows, batch * query head); per key
  step of ``block_n`` keys (K and V double-buffered): ``S = Q Kᵀ``, ``dP = dO Vᵀ`` (SS),
  ``dS = P ∘ (dP − delta)``, ``dQ += dS K`` (RS, K MN-major), scaled when stored.

Both score products of a step are issued at once. With the tiling's ``overlap`` the
elementwise work starts under the wgmmas still running: P is computed while ``dP`` (``dPᵀ``)
runs, and the dK/dV kernel issues ``dV += Pᵀ dO`` before it computes ``dSᵀ``; without it,
both products are waited for, P and dS computed and packed, and the two RS products issued
together (fewer registers held).
Every group is waited for before the step ends (the next step's copies overwrite the
buffers it read), or, with a tiling of ``stages`` 3, the step's last products (dV and dK,
or dQ) are left to retire under the next step's copies and score products (the wait that
takes the next step's S takes them: wgmma groups complete in order), the streamed tiles
they read (Q and dO, or K) in three buffers so that the next step's copies write the one
two steps back. The causal mask and a sliding window apply through the seams (``hides``,
``visible``) on steps that cross the diagonal or a window's edge only; a window also cuts the
steps to its range (``window_query_range`` in the dK/dV kernel, ``visited_keys`` in the dQ
kernel), so a window of W keys costs O(N W). Keys past Nk are masked in the dQ kernel (in
the dK/dV kernel they only reach rows of dK and dV that are never stored). The softcap and
ALiBi and the user's score_mod (second seam, the forward's order: ``backward_scores.prob``)
rework each recomputed score before its exponential, and dS takes their derivative. A
mask_mod: steps and tiles its BlockMask's classes leave empty are skipped (with the query or
key range cut to them), partial ones masked per score. Serves dense and varlen rows (a
varlen call's classes are per sequence), causal or not.
"""
from __future__ import annotations

from dataclasses import replace

from numba import cuda, float32, int64, uint16, uint32

from ..device.constants import DENSE, HEAD_GROUP, LOG2E, PACKING, SMEM_ALIGN
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import cp_async_commit, cp_async_wait, warp_uniform
from ..device.pipeline import bulk_wait, bulk_wait_read, named_sync
from ..device.prologue import block_tile, query_stats, split_heads
from ..device.seams import (
    EMPTY,
    PARTIAL,
    class_query_range,
    packed_tile,
    query_range,
    sequence_rows,
    tile_class,
    visited_keys,
    window_query_range,
)
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
from ..tilings import HOPPER_ALIGN, HOPPER_ROWS, dkdv_passes
from .backward_scores import (
    grads_row,
    grads_t,
    probs_grads_t,
    probs_row,
    probs_t,
    read_stats,
    score_mods,
    stage_stats,
)
from .dq_atomic import issue_dqt, reduce_dq, stage_dq, store_ds
from .epilogue import store_o
from .forward import LINE, issue_pv, issue_qk, load_tile, pack_p, publish


@device_function
def wg_sync(wg):
    """The barrier of this warpgroup's 128 threads alone (named barrier ``1 + wg``)."""
    if wg == 0:
        named_sync(1, 128)
    else:
        named_sync(2, 128)


@device_function
def step_dq(BF16, smem, el, at, DS_OFF, dp, ka, wg, warp, lane, g, tq, BM, BN, NTILES,
            HALVES, WGS, QN, DQ_KSTEPS):
    """The dkdvq kernel's dQ of one step: ``dSᵀ`` (``dp``) into this warpgroup's dS tile,
    published to the async proxy and across the warpgroup (the barrier also tells it that
    the staging buffer of two steps ago is free: its first warp waited for the reductions
    that read it), then ``dQᵀ = Kᵀ dSᵀ`` issued (``dq_atomic.issue_dqt``); returns its
    accumulators. ``WGS`` 1: over the warpgroup's 64 keys (``ka``: its rows of K), for the
    step's ``BN`` queries; 2: over the block's 128 keys, both warpgroups' dS tiles (a
    barrier of the block), for this warpgroup's half of the queries (``ka``: K's first
    row), so that a block adds one dQ part per query, not two. (``QN = BN / WGS`` and
    ``DQ_KSTEPS = 4 WGS`` come as the kernel's literals: the accumulators' count must be
    one.)"""
    ds = DS_OFF + wg * BN * LINE
    store_ds(smem, el + ds // 2, dp, BF16, warp, g, tq, NTILES)
    fence_proxy_async()
    if warp == 0 and lane == 0:
        bulk_wait_read(1)
    if WGS == 2:  # (compile-time) both warpgroups' dS, this one's queries (lines)
        cuda.syncthreads()
        dsa = at + DS_OFF + wg * (BN // 2) * LINE
    else:
        wg_sync(wg)
        dsa = at + ds
    return issue_dqt(BF16, wgmma_fence_acc(zero_accumulators(QN)),
                     wgmma_fence_acc(zero_accumulators(QN)), ka, dsa, BM, BN, HALVES,
                     DQ_KSTEPS)


def _sizes(var, kernel):
    """The compile-time constants both kernels share (the last: dense or varlen rows,
    ``device/seams.sequence``); checks the variant."""
    D, t = var.head_dim, var.tiles
    if D % 64:
        raise ValueError(f"head_dim={D} must be a multiple of 64 for the wgmma backward")
    if var.tiles.producer and var.kernel == "dq":
        raise ValueError(f"a producer warpgroup serves the dkdv and dkdvq kernels only "
                         f"(hopper/backward_ws.py): {var.tag}")
    if (var.packed not in HOPPER_ROWS or var.split
            or ((var.alibi or var.user is not None) and var.kernel == "dkdvq")
            or (var.user is not None and t.stages != 2)):
        raise ValueError(f"the wgmma backward takes dense or varlen rows, causal, a window, "
                         f"the softcap, ALiBi and user mods (those two not in dkdvq; user mods "
                         f"with two buffers): {var.tag}")
    CH = D // 8  # 16-byte chunks per row
    if kernel == "dkdv" and 2 * t.block_n > t.threads:  # (backward_scores.stage_stats)
        raise ValueError(f"dkdv: a step's lse and delta take 2 x {t.block_n} copying threads, "
                         f"more than the block's {t.threads}: {t}")
    if t.block_n % (t.threads // CH) or t.block_m % (t.threads // CH):
        raise ValueError(f"{kernel}: tiles of {t.block_m} and {t.block_n} rows must be "
                         f"whole passes of the copies ({t.threads // CH} rows): {t}")
    return (D, t.block_m, t.block_n, t.threads, CH, D // 16, t.block_n // 16,
            t.block_n // 8, t.block_n // 4, bool(var.causal),
            var.dtype == "bfloat16", t.overlap, PACKING[var.packed], bool(var.softcap),
            float32(var.softcap or 1.0), bool(var.alibi))


def make_attn_backward_dkdv_wgmma(var):
    """dK, dV of variant ``var`` (family "hopper", kernel "dkdv"): a key tile of
    ``64 * warpgroups`` keys per block, query steps of ``block_n``
    (:class:`tilings.HopperTiles`). Kernel "dkdvq" (the non-deterministic mode): and each
    step's part of dQ, added into a float32 accumulator (``hopper/dq_atomic.py``), which
    the launch passes where ALiBi kernels take their slopes (``slopes``, ``ssb``, ``ssh``:
    the accumulator and its batch and head strides; rows of ``D`` elements): the wgmma
    backward serves no ALiBi."""
    # (head dim, keys per block, queries per step, threads, 16-byte chunks per row,
    # k-steps of the score products, k-steps of dV/dK, 8-query n-tiles,
    # packed registers of Pᵀ)
    if var.tiles.producer:  # (a producer warpgroup; dkdv: the same kernel without dQ)
        from .backward_ws import make_attn_backward_dkdvq_ws

        return make_attn_backward_dkdvq_ws(var, _sizes(
            replace(var, tiles=replace(var.tiles, producer=False, own_dq=False)), "dkdv"))
    (D, BM, BN, NT, CH, KSTEPS, PSTEPS, NTILES, NP, CAUSAL, BF16, OVERLAP,
     PACKED, CAP, CAP_C, ALIBI) = _sizes(var, "dkdv")
    LEFT, RIGHT = var.bounds  # a sliding window (-1: an unbounded side)
    WINDOW = bool(var.window)
    SMOD, MMOD, VIEWS, _, VS, KEEPS = kernel_mods(var)  # the user's score_mod, mask_mod
    GRAD = CAP or SMOD  # (dS takes the scores' derivative)
    # Q and dO in STAGES buffers: 3, a step's dV and dK products retire under the next
    # step's copies and score products (the wait that takes S of step it + 1 takes them,
    # wgmma groups completing in order), its buffers rewritten one step later
    STAGES = var.tiles.stages
    DEFER = STAGES == 3
    # shared memory, in bytes from the aligned start: K, V (resident), Q[STAGES], dO[STAGES]
    TILE = BN * D * 2
    K_OFF = 0
    V_OFF = BM * D * 2
    Q_OFF = 2 * BM * D * 2
    DO_OFF = Q_OFF + STAGES * TILE
    B_LBO = BN * LINE  # MN-major Q, dO: the next 64 columns (a block of BN lines)
    # At D=256 two blocks per key tile, each for DP of dK's and dV's columns (dK and dV of
    # the whole head dim would hold 256 accumulators per thread)
    PASSES = dkdv_passes(D)
    DP = D // PASSES
    HALF = (DP // 64) * BN * LINE  # the MN-major Q, dO tiles' next DP columns, in bytes
    NS, NO = BN // 2, DP // 2  # accumulators per thread: Sᵀ (and dPᵀ), dK (and dV)
    DQ = var.kernel == "dkdvq"  # (compile-time) dQ's part of each step too
    if DQ and (PASSES > 1 or DEFER):
        raise ValueError(f"the dkdvq kernel takes head dims up to 128 and two buffers: "
                         f"{var.tag}")
    DS_OFF = DO_OFF + STAGES * TILE  # (DQ) each warpgroup's dSᵀ tile: BN lines of 64 keys
    HALVES = D // 64
    # (DQ) two warpgroups: each makes the dQ part of half the step's queries over the
    # block's 128 keys (step_dq); one: of all of them over its 64 keys
    WGS = var.tiles.warpgroups
    QN = BN // WGS  # (DQ) queries of a warpgroup's dQ part
    QTILES = QN // 8  # (DQ) its 8-query n-tiles
    if DQ and (QN % 16 or (WGS == 2 and BN % 16)):
        raise ValueError(f"dkdvq: a warpgroup's dQ part takes a multiple of 16 queries: "
                         f"{var.tag}")
    STAGE = QN * D * 4  # (DQ) a staging buffer of dQ rows; two per warpgroup
    DQ_OFF = DS_OFF + (BM // 64) * BN * LINE
    # lse and delta of a step's query columns, copied with its Q and dO tiles (two buffers
    # of BN lse then BN delta, fp32: backward_scores.stage_stats), after everything else
    STATS_OFF = ((DQ_OFF + 2 * (BM // 64) * STAGE) if DQ else DS_OFF)
    STATS = 2 * BN * 4  # bytes of one buffer

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
        wg = warp_uniform(tid >> 7)  # (uniform to ptxas: so are the descriptors from it)
        warp = (tid >> 5) & 3  # within the warpgroup
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        # (causal: heaviest first; the first key tile is seen by the most queries)
        kt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, False, HEAD_GROUP)
        b, hk, _ = split_heads(bh, Hkv, 1)
        b, kt = packed_tile(b, kt, cu_k, nseq, BM, cuda.threadIdx.x & 31,
                            True, PACKED)
        k0 = kt * BM
        # (D=256) the columns of dK and dV this block makes: grid z (tilings.dkdv_passes)
        half = cuda.blockIdx.z if PASSES > 1 else 0
        # this batch entry's rows (varlen: its sequence's)
        q_row0, k_row0, Nq, Nk, causal_offset, sb0, sstep = sequence_rows(
            b, 0, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and k0 >= Nk:  # (compile-time test first) past the sequence
            return
        qb0 = b * qsb + q_row0 * qsn
        gb0 = b * gsb + q_row0 * gsn
        lb0 = b * lsb + q_row0 * lsn
        sl2 = float32(scale * LOG2E)
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))

        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad  # shared address of the aligned start (descriptors)
        el = pad >> 1  # its element index (copies)

        # Query tiles before m_begin see none of our keys; from m_full on, all (no mask).
        m_begin, m_full = query_range(k0, BM, BN, causal_offset, CAUSAL)
        m_end = m_last = Nq
        if WINDOW:  # (compile-time) the window ends the rows too; [m_full, m_last]: whole
            m_begin, m_end, m_full, m_last = window_query_range(k0, BM, BN, Nq, causal_offset,
                                                                CAUSAL, LEFT, RIGHT)
        if MMOD:  # (compile-time) only the query tiles the group's classes leave
            m_begin, m_end = class_query_range(cls, b * csb + hk * group * csh, csh, group,
                                               csq, k0, BM, Nq, Nk, BN, m_begin, m_end)
        per_head = (m_end - m_begin + BN - 1) // BN if m_end > m_begin else 0
        n_steps = group * per_head

        load_tile(smem, el + K_OFF // 2, k, b * ksb + hk * ksh + k_row0 * ksn, k0, Nk, ksn, BM,
                  CH, tid, NT)
        load_tile(smem, el + V_OFF // 2, v, b * vsb + hk * vsh + k_row0 * vsn, k0, Nk, vsn, BM,
                  CH, tid, NT)
        if n_steps > 0:
            h = hk * group
            load_tile(smem, el + Q_OFF // 2, q, qb0 + h * qsh, m_begin, Nq, qsn, BN, CH, tid,
                      NT)
            load_tile(smem, el + DO_OFF // 2, do, gb0 + h * gsh, m_begin, Nq, gsn, BN, CH,
                      tid, NT)
            stage_stats(smem, el + STATS_OFF // 2, lse, delta, lb0 + h * lsh, lsn,
                        sb0 + h * sstep, m_begin, Nq, BN, tid)
        cp_async_commit()

        ka = at + K_OFF + 64 * wg * LINE  # this warpgroup's 64 keys of K and of V
        kd = at + K_OFF if WGS == 2 else ka  # (DQ) the keys of its dQ part (step_dq)
        va = at + V_OFF + 64 * wg * LINE
        j0 = k0 + 64 * wg + 16 * warp + g  # this thread's keys: j0, j0 + 8
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        gc = cuda.local.array(NS, float32)  # (CAP, SMOD) the scores' derivative
        mods = cuda.local.array(5, float32)  # (CAP, ALIBI, SMOD) score_mods
        ls = cuda.local.array(NP, float32)
        dl = cuda.local.array(NP, float32)
        pf = cuda.local.array(NP, uint32)  # Pᵀ, packed: 4 per k-step of dV += Pᵀ dO
        dsf = cuda.local.array(NP, uint32)  # dSᵀ, packed
        dka = zero_accumulators(DP)
        dva = zero_accumulators(DP)

        # step it: query head hk * group + gi, rows mq.. (a head's steps, then the next
        # head's); kept by counting, not by dividing it by per_head at run time
        gi = 0
        mq = m_begin
        for it in range(n_steps):
            h = hk * group + gi
            mc = mq  # this step's rows
            gn, mn = gi, mq + BN  # the next step's head and rows
            if mn >= m_end:
                gn, mn = gi + 1, m_begin
            hn = hk * group + gn
            gi, mq = gn, mn
            buf = (it % STAGES) * TILE
            cp_async_wait(0)  # Q, dO of step it (K and V with the first)
            publish()
            # Every warpgroup has waited for its wgmmas of step it-1 (DEFER: of step it-2,
            # whose last products retired when step it-1 took its Sᵀ): their buffers take
            # step it+1.
            if it + 1 < n_steps:
                nb = (((it + 1) % STAGES) * TILE) // 2
                load_tile(smem, el + Q_OFF // 2 + nb, q, qb0 + hn * qsh, mn, Nq, qsn, BN, CH,
                          tid, NT)
                load_tile(smem, el + DO_OFF // 2 + nb, do, gb0 + hn * gsh, mn, Nq, gsn, BN,
                          CH, tid, NT)
                stage_stats(smem, el + (STATS_OFF + ((it + 1) & 1) * STATS) // 2, lse, delta,
                            lb0 + hn * lsh, lsn, sb0 + hn * sstep, mn, Nq, BN, tid)
            cp_async_commit()
            partial = False
            if MMOD:  # (compile-time) the step's class under the mask_mod
                cl = tile_class(cls, b * csb + h * csh, csq, mc, BN, Nq, k0, BM, Nk)
                if cl == EMPTY:  # (no wgmma in flight; the next wait takes the copies)
                    continue
                partial = cl == PARTIAL
            qb = at + Q_OFF + buf
            gb = at + DO_OFF + buf
            hb = half * HALF  # (the block's columns of Q and dO, as dK's and dV's B)
            user = (b, h, Nq, Nk, margs)  # (SMOD, MMOD) what the user's mods take

            # (K's and V's descriptors made here, not hoisted out of the loop: opaque)
            sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(ka), qb,
                            KSTEPS, BM, BN)
            pacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(va), gb,
                            KSTEPS, BM, BN)
            if CAP or ALIBI or SMOD:  # (compile-time) this query head's modifiers
                score_mods(mods, scale, slopes, b, h, ssb, ssh, CAP_C, ALIBI)
            # this step's column statistics, copied with its tiles
            read_stats(ls, dl, smem, el + (STATS_OFF + (it & 1) * STATS) // 2, BN, NTILES, tq)
            # a step across the diagonal, or (a window) across one of its edges
            # (or partial under the mask_mod)
            mask = partial or (CAUSAL and mc < m_full) or (WINDOW and (mc < m_full
                                                                      or mc + BN - 1 > m_last))
            if OVERLAP:
                sacc = wgmma_wait_group_acc(1, sacc)  # Sᵀ (dPᵀ may still run)
                acc_to_local(sacc, s)
                if mask:
                    probs_t(s, gc, ls, mc, j0, causal_offset, sl2, True, CAUSAL, LEFT, RIGHT,
                            NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
                else:
                    probs_t(s, gc, ls, mc, j0, causal_offset, sl2, False, CAUSAL, LEFT,
                            RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
                pack_p(BF16, pf, s, NP)
                # dV's wgmmas run while dSᵀ is computed
                dva = issue_pv(BF16, wgmma_fence_acc(dva), pf, gb + hb, PSTEPS, B_LBO)
                pacc = wgmma_wait_group_acc(1, pacc)  # dPᵀ (dV += Pᵀ dO may still run)
                acc_to_local(pacc, dp)
                grads_t(s, gc, dp, dl, NTILES, GRAD)
                pack_p(BF16, dsf, dp, NP)
                dka = issue_pv(BF16, wgmma_fence_acc(dka), dsf, qb + hb, PSTEPS, B_LBO)
                if DQ:  # (compile-time)
                    qa0, qa1 = step_dq(BF16, smem, el, at, DS_OFF, dp, kd, wg, warp, lane, g,
                                       tq, BM, BN, NTILES, HALVES, WGS, QN, 4 * WGS)
            else:  # (fewer registers held: the fp32 tiles die as they are packed)
                sacc = wgmma_wait_group_acc(0, sacc)  # Sᵀ and dPᵀ
                pacc = wgmma_wait_group_acc(0, pacc)
                acc_to_local(sacc, s)
                acc_to_local(pacc, dp)
                if mask:
                    probs_grads_t(BF16, s, dp, pf, dsf, ls, dl, mc, j0, causal_offset, sl2,
                                  True, CAUSAL, LEFT, RIGHT, NTILES, tq, mods, CAP, ALIBI,
                                  SMOD, MMOD, VS, KEEPS, user)
                else:
                    probs_grads_t(BF16, s, dp, pf, dsf, ls, dl, mc, j0, causal_offset, sl2,
                                  False, CAUSAL, LEFT, RIGHT, NTILES, tq, mods, CAP, ALIBI,
                                  SMOD, MMOD, VS, KEEPS, user)
                dva = issue_pv(BF16, wgmma_fence_acc(dva), pf, gb + hb, PSTEPS, B_LBO)
                dka = issue_pv(BF16, wgmma_fence_acc(dka), dsf, qb + hb, PSTEPS, B_LBO)
                if DQ:  # (compile-time)
                    qa0, qa1 = step_dq(BF16, smem, el, at, DS_OFF, dp, kd, wg, warp, lane, g,
                                       tq, BM, BN, NTILES, HALVES, WGS, QN, 4 * WGS)
            if not DEFER:  # (compile-time; DEFER: retired by the next step's first wait)
                dka = wgmma_wait_group_acc(0, dka)
                dva = wgmma_wait_group_acc(0, dva)
            if DQ:  # (compile-time) this step's dQ rows, staged, then bulk-added
                stage = el + (DQ_OFF + (2 * wg + (it & 1)) * STAGE) // 2
                qa0 = wgmma_wait_group_acc(0, qa0)
                acc_to_local(qa0, s)
                stage_dq(smem, stage, s, 0, D, warp, g, tq, QTILES, wg * QN)
                if HALVES == 2:
                    qa1 = wgmma_wait_group_acc(0, qa1)
                    acc_to_local(qa1, s)
                    stage_dq(smem, stage, s, 1, D, warp, g, tq, QTILES, wg * QN)
                fence_proxy_async()
                wg_sync(wg)
                if warp == 0 and lane == 0:
                    reduce_dq(smem, stage, slopes,
                              b * ssb + h * ssh + (q_row0 + mc + wg * QN) * D, D,
                              Nq - mc - wg * QN, QN)
        if DEFER:  # (compile-time) the last step's dV and dK
            dka = wgmma_wait_group_acc(0, dka)
            dva = wgmma_wait_group_acc(0, dva)
        cp_async_wait(0)
        if n_steps == 0:  # (uniform) the K, V copies of other warpgroups' threads land in
            cuda.syncthreads()  # this one's lines too: all landed before they take dK, dV
        if DQ and warp == 0 and lane == 0:  # (compile-time first) the reductions done
            bulk_wait(0)

        # (through this warpgroup's lines of the K and V tiles: hopper/epilogue.py)
        out = cuda.local.array(NO, float32)
        sc = float32(scale)
        one = float32(1.0)
        acc_to_local(dka, out)
        store_o(BF16, smem, el + K_OFF // 2, dk,
                b * dksb + hk * dksh + k_row0 * dksn + half * DP * dksd, k0 + 64 * wg, j0, Nk,
                dksn, dksd, out, sc, sc, DP, BM, wg, warp, g, tq, tid & 127)
        acc_to_local(dva, out)
        store_o(BF16, smem, el + V_OFF // 2, dv,
                b * dvsb + hk * dvsh + k_row0 * dvsn + half * DP * dvsd, k0 + 64 * wg, j0, Nk,
                dvsn, dvsd, out, one, one, DP, BM, wg, warp, g, tq, tid & 127)

    attn_backward_dkdv_wgmma.__qualname__ = var.tag
    return attn_backward_dkdv_wgmma


def make_attn_backward_dq_wgmma(var):
    """dQ of variant ``var`` (family "hopper", kernel "dq"): a query tile of
    ``64 * warpgroups`` rows per block, key steps of ``block_n``."""
    (D, BM, BN, NT, CH, KSTEPS, PSTEPS, NTILES, NP, CAUSAL, BF16, OVERLAP,
     PACKED, CAP, CAP_C, ALIBI) = _sizes(var, "dq")
    LEFT, RIGHT = var.bounds  # a sliding window (-1: an unbounded side)
    WINDOW = bool(var.window)
    SMOD, MMOD, VIEWS, _, VS, KEEPS = kernel_mods(var)  # the user's score_mod, mask_mod
    GRAD = CAP or SMOD  # (dS takes the scores' derivative)
    # K in STAGES buffers: 3, a step's dQ += dS K retires under the next step's copies and
    # score products (the wait that takes S of step it + 1 takes it), its K buffer
    # rewritten one step later (V, which only the step's dP reads, keeps two)
    STAGES = var.tiles.stages
    DEFER = STAGES == 3
    # shared memory, in bytes from the aligned start: Q, dO (resident), K[STAGES], V[2]
    TILE = BN * D * 2
    Q_OFF = 0
    DO_OFF = BM * D * 2
    K_OFF = 2 * BM * D * 2
    V_OFF = K_OFF + STAGES * TILE
    B_LBO = BN * LINE  # MN-major K: the next 64 columns (a block of BN lines)
    NS, NO = BN // 2, D // 2  # accumulators per thread: S (and dP), dQ

    def attn_backward_dq_wgmma(q, k, v, do, lse, delta, dq, Nq, Nk, Hq, group, causal_offset,
                               qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd, vsb, vsh, vsn, vsd,
                               gsb, gsh, gsn, gsd, dqsb, dqsh, dqsn, dqsd, lsb, lsh, lsn,
                               scale, slopes, ssb, ssh, m0, m1, m2, m3, e0, e1, e2, e3, e4,
                               e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15, cls, csb,
                               csh, csq, cu_q, cu_k, seqk, table, tsb, page, psp, TQ, chunk,
                               oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        wg = warp_uniform(tid >> 7)  # (uniform to ptxas: so are the descriptors from it)
        warp = (tid >> 5) & 3  # within the warpgroup
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        # (causal: heaviest first; the last query tile sees the most keys)
        qt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, True, HEAD_GROUP)
        b, h, hk = split_heads(bh, Hq, group)
        b, qt = packed_tile(b, qt, cu_q, nseq, BM, cuda.threadIdx.x & 31,
                            True, PACKED)
        q0 = qt * BM
        # this batch entry's rows (varlen: its sequence's)
        q_row0, k_row0, Nq, Nk, causal_offset, srow, _ = sequence_rows(
            b, h, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        sl2 = float32(scale * LOG2E)
        kbase = b * ksb + hk * ksh + k_row0 * ksn
        vbase = b * vsb + hk * vsh + k_row0 * vsn

        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad
        el = pad >> 1

        cbase = b * csb + h * csh  # (MMOD) this head's tile classes
        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        user = (b, h, Nq, Nk, margs)  # (SMOD, MMOD) what the user's mods take
        n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0

        load_tile(smem, el + Q_OFF // 2, q, b * qsb + h * qsh + q_row0 * qsn, q0, Nq, qsn, BM,
                  CH, tid, NT)
        load_tile(smem, el + DO_OFF // 2, do, b * gsb + h * gsh + q_row0 * gsn, q0, Nq, gsn,
                  BM, CH, tid, NT)
        if n_tiles > 0:
            load_tile(smem, el + K_OFF // 2, k, kbase, n_begin, Nk, ksn, BN, CH, tid, NT)
            load_tile(smem, el + V_OFF // 2, v, vbase, n_begin, Nk, vsn, BN, CH, tid, NT)
        cp_async_commit()

        qa = at + Q_OFF + 64 * wg * LINE  # this warpgroup's 64 rows of Q and of dO
        ga = at + DO_OFF + 64 * wg * LINE
        i0 = q0 + 64 * wg + 16 * warp + g  # this thread's rows: i0, i0 + 8
        i1 = i0 + 8
        lbase = b * lsb + h * lsh + q_row0 * lsn
        ls0, dl0 = query_stats(lse, delta, lbase + i0 * lsn, srow + i0, i0 < Nq)
        ls1, dl1 = query_stats(lse, delta, lbase + i1 * lsn, srow + i1, i1 < Nq)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        gc = cuda.local.array(NS, float32)  # (CAP, SMOD) the scores' derivative
        mods = cuda.local.array(5, float32)  # (CAP, ALIBI, SMOD) score_mods
        if CAP or ALIBI or SMOD:  # (compile-time)
            score_mods(mods, scale, slopes, b, h, ssb, ssh, CAP_C, ALIBI)
        dsf = cuda.local.array(NP, uint32)  # dS, packed: 4 per k-step of dQ += dS K
        dqa = zero_accumulators(D)

        for it in range(n_tiles):
            n0 = n_begin + it * BN
            buf = (it & 1) * TILE  # (V's buffer)
            kbuf = (it % STAGES) * TILE
            cp_async_wait(0)  # K, V of tile it (Q and dO with the first)
            publish()
            # Every thread has waited for tile it-1's products (DEFER: for tile it-2's dQ
            # product, retired when tile it-1 took its S): their buffers take tile it+1.
            if it + 1 < n_tiles:
                nb = (TILE - buf) // 2
                load_tile(smem, el + (K_OFF + ((it + 1) % STAGES) * TILE) // 2, k, kbase,
                          n0 + BN, Nk, ksn, BN, CH, tid, NT)
                load_tile(smem, el + V_OFF // 2 + nb, v, vbase, n0 + BN, Nk, vsn, BN, CH, tid,
                          NT)
            cp_async_commit()
            partial = False
            if MMOD:  # (compile-time) an empty tile is skipped, as a step in dK/dV
                cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                if cl == EMPTY:
                    continue
                partial = cl == PARTIAL
            kb = at + K_OFF + kbuf

            # (Q's and dO's descriptors made here, not hoisted out of the loop: opaque)
            sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(qa), kb,
                            KSTEPS, BM, BN)
            pacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), opaque(ga),
                            at + V_OFF + buf, KSTEPS, BM, BN)
            if OVERLAP:
                sacc = wgmma_wait_group_acc(1, sacc)  # S (dP may still run)
            else:
                sacc = wgmma_wait_group_acc(0, sacc)  # S and dP
            acc_to_local(sacc, s)
            # Zero K rows past the end give S = 0, whose P may overflow: mask them too.
            # (a diagonal, edge or tail tile, or one partial under the mask_mod)
            if partial or n0 + BN > n_full or (WINDOW and n0 < n_lo):
                probs_row(s, gc, 0, ls0, n0, i0, Nk, causal_offset, sl2, True, CAUSAL, LEFT,
                          RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
                probs_row(s, gc, 2, ls1, n0, i1, Nk, causal_offset, sl2, True, CAUSAL, LEFT,
                          RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
            else:
                probs_row(s, gc, 0, ls0, n0, i0, Nk, causal_offset, sl2, False, CAUSAL, LEFT,
                          RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
                probs_row(s, gc, 2, ls1, n0, i1, Nk, causal_offset, sl2, False, CAUSAL, LEFT,
                          RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user)
            pacc = wgmma_wait_group_acc(0, pacc)
            acc_to_local(pacc, dp)
            grads_row(s, gc, dp, 0, dl0, NTILES, GRAD)
            grads_row(s, gc, dp, 2, dl1, NTILES, GRAD)
            pack_p(BF16, dsf, dp, NP)
            dqa = issue_pv(BF16, wgmma_fence_acc(dqa), dsf, kb, PSTEPS, B_LBO)
            if not DEFER:  # (compile-time; DEFER: retired by the next tile's first wait)
                dqa = wgmma_wait_group_acc(0, dqa)
        if DEFER:  # (compile-time) the last tile's dQ product
            dqa = wgmma_wait_group_acc(0, dqa)
        cp_async_wait(0)
        if n_tiles == 0:  # (uniform) other warpgroups' threads copied some of this one's Q
            cuda.syncthreads()  # lines: all landed before they take dQ (hopper/epilogue.py)

        out = cuda.local.array(NO, float32)
        acc_to_local(dqa, out)
        sc = float32(scale)
        store_o(BF16, smem, el + Q_OFF // 2, dq, b * dqsb + h * dqsh + q_row0 * dqsn,
                q0 + 64 * wg, i0, Nq, dqsn, dqsd, out, sc, sc, D, BM, wg, warp, g, tq,
                tid & 127)

    attn_backward_dq_wgmma.__qualname__ = var.tag
    return attn_backward_dq_wgmma
