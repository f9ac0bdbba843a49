"""The wgmma forward's ping-pong schedule (``HopperTiles.pingpong``): FlashAttention 3's two
consumer warpgroups taking turns on the tensor cores, on top of the overlapped schedule of
``forward.py`` (whose steps it calls: ``issue_qk``, ``issue_pv``, ``softmax_tile``,
``pack_p``, ``rescale``).

Turns. Each warpgroup issues the wgmmas of a step (``S_j = Q K_jᵀ`` and ``O += P_{j-1}
V_{j-1}``) only in its turn: it waits on its named barrier (``bar.sync 1 + wg, 256``) and,
once they are issued, hands the turn over (``bar.arrive`` on the other's). The tensor cores
run each warpgroup's products in turn, so one's softmax runs under the other's products
instead of both softmaxes leaving the tensor cores idle together. The second warpgroup
arrives once before its first step (the first goes first) and not after its last (every
arrival is matched by a wait).

Rings. A block-wide barrier per key tile would undo the turns (the warpgroup ahead would
wait for the other's softmax), so K and V stream through rings of ``STAGES`` shared-memory
stages guarded by mbarriers (``device/pipeline.py``): the first warpgroup copies every K
tile, the second every V tile (128 threads a tile, ``cp.async`` into the swizzled layout as
``forward.load_tile``), each thread then arrives on the stage's "full" barrier through
``cp.async.mbarrier.arrive.noinc`` (count 128: it completes when every copy has landed).
Consumers wait on "full" (then ``fence.proxy.async``: the copies are generic-proxy writes,
the wgmmas read through the async proxy) and release a stage on its "empty" barrier (lane 0
of each warp after the wgmma wait that read it: count 8) when the tile's products are done.
At the end of its step ``j`` a warpgroup copies tile ``j + STAGES - 1`` into the stage of
tile ``j - 1``: for K, freed by both warpgroups' step ``j - 1`` (the second warpgroup is
half a step behind the first); for V, by their step ``j`` (the copier of V is the one
behind). A copier waits on "empty" only for what the other has not released yet.

With ``tma`` (``HopperTiles.tma``) one thread of the copying warpgroup moves each K or V
tile instead: it waits for the stage, announces the tile's bytes on its "full" barrier
(``mbarrier.arrive.expect_tx``: count 1) and issues one bulk tensor copy per 64 columns
(tensor maps 1 and 2 of the launch's ``maps``: K and V as (D, N, H, B), varlen rows as
(D, total, H, 1) read from a sequence's offset, with 128-byte swizzled boxes of 64 columns
and ``block_n`` rows, rows past the end zero); the copies land
through the async proxy and complete the phase. With a producer warpgroup too, its first
thread moves every K and V tile, each as soon as its stage is free (FlashAttention 3's
producer).

Q is copied by every thread and published by the one block-wide barrier of the prologue.
"""
from __future__ import annotations

from numba import cuda, float32, int64, uint16, uint32

from ..device.constants import DENSE, HEAD_GROUP, NEG_INF, PACKING, SMEM_ALIGN, VARLEN
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import cp_async16, cp_async_commit, cp_async_wait, warp_uniform
from ..device.pipeline import (
    cp_async_arrive,
    empty_parity,
    fence_tensormap,
    full_parity,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_arrive,
    named_sync,
    setmaxnreg_dec,
    setmaxnreg_inc,
    st_shared_u32,
    stage_of,
    tma_load_4d,
)
from ..device.prologue import block_tile, split_heads
from ..device.seams import packed_tile, stat_rows, visited_keys
from ..device.user_mods import kernel_mods
from ..device.wgmma import (
    acc_from_local,
    acc_to_local,
    fence_proxy_async,
    smem_address,
    wgmma_fence_acc,
    wgmma_wait_group_acc,
    zero_accumulators,
)
from ..tensor_core.forward import finish_row
from ..tilings import HOPPER_ALIGN, HOPPER_ROWS
from .epilogue import store_o
from .forward import (
    LINE,
    issue_pv,
    issue_qk,
    load_tile,
    mask_flags,
    pack_p,
    rescale,
    score_constants,
    sequence_bases,
    softmax_tile,
    softmax_tile_mods,
)

#: Elements (16-bit) of one mbarrier in the shared array.
BAR = 4
#: Threads of one warpgroup; arrivals on a "full" barrier (every copier) and on an "empty"
#: one (lane 0 of every warp of both warpgroups).
WG_THREADS = 128
FULL_COUNT, EMPTY_COUNT = WG_THREADS, 8


@device_function
def take_turn(wg):
    """Wait for this warpgroup's turn to issue wgmmas (its named barrier: 1 or 2)."""
    if wg == 0:
        named_sync(1, 256)
    else:
        named_sync(2, 256)


@device_function
def pass_turn(wg):
    """Hand the turn to the other warpgroup (an arrival on its named barrier)."""
    if wg == 0:
        named_arrive(2, 256)
    else:
        named_arrive(1, 256)


@device_function
def wait_full(smem, full, t, STAGES):
    """Wait until tile ``t`` of the ring whose "full" barriers start at element ``full``
    has landed."""
    mbarrier_wait(smem, full + BAR * stage_of(t, STAGES), full_parity(t, STAGES))


@device_function
def release(smem, empty, t, STAGES, lane):
    """This warp is done with tile ``t``'s stage (after the wgmma wait that read it)."""
    if lane == 0:
        mbarrier_arrive(smem, empty + BAR * stage_of(t, STAGES))


@device_function
def produce(smem, el, off, src, base, t, n_tiles, n_begin, nvalid, sn, full, empty, STAGES,
            STAGE, BN, CH, wtid):
    """Copy tile ``t`` (rows ``n_begin + t BN ..``) of ``src`` into its stage of the ring at
    byte ``off`` (stages ``STAGE`` bytes apart) by this warpgroup's 128 threads, once the
    stage is free, and arrive on its "full" barrier when the copies land (nothing past the
    last tile)."""
    if t < n_tiles:
        produce_at(smem, el, off, src, base, t, t, n_begin, nvalid, sn, full, empty, STAGES,
                   STAGE, BN, CH, wtid)


@device_function
def produce_at(smem, el, off, src, base, t, r, n_begin, nvalid, sn, full, empty, STAGES,
               STAGE, BN, CH, wtid):
    """:func:`produce`'s copy of tile ``t`` into the ring's ``r``-th tile (its stage and
    phases: ``r`` counts on across a persistent block's query tiles)."""
    s = stage_of(r, STAGES)
    if r >= STAGES:
        mbarrier_wait(smem, empty + BAR * s, empty_parity(r, STAGES))
    load_tile(smem, el + (off + s * STAGE) // 2, src, base, n_begin + t * BN, nvalid, sn,
              BN, CH, wtid, WG_THREADS)
    cp_async_arrive(smem, full + BAR * s)


@device_function
def produce_tma(smem, el, off, maps, which, src, c2, c3, t, n_tiles, n_begin, full, empty,
                STAGES, STAGE, BN, PANELS, wtid):
    """:func:`produce` by the Tensor Memory Accelerator: thread 0 of the warpgroup waits
    for the stage, expects its ``STAGE`` bytes on the "full" barrier and issues one bulk
    tensor copy of map ``which`` per 64 columns (at head ``c2`` of batch ``c3``; ``n_begin``
    is the first key's row in the map: a varlen sequence's rows start at its offset)."""
    if t < n_tiles and wtid == 0:
        produce_tma_at(smem, el, off, maps, which, src, c2, c3, t, t, n_begin, full, empty,
                       STAGES, STAGE, BN, PANELS)


@device_function
def produce_tma_at(smem, el, off, maps, which, src, c2, c3, t, r, n_begin, full, empty,
                   STAGES, STAGE, BN, PANELS):
    """:func:`produce_tma`'s copy of tile ``t`` into the ring's ``r``-th tile (its stage
    and phases: ``r`` counts on across a persistent block's query tiles), by the calling
    thread."""
    s = stage_of(r, STAGES)
    if r >= STAGES:
        mbarrier_wait(smem, empty + BAR * s, empty_parity(r, STAGES))
    e = el + (off + s * STAGE) // 2
    mbarrier_expect_tx(smem, full + BAR * s, STAGE)
    for p in range(PANELS):
        tma_load_4d(smem, e + p * (BN * 64), maps, which, src, 64 * p, n_begin + t * BN,
                    c2, c3, full + BAR * s)


@device_function
def produce_next(smem, el, off, src, base, t, n_tiles, n_begin, nvalid, sn, full, empty,
                 STAGES, STAGE, BN, CH, wtid, TMA, maps, which, c2, c3, trow):
    """Tile ``t`` of this warpgroup's ring: :func:`produce_tma` where ``TMA`` (compile-time;
    the sequence's keys from row ``trow`` of the maps: :func:`map_origin`), else
    :func:`produce`."""
    if TMA:
        produce_tma(smem, el, off, maps, which, src, c2, c3, t, n_tiles, trow + n_begin, full,
                    empty, STAGES, STAGE, BN, CH // 8, wtid)
    else:
        produce(smem, el, off, src, base, t, n_tiles, n_begin, nvalid, sn, full, empty,
                STAGES, STAGE, BN, CH, wtid)


@device_function
def map_origin(b, cu_k, PACKED):
    """``(row, batch)`` of a sequence's first key in the tensor maps (``PACKED``
    compile-time): row 0 of batch ``b`` for a dense batch; for varlen rows, whose maps
    describe every packed row as one batch entry, the sequence's offset."""
    if PACKED == VARLEN:
        return int64(cu_k[b]), int64(0)
    return int64(0), int64(b)


@device_function
def clear_rows(smem, e, r0, BN, PANELS, wtid):
    """Zero rows ``r0 ..`` of the ``BN``-row tile at shared element ``e`` in each of its
    ``PANELS`` 64-column panels (the 128-byte swizzle keeps a row's 128 bytes on its own
    line), 32 bits per thread of a warpgroup and pass. The bulk copy of a varlen
    sequence's last tile brings the next sequence's first rows: their keys' scores are
    masked, but a value row holding inf or NaN would still reach the output through
    ``0 x inf``."""
    n = (BN - r0) * 32
    for p in range(PANELS):
        base = e + p * (BN * 64) + r0 * 64
        for w in range(wtid, n, WG_THREADS):
            st_shared_u32(smem, base + 2 * w, uint32(0))


@device_function
def copy_rows(smem, so, src, g0, row0, r, nvalid, sn, passes, RS):
    """One thread's share of a tile copy in the producer (``forward.load_tile``'s copies,
    in few registers): ``passes`` 16-byte copies of rows ``row0 + p RS`` to shared element
    ``so + 64 p RS`` (``RS`` a multiple of 8: the swizzle of a thread's chunk is the same
    in every pass); ``g0`` is the source element of the thread's chunk in row ``r`` (tile
    0). Rows at or past ``nvalid`` are zero-filled (source size 0: nothing is read, as
    CUTLASS's zero-fill copies; any other address costs registers, and at the producer's
    24 ptxas spills). ``passes`` is a
    run-time value, so that the loop stays rolled (unrolled, ptxas computes every pass's
    addresses ahead and spills at the producer's 24 registers)."""
    for p in range(passes):
        row = row0 + p * RS
        if row < nvalid:
            cp_async16(smem, so + 64 * p * RS, src, g0 + (row - r) * sn, 16)
        else:
            cp_async16(smem, so + 64 * p * RS, src, g0, 0)


@device_function
def produce_all(smem, el, q, qbase, q0, Nq, qsn, k, kbase, ksn, v, vbase, vsn, Nk, n_tiles,
                full_k, full_v, empty_k, empty_v, q_full, STAGES, STAGE, K_OFF, V_OFF, BM,
                BN, CH, wtid):
    """The producer warpgroup's whole job: Q (arriving on ``q_full``), then K and V tile by
    tile, each into its stage once the stage is free, arriving on its "full" barrier when
    the copies land. Thread ``wtid`` copies chunk ``c`` of rows ``r + p RS`` as
    ``forward.load_tile``, its shared offset in a tile computed once."""
    load_tile(smem, el, q, qbase, q0, Nq, qsn, BM, CH, wtid, WG_THREADS)
    cp_async_arrive(smem, q_full)
    RS = WG_THREADS // CH
    c = wtid % CH
    r = wtid // CH
    so = el + (c >> 3) * (BN * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3)
    kg = kbase + r * ksn + 8 * c
    vg = vbase + r * vsn + 8 * c
    passes = BN // RS + (n_tiles >> 30)  # (BN // RS, unknown to the compiler)
    for t in range(n_tiles):
        st = stage_of(t, STAGES)
        n0 = t * BN
        if t >= STAGES:
            mbarrier_wait(smem, empty_k + BAR * st, empty_parity(t, STAGES))
        copy_rows(smem, so + (K_OFF + st * STAGE) // 2, k, kg, n0 + r, r, Nk, ksn, passes,
                  RS)
        cp_async_arrive(smem, full_k + BAR * st)
        if t >= STAGES:
            mbarrier_wait(smem, empty_v + BAR * st, empty_parity(t, STAGES))
        copy_rows(smem, so + (V_OFF + st * STAGE) // 2, v, vg, n0 + r, r, Nk, vsn, passes,
                  RS)
        cp_async_arrive(smem, full_v + BAR * st)


@device_function
def produce_all_tma(smem, el, q, qbase, q0, Nq, qsn, maps, k, v, c2, c3, n_tiles, n_begin,
                    full_k, full_v, empty_k, empty_v, q_full, STAGES, STAGE, K_OFF, V_OFF, BM,
                    BN, CH, wtid):
    """:func:`produce_all` by bulk tensor copies: the producer warpgroup's threads copy Q
    (``cp.async``, arriving on ``q_full``), then its first thread alone moves K and V tile
    by tile (:func:`produce_tma`, maps 1 and 2), each as soon as its stage is free."""
    load_tile(smem, el, q, qbase, q0, Nq, qsn, BM, CH, wtid, WG_THREADS)
    cp_async_arrive(smem, q_full)
    if wtid == 0:
        fence_tensormap(maps, 1)
        fence_tensormap(maps, 2)
        for t in range(n_tiles):
            produce_tma(smem, el, K_OFF, maps, 1, k, c2, c3, t, n_tiles, n_begin, full_k,
                        empty_k, STAGES, STAGE, BN, CH // 8, 0)
            produce_tma(smem, el, V_OFF, maps, 2, v, c2, c3, t, n_tiles, n_begin, full_v,
                        empty_v, STAGES, STAGE, BN, CH // 8, 0)


def make_attn_forward_wgmma_pingpong(var):
    """The forward kernel of variant ``var`` (family "hopper", ``var.tiles.pingpong``):
    head dim 64 or 128, causal or not, fp16 or bf16; the same launch arguments and results
    as ``forward.make_attn_forward_wgmma``, with the masks and score modifiers but a
    mask_mod (the window's range and edge tiles, the softcap, ALiBi, a score_mod:
    ``forward.softmax_tile_mods``). With ``var.tiles.producer`` the block's first warpgroup
    copies everything (:func:`produce_all`, no masks there; or :func:`produce_all_tma`,
    masks too) and the consumers none."""
    D, t = var.head_dim, var.tiles
    if D % 64:
        raise ValueError(f"head_dim={D} must be a multiple of 64 for the wgmma forward")
    if var.packed not in HOPPER_ROWS or var.split:
        raise ValueError(f"the wgmma forward takes dense or varlen rows, no KV cache and no "
                         f"split-KV: {var.tag}")
    if not t.pingpong or t.warpgroups != 2:
        raise ValueError(f"not a ping-pong tiling: {t}")
    SMOD, MMOD, VIEWS, VALUE, _, KEEPS = kernel_mods(var)  # the user's score_mod, mask_mod
    LEFT, RIGHT, WINDOW, CAP, CAP_C, ALIBI, LINEAR, FOLD = mask_flags(var, SMOD)
    MODS = WINDOW or CAP or ALIBI or SMOD  # (else: forward.softmax_tile, the plain steps)
    if MMOD or (MODS and t.producer and not t.tma):
        raise ValueError(f"the ping-pong schedule takes no mask_mod (its empty tiles are "
                         f"skipped in the schedule without the overlap), and with a "
                         f"producer warpgroup of cp.async copies (whose tiles start at "
                         f"key 0) no masks: {var.tag}")
    BN, BM, NT, STAGES = t.block_n, t.block_m, t.threads, t.stages
    PRODUCER = t.producer  # (compile-time: a producer warpgroup, 0, before the consumers)
    POLY = t.poly  # every POLY-th n-tile's exp2 on the FMA pipe (0: none)
    PACKED = PACKING[var.packed]  # dense or varlen rows (device/seams.sequence)
    CH = D // 8
    KSTEPS, PSTEPS = D // 16, BN // 16
    NTILES, DTILES = BN // 8, D // 8
    NS, NO, NP = BN // 2, D // 2, BN // 4
    # shared memory, in bytes from the aligned start: Q, K[STAGES], V[STAGES], then the
    # mbarriers: full K, full V, empty K, empty V (STAGES each), Q's (producer only)
    STAGE = BN * D * 2
    Q_OFF = 0
    K_OFF = BM * D * 2
    V_OFF = K_OFF + STAGES * STAGE
    BAR_OFF = V_OFF + STAGES * STAGE
    V_LBO = BN * LINE
    CAUSAL = bool(var.causal)
    BF16 = var.dtype == "bfloat16"
    AHEAD = STAGES - 1  # tiles each ring runs ahead of the step that copies (no producer)
    PRODUCER_REGS, CONSUMER_REGS = 24, 240
    TMA = t.tma  # (compile-time) K and V by bulk tensor copies, one thread each
    if TMA and PACKED not in (DENSE, VARLEN):
        raise ValueError(f"bulk tensor copies take dense or varlen rows: {var.tag}")
    FULL = 1 if TMA else FULL_COUNT

    def attn_forward_wgmma(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                           qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                           vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale, slopes, ssb, ssh,
                           m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                           e12, e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table,
                           tsb, page, psp, TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        wtid = tid & 127
        # consumer warpgroup (-1: producer), uniform to ptxas (its Q descriptors then are)
        wg = warp_uniform((tid >> 7) - 1 if PRODUCER else tid >> 7)
        warp = (tid >> 5) & 3
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        qt, bh = block_tile(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x, cuda.gridDim.y,
                            CAUSAL, True, HEAD_GROUP)
        b, h, hk = split_heads(bh, Hq, group)
        b, qt = packed_tile(b, qt, cu_q, nseq, BM, cuda.threadIdx.x & 31,
                            True, PACKED)
        q0 = qt * BM
        q_row0, Nq, Nk, causal_offset, qbase, kbase, vbase = sequence_bases(
            b, h, hk, Nq, Nk, causal_offset, cu_q, cu_k, seqk, qsb, qsh, qsn, ksb, ksh, ksn,
            vsb, vsh, vsn, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        trow, tb = map_origin(b, cu_k, PACKED)  # (the sequence's keys in the tensor maps)

        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad
        el = pad >> 1
        full_k = el + BAR_OFF // 2
        full_v = full_k + BAR * STAGES
        empty_k = full_v + BAR * STAGES
        empty_v = empty_k + BAR * STAGES
        q_full = empty_v + BAR * STAGES

        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, False, cls, 0, csq)
        n_tiles = (n_end + BN - 1) // BN  # (n_begin is 0 here: plain variants keep this)
        if WINDOW:  # (compile-time)
            n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0

        if tid == 0:
            for st in range(STAGES):
                mbarrier_init(smem, full_k + BAR * st, FULL)
                mbarrier_init(smem, full_v + BAR * st, FULL)
                mbarrier_init(smem, empty_k + BAR * st, EMPTY_COUNT)
                mbarrier_init(smem, empty_v + BAR * st, EMPTY_COUNT)
            if PRODUCER:
                mbarrier_init(smem, q_full, FULL_COUNT)
        if PRODUCER:
            cuda.syncthreads()  # the barriers initialized before any arrival
        else:
            # this warpgroup's ring: the first copies K, the second V
            if wg == 0:
                src, base, sn, off, full, empty = k, kbase, ksn, K_OFF, full_k, empty_k
            else:
                src, base, sn, off, full, empty = v, vbase, vsn, V_OFF, full_v, empty_v
            which = 1 + wg  # (the tensor maps of K and V)
            load_tile(smem, el + Q_OFF // 2, q, qbase, q0, Nq, qsn, BM, CH, tid, NT)
            cp_async_commit()
            cuda.syncthreads()  # the barriers initialized before any arrival
            if TMA and wtid == 0:
                fence_tensormap(table, which)
            for tt in range(AHEAD):
                produce_next(smem, el, off, src, base, tt, n_tiles, n_begin, Nk, sn, full,
                             empty, STAGES, STAGE, BN, CH, wtid, TMA, table, which, hk, tb, trow)
            cp_async_commit()
            cp_async_wait(1)  # Q (the rings' copies may still be in flight)
            fence_proxy_async()
            cuda.syncthreads()

        if PRODUCER and wg < 0:
            setmaxnreg_dec(PRODUCER_REGS)
            if TMA:
                produce_all_tma(smem, el, q, qbase, q0, Nq, qsn, table, k, v, hk, tb, n_tiles,
                                trow + n_begin, full_k, full_v, empty_k, empty_v, q_full, STAGES,
                                STAGE, K_OFF, V_OFF, BM, BN, CH, wtid)
            else:
                produce_all(smem, el, q, qbase, q0, Nq, qsn, k, kbase, ksn, v, vbase, vsn,
                            Nk, n_tiles, full_k, full_v, empty_k, empty_v, q_full, STAGES,
                            STAGE, K_OFF, V_OFF, BM, BN, CH, wtid)
            cp_async_commit()
            cp_async_wait(0)
        else:
            if PRODUCER:
                setmaxnreg_inc(CONSUMER_REGS)
                mbarrier_wait(smem, q_full, 0)
            sl2, capr, rcapr, slope, unit, sc = score_constants(scale, slopes, b, h, ssb,
                                                                ssh, CAP_C, ALIBI, FOLD)
            margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                           e12, e13, e14, e15))
            qa = at + Q_OFF + 64 * wg * LINE
            s = cuda.local.array(NS, float32)
            oa = cuda.local.array(NO, float32)
            pf = cuda.local.array(NP, uint32)
            acc = zero_accumulators(D)
            ma = mb = NEG_INF
            la = lb = float32(0.0)
            w0 = q0 + 64 * wg + 16 * warp  # this warp's 16 rows
            i = w0 + g

            if n_tiles > 0:
                if wg == 1:
                    named_arrive(1, 256)  # the first warpgroup takes the first turn
                wait_full(smem, full_k, 0, STAGES)
                fence_proxy_async()
                take_turn(wg)
                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                at + K_OFF, KSTEPS, BM, BN)
                pass_turn(wg)
                sacc = wgmma_wait_group_acc(0, sacc)
                release(smem, empty_k, 0, STAGES, lane)
                acc_to_local(sacc, s)
                if MODS:  # (compile-time)
                    ma, mb, la, lb, al0, al1 = softmax_tile_mods(
                        s, n_begin, BN, n_full, n_lo, False, i, w0, Nq, Nk, causal_offset, b,
                        h, tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc, margs,
                        CAUSAL, LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE,
                        NTILES, POLY)
                else:
                    ma, mb, la, lb, al0, al1 = softmax_tile(s, 0, BN, n_full, i, Nk,
                                                            causal_offset, CAUSAL, NTILES, tq,
                                                            ma, mb, la, lb, sl2)
                pack_p(BF16, pf, s, NP)
                if not PRODUCER:
                    produce_next(smem, el, off, src, base, AHEAD, n_tiles, n_begin, Nk, sn,
                                 full, empty, STAGES, STAGE, BN, CH, wtid, TMA, table, which,
                                 hk, tb, trow)
            for it in range(1, n_tiles):
                n0 = n_begin + it * BN
                wait_full(smem, full_k, it, STAGES)
                wait_full(smem, full_v, it - 1, STAGES)
                fence_proxy_async()
                take_turn(wg)
                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                at + K_OFF + stage_of(it, STAGES) * STAGE, KSTEPS, BM, BN)
                acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                               at + V_OFF + stage_of(it - 1, STAGES) * STAGE, PSTEPS, V_LBO)
                pass_turn(wg)
                sacc = wgmma_wait_group_acc(1, sacc)  # S_it (P V may still run)
                release(smem, empty_k, it, STAGES, lane)
                acc_to_local(sacc, s)
                if MODS:  # (compile-time)
                    ma, mb, la, lb, al0, al1 = softmax_tile_mods(
                        s, n0, BN, n_full, n_lo, False, i, w0, Nq, Nk, causal_offset, b, h,
                        tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc, margs, CAUSAL,
                        LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE, NTILES,
                        POLY)
                else:
                    ma, mb, la, lb, al0, al1 = softmax_tile(s, n0, BN, n_full, i, Nk,
                                                            causal_offset, CAUSAL, NTILES, tq,
                                                            ma, mb, la, lb, sl2)
                acc = wgmma_wait_group_acc(0, acc)
                release(smem, empty_v, it - 1, STAGES, lane)
                acc_to_local(acc, oa)
                rescale(oa, al0, al1, DTILES)
                acc = acc_from_local(oa, D)
                pack_p(BF16, pf, s, NP)
                if not PRODUCER:
                    produce_next(smem, el, off, src, base, it + AHEAD, n_tiles, n_begin, Nk,
                                 sn, full, empty, STAGES, STAGE, BN, CH, wtid, TMA, table,
                                 which, hk, tb, trow)
            if n_tiles > 0:
                last = n_tiles - 1
                wait_full(smem, full_v, last, STAGES)
                if TMA and PACKED == VARLEN:  # (compile-time) the rows past the sequence
                    # (the next one's, by the bulk copy) zeroed by the first warpgroup,
                    # before its fence and its turn; the second's last turn is released by
                    # the first's pass_turn, after them (no store under the other's reads)
                    nl = n_begin + last * BN
                    if wg == 0 and nl + BN > Nk:
                        clear_rows(smem, el + (V_OFF + stage_of(last, STAGES) * STAGE) // 2,
                                   Nk - nl, BN, CH // 8, wtid)
                fence_proxy_async()
                take_turn(wg)
                acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                               at + V_OFF + stage_of(last, STAGES) * STAGE, PSTEPS, V_LBO)
                if wg == 0:
                    pass_turn(wg)  # (the second's last pass would have no wait to match)
                acc = wgmma_wait_group_acc(0, acc)
            if not PRODUCER:
                cp_async_commit()
                cp_async_wait(0)

            acc_to_local(acc, oa)
            obase = b * osb + h * osh + q_row0 * osn
            lrow, _ = stat_rows(b, h, Hq, Nq, q_row0, TQ, PACKED)
            inv0 = finish_row(lse, lrow, i, Nq, ma, sl2, la, tq)
            inv1 = finish_row(lse, lrow, i + 8, Nq, mb, sl2, lb, tq)
            store_o(BF16, smem, el + Q_OFF // 2, o, obase, q0 + 64 * wg, i, Nq, osn, osd,
                    oa, inv0, inv1, D, BM, wg, warp, g, tq, wtid)

    attn_forward_wgmma.__qualname__ = var.tag
    return attn_forward_wgmma
