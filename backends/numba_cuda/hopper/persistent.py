"""The persistent ping-pong forward (``HopperTiles.persistent``; ``tilings.PERSISTENT``'s
at D=128): one block per multiprocessor walks the query tiles of a dense call (or one with
a sliding window) in the grid's order (``device/prologue.block_tile``: heaviest first
where causal). Statically, block ``c`` takes tiles ``c``, then one per pass over the
blocks, each pass in the other direction (:func:`walk`). With ``HopperTiles.dynamic``
each block takes, after its first, the next tile not yet taken from a counter the blocks
share: a block that finishes early takes more, as the hardware's block scheduler would
deal them (what balances heaviest-first causal tiles). The counters are 32-bit words
after the launch's tensor maps (``tensor_maps``' slots, zero when copied); the last block
to run out sets them to zero again, so that the next launch reading the slot (ordered
after this one on its stream) starts from zero. Either way the producer publishes each
tile to the consumers with its Q (words per Q buffer, written before the arrival on "q
full": a dense tile's index, an index past the last telling them to stop; a varlen
tile's sequence, head and first row, the sequence word ``STOP`` telling them to stop).

A block per query tile pays its start and end with nothing under them (one block per
multiprocessor: 224 KiB of shared memory at D=128): Q and the first K and V tiles loaded
before the first product, the warpgroups' first turns, and at its end the last P V, the
normalization and the stores; about 3 µs a block on an H200, a fifth of a block's time at
N=1024 (notes/persistent_2026-11-27.md). Here a producer warpgroup's first thread moves
every Q, K and V tile by bulk tensor copies, the rings' index counting on from one query
tile to the next (stages and phases follow from it), Q in two buffers handed over by
mbarriers ("q full", "q empty"), so the next tile's Q and first K and V tiles land during
the current one; the turns (named barriers 1 and 2) carry on across tiles, so the first
warpgroup starts the next tile while the second normalizes and stores; O's rows go through
a tile of their own to 16-byte stores.

Dense rows, or varlen rows (:func:`packed_item`: the items number every sequence's tiles
in turn, heads innermost, causal from each sequence's last tile; with the counter or the
static walk; the producer's thread finds a tile's sequence by scanning from its last one,
and the first warpgroup zeroes the value rows past the sequence that a last tile's bulk
copy brings); a sliding window and a mask_mod (the producer cuts each query tile's keys
to the span its classes leave, :func:`class_keys`, and hands it to the consumers with the
tile's words; the consumers load each key tile's class before waiting for its product),
no score modifier: ``launch.hopper_variant`` takes the table's tiling for the others. The
launch passes the batch as ``nseq``.
"""
from __future__ import annotations

from numba import cuda, float32, int32, int64, uint16, uint32

from ..device.constants import (
    CLASS_BLOCK,
    DENSE,
    EMPTY,
    HEAD_GROUP,
    NEG_INF,
    PACKING,
    PARTIAL,
    SMEM_ALIGN,
    VARLEN,
)
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import warp_uniform
from ..device.pipeline import (
    counter_add,
    counter_add_acq_rel,
    counter_store,
    fence_tensormap,
    ld_shared_u32,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_arrive,
    setmaxnreg_dec,
    setmaxnreg_inc,
    st_shared_u32,
    stage_of,
    tma_load_4d,
)
from ..device.prologue import block_tile, split_heads
from ..device.seams import sequence, sequence_tiles, stat_rows, tile_class, visited_keys
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
from ..tensor_core.fragments import store_frags
from ..tilings import HOPPER_ALIGN
from .epilogue import store_o, wg_barrier
from .forward import (
    LINE,
    issue_pv,
    issue_qk,
    mask_flags,
    pack_p,
    rescale,
    score_constants,
    softmax_tile,
    softmax_tile_mods,
)
from .pingpong import (
    BAR,
    EMPTY_COUNT,
    clear_rows,
    pass_turn,
    produce_tma_at,
    release,
    take_turn,
    wait_full,
)


@device_function
def query_tile(item, GX, GY, Hq, group, BM, CAUSAL):
    """``(b, h, hk, q0)`` of the block's ``item``-th tile of the launch's grid of ``(GX, GY)``
    tiles (its linear index as a block's would be)."""
    qt, bh = block_tile(item % GX, item // GX, GX, GY, CAUSAL, True, HEAD_GROUP)
    b, h, hk = split_heads(bh, Hq, group)
    return b, h, hk, qt * BM


@device_function
def tile_rows(item, GX, GY, Hq, group, BM, Nq, Nk, causal_offset, cu_q, cu_k, seqk, CAUSAL,
              PACKED):
    """``(b, h, hk, q0, q_row0, k_row0, nq, nk, causal_offset)`` of the launch's ``item``-th
    query tile (:func:`query_tile`) and of its sequence (``seams.sequence``, ``PACKED``
    compile-time: the launch's sizes for a dense batch)."""
    b, h, hk, q0 = query_tile(item, GX, GY, Hq, group, BM, CAUSAL)
    q_row0, k_row0, nq, nk, co = sequence(b, Nq, Nk, causal_offset, cu_q, cu_k, seqk, PACKED)
    return b, h, hk, q0, q_row0, k_row0, nq, nk, co


@device_function
def packed_item(item, n_tiles, Hq, CAUSAL, sc, bc, cu_q, BM):
    """``(sc, h, qt, bc)`` of varlen ``item``: tile ``x = item // Hq`` of the packed tile
    axis (every sequence's ``BM``-row tiles in turn; ``CAUSAL``: from the last, so that each
    sequence's heaviest tiles come first), head ``item % Hq`` (heads innermost: a block's
    next item is about ``G / Hq`` tiles on, so the scan moves by a few sequences at most
    and never starts over), the tile's sequence found from the scan's last position
    (sequence ``sc``, whose first tile is ``bc``): the tile's sequence and its first tile,
    the scan's position for the next item."""
    x = item // Hq
    h = item - x * Hq
    if CAUSAL:
        x = n_tiles - 1 - x
    while x < bc:
        sc -= 1
        bc -= int32(sequence_tiles(cu_q, sc, BM))
    n = int32(sequence_tiles(cu_q, sc, BM))
    while x >= bc + n:
        bc += n
        sc += 1
        n = int32(sequence_tiles(cu_q, sc, BM))
    return sc, h, x - bc, bc


@device_function
def walk(p, c, G):
    """The tile block ``c`` of ``G`` takes on its pass ``p`` of a static walk: ``c`` on even
    passes, ``G - 1 - c`` on odd ones (a snake), so that where tiles come heaviest first
    (causal) no block takes the heaviest of every pass."""
    return int32(p * G + (c if p % 2 == 0 else G - 1 - c))


@device_function
def class_keys(cls, row, n_begin, n_end):
    """``[n_begin, n_end)`` (multiples of CLASS_BLOCK but ``n_end``) cut to the key blocks a
    mask_mod's classes leave in class row ``row`` (one query block: a persistent tile is
    one block tall), scanned from each end to the first block that is not EMPTY, one byte
    a step: the producer's single thread finds a document's span in tens of steps (a scan
    of every block took longer than the tile's products; ``seams.class_span``'s general
    scan from each end, heads and a block range a column, made 8 equal documents' forward
    0.785 against 0.666 ms here, notes/cpu_softcap_2026-11-28.md)."""
    a = n_begin // CLASS_BLOCK
    z = (n_end + CLASS_BLOCK - 1) // CLASS_BLOCK
    while a < z and int32(cls[row + a]) == EMPTY:
        a += 1
    while z > a and int32(cls[row + z - 1]) == EMPTY:
        z -= 1
    return a * CLASS_BLOCK, min(n_end, z * CLASS_BLOCK)


@device_function
def key_tiles(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL, LEFT, RIGHT, WINDOW, MMOD, cls,
              cbase, csq):
    """``(n_begin, n_tiles, n_lo, n_full)``: the key tiles query rows ``q0 ..`` visit (from
    key ``n_begin``: 0 without a ``WINDOW`` or ``MMOD``, compile-time; with ``MMOD`` cut to
    the span the mask_mod's classes at ``cbase`` leave, :func:`class_keys`; ``BM`` = ``BN``
    = CLASS_BLOCK) and the keys ``[n_lo, n_full)`` where every row sees whole tiles
    (``seams.visited_keys``)."""
    n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                LEFT, RIGHT, WINDOW, False, cls, cbase, csq)
    if MMOD:
        n_begin, n_end = class_keys(cls, cbase + (q0 // CLASS_BLOCK) * csq, n_begin, n_end)
    n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0
    return n_begin, n_tiles, n_lo, n_full


def make_attn_forward_wgmma_persistent(var):
    """The persistent forward kernel of variant ``var`` (family "hopper",
    ``var.tiles.persistent``, with a producer of bulk copies, ``block_n`` = ``block_m``: Q's
    map has boxes of ``block_n`` rows): head dim 64 or 128, causal or not, fp16 or bf16,
    dense or varlen rows, a window and a mask_mod, no score modifier; the same launch
    arguments and results as ``pingpong.py``'s, on a grid of at most one block per
    multiprocessor (``launch.launch_forward``'s ``ctas``).

    The producer's first thread copies K0, Q, V0, K1, V1, ... of each query tile in turn
    (its other 127 threads are done at once: no warp spins beside the consumers'); every
    consumer warp arrives on "q empty" once its last Q Kᵀ of the tile is done. With
    two-stage rings (``stages`` 2, g2n128op2wts) Q has two buffers and O's rows go through
    a tile of their own to 16-byte stores (``epilogue.store_o``). With three, one Q buffer
    (loaded once the consumers are done with the last) and O stored from the registers
    (``store_frags``): slower (H200, D=128 B=4 H=16 N=4096: 616 against 676 TFLOP/s;
    notes/persistent_2026-11-27.md)."""
    D, t = var.head_dim, var.tiles
    SMOD, MMOD, VIEWS, VALUE, _, KEEPS = kernel_mods(var)
    LEFT, RIGHT, WINDOW, CAP, CAP_C, ALIBI, LINEAR, FOLD = mask_flags(var, SMOD)
    if SMOD or CAP or ALIBI:
        raise ValueError(f"the persistent forward takes a window and a mask_mod, no score "
                         f"modifier: {var.tag}")
    if D % 64 or D > 128:
        raise ValueError(f"head_dim={D} must be 64 or 128 for the persistent wgmma forward")
    if not (t.persistent and t.producer and t.tma):
        raise ValueError(f"not a persistent tiling with a producer of bulk copies: {t}")
    BN, BM, STAGES = t.block_n, t.block_m, t.stages
    PACKED = PACKING[var.packed]
    DYNAMIC = bool(t.dynamic)
    if PACKED not in (DENSE, VARLEN):
        raise ValueError(f"the persistent forward takes dense or varlen rows: {var.tag}")
    CH = D // 8
    PANELS = CH // 8  # 64-column boxes of a bulk tensor copy
    KSTEPS, PSTEPS = D // 16, BN // 16
    NTILES, DTILES = BN // 8, D // 8
    NS, NO, NP = BN // 2, D // 2, BN // 4
    STAGE = BN * D * 2
    QBYTES = BM * D * 2
    if BN != BM:  # (Q's bulk copy takes the map's box of block_n rows)
        raise ValueError(f"the persistent forward with a producer takes square tiles: {t}")
    if MMOD and BM != CLASS_BLOCK:  # (key_tiles: a tile is one class block)
        raise ValueError(f"the persistent forward takes a mask_mod on {CLASS_BLOCK}-row "
                         f"tiles: {t}")
    # two-stage rings leave room for two Q buffers and a tile of O rows (not the Q rows'
    # spot, which the next Q takes)
    QBUFS = 2 if STAGES == 2 else 1
    STAGED = QBUFS == 2
    Q_OFF = 0
    K_OFF = QBUFS * QBYTES
    V_OFF = K_OFF + STAGES * STAGE
    O_OFF = V_OFF + STAGES * STAGE
    BAR_OFF = O_OFF + (QBYTES if STAGED else 0)
    # after the barriers, eight 32-bit words per Q buffer: the query tile of its use (dense:
    # its item; varlen: its sequence, head and first row in the sequence), then (MMOD) the
    # first key and the key tiles of the span its classes leave, which the producer found
    # (the consumers do not scan the classes again between tiles)
    ITEM_OFF = BAR_OFF + (4 * STAGES + 2 * QBUFS) * BAR * 2
    STOP = 0xFFFFFFFF  # (a varlen sequence word: no tile left)
    V_LBO = BN * LINE
    CAUSAL = bool(var.causal)
    BF16 = var.dtype == "bfloat16"
    # setmaxnreg moves registers within what the block was launched with (168 a thread at
    # 384 threads): 40 + 2 x 232 <= 3 x 168 (32 + 2 x 240 waited forever on the GPU). The
    # producer's loop (tile indices from the counter, the last tile's word) spilled 40
    # bytes at 24, the ping-pong producer's share; the consumers fit 232 (ptxas 13.0). The
    # static walk (no counter) keeps 24 and 240
    PRODUCER_REGS, CONSUMER_REGS = (40, 232) if DYNAMIC else (24, 240)
    assert PRODUCER_REGS + 2 * CONSUMER_REGS <= 3 * 168

    @device_function
    def step_softmax(s, n0, n_full, n_lo, i, w0, Nq, Nk, causal_offset, b, h, tq, ma, mb,
                     la, lb, sl2, margs, cl):
        """A key tile's softmax: the plain steps, or with the window's edges (WINDOW,
        compile-time: ``forward.softmax_tile_mods``), or by the tile's class ``cl`` under a
        mask_mod (MMOD, compile-time; as ``forward.classed_softmax``: PARTIAL the mask_mod
        per score, an EMPTY tile inside the span computed with its scores -inf)."""
        partial = False
        if MMOD:
            partial = cl == PARTIAL
            if cl == EMPTY:
                for e in range(4 * NTILES):
                    s[e] = NEG_INF
        if WINDOW or MMOD:
            return softmax_tile_mods(s, n0, BN, n_full, n_lo, partial, i, w0, Nq, Nk,
                                     causal_offset, b, h, tq, ma, mb, la, lb, sl2,
                                     float32(1.0), float32(1.0), float32(0.0), float32(1.0),
                                     float32(1.0), margs, CAUSAL, LEFT, RIGHT, WINDOW, False,
                                     False, False, False, KEEPS, VALUE, NTILES, 0)
        return softmax_tile(s, n0, BN, n_full, i, Nk, causal_offset, CAUSAL, NTILES, tq, ma,
                            mb, la, lb, sl2)

    def attn_forward_wgmma(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                           qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                           vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale, slopes, ssb, ssh,
                           m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                           e12, e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table,
                           tsb, page, psp, TQ, chunk, oss, lss, nseq):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        wtid = tid & 127
        wg = warp_uniform((tid >> 7) - 1)  # consumer warpgroup (-1: the producer)
        warp = (tid >> 5) & 3
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        GX = (Nq + BM - 1) // BM
        GY = nseq * Hq  # (the launch passes the batch as nseq)
        n_items = GX * GY
        G = cuda.gridDim.x
        c = cuda.blockIdx.x

        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad
        el = pad >> 1
        full_k = el + BAR_OFF // 2
        full_v = full_k + BAR * STAGES
        empty_k = full_v + BAR * STAGES
        empty_v = empty_k + BAR * STAGES
        q_full = empty_v + BAR * STAGES
        q_empty = q_full + BAR * QBUFS
        if tid == 0:
            for st in range(STAGES):
                mbarrier_init(smem, full_k + BAR * st, 1)  # (the bulk copies' bytes)
                mbarrier_init(smem, full_v + BAR * st, 1)
                mbarrier_init(smem, empty_k + BAR * st, EMPTY_COUNT)
                mbarrier_init(smem, empty_v + BAR * st, EMPTY_COUNT)
            for qb in range(QBUFS):
                mbarrier_init(smem, q_full + BAR * qb, 1)  # (Q's bulk copy's bytes)
                mbarrier_init(smem, q_empty + BAR * qb, EMPTY_COUNT)
        cuda.syncthreads()  # the barriers initialized before any arrival

        if wg < 0:  # the producer's first thread: K0, Q, V0, K1, V1, ...
            setmaxnreg_dec(PRODUCER_REGS)
            if wtid == 0:  # (the other 127 threads are done: no warp spins beside the
                # consumers' on their schedulers)
                # (32-bit tile indices: the producer has 24 or 40 registers)
                GX32, GY32, N_ITEMS = int32(GX), int32(GY), int32(n_items)
                fence_tensormap(table, 0)
                fence_tensormap(table, 1)
                fence_tensormap(table, 2)
                R = 0  # ring index of the query tile's key tile 0
                u = 0  # query tiles so far (Q in buffer u % QBUFS)
                item = int32(c)  # (then the next not taken, from the launch's counter 0)
                if PACKED == VARLEN:  # (compile-time) items: the packed tile axis, heads
                    # innermost
                    n_seq_tiles = int32(0)
                    for sq in range(nseq):
                        n_seq_tiles += int32(sequence_tiles(cu_q, sq, BM))
                    N_ITEMS = n_seq_tiles * int32(Hq)
                    sc = int32(0)  # the scan's sequence, and its first tile
                    bc = int32(0)
                while True:
                    qb = u % QBUFS  # (the buffer's (u // QBUFS)-th use)
                    slot = el + ITEM_OFF // 2 + 16 * qb
                    if item >= N_ITEMS:  # none left: the consumers are told through
                        # Q's barrier, with no copy
                        if u >= QBUFS:
                            mbarrier_wait(smem, q_empty + BAR * qb, (u // QBUFS - 1) & 1)
                        st_shared_u32(smem, slot, uint32(STOP if PACKED == VARLEN
                                                         else N_ITEMS))
                        mbarrier_arrive(smem, q_full + BAR * qb)
                        break
                    if PACKED == VARLEN:
                        sc, h, qt, bc = packed_item(item, n_seq_tiles, int32(Hq), CAUSAL, sc,
                                                    bc, cu_q, BM)
                        b = sc
                        hk = h // group
                        q0 = qt * BM
                        q_row0, k_row0, nq, nk, co = sequence(b, Nq, Nk, causal_offset, cu_q,
                                                              cu_k, seqk, PACKED)
                    else:
                        b, h, hk, q0, q_row0, k_row0, nq, nk, co = tile_rows(
                            item, GX32, GY32, Hq, group, BM, Nq, Nk, causal_offset, cu_q,
                            cu_k, seqk, CAUSAL, PACKED)
                    # (varlen rows: the maps hold every packed row as batch entry 0)
                    tb = int64(0) if PACKED == VARLEN else int64(b)
                    nb, n_tiles, _, _ = key_tiles(q0, BM, BN, nq, nk, co, CAUSAL, LEFT, RIGHT,
                                                  WINDOW, MMOD, cls, b * csb + h * csh, csq)
                    kr = k_row0 + nb  # (the tile's first key row in the maps)
                    if n_tiles > 0:  # (its stage frees before the last tile's Q is done)
                        produce_tma_at(smem, el, K_OFF, table, 1, k, hk, tb, 0, R, kr,
                                       full_k, empty_k, STAGES, STAGE, BN, PANELS)
                    if u >= QBUFS:  # every consumer warp done with its last use's Q Kᵀ
                        mbarrier_wait(smem, q_empty + BAR * qb, (u // QBUFS - 1) & 1)
                    # (published by the arrival)
                    if PACKED == VARLEN:
                        st_shared_u32(smem, slot, uint32(b))
                        st_shared_u32(smem, slot + 2, uint32(h))
                        st_shared_u32(smem, slot + 4, uint32(q0))
                    else:
                        st_shared_u32(smem, slot, uint32(item))
                    if MMOD:
                        st_shared_u32(smem, slot + 8, uint32(nb))
                        st_shared_u32(smem, slot + 10, uint32(n_tiles))
                    mbarrier_expect_tx(smem, q_full + BAR * qb, QBYTES)
                    for pn in range(PANELS):
                        tma_load_4d(smem, el + (Q_OFF + qb * QBYTES) // 2 + pn * (BM * 64),
                                    table, 0, q, 64 * pn, q_row0 + q0, h, tb,
                                    q_full + BAR * qb)
                    for tt in range(n_tiles):
                        if tt > 0:
                            produce_tma_at(smem, el, K_OFF, table, 1, k, hk, tb, tt, R + tt,
                                           kr, full_k, empty_k, STAGES, STAGE, BN, PANELS)
                        produce_tma_at(smem, el, V_OFF, table, 2, v, hk, tb, tt, R + tt, kr,
                                       full_v, empty_v, STAGES, STAGE, BN, PANELS)
                    R += n_tiles
                    u += 1
                    if DYNAMIC:
                        item = int32(G) + int32(counter_add(table, 0, 1))
                    else:
                        item = walk(u, c, G)
                # the last block to run out sets the counters to zero for the next launch
                # that reads this slot (no block takes a tile after it ran out)
                # (acquire-release: every block's counter-0 atomics precede the reset)
                if DYNAMIC and int64(counter_add_acq_rel(table, 1, 1)) == G - 1:
                    counter_store(table, 0, 0)
                    counter_store(table, 1, 0)
        else:
            setmaxnreg_inc(CONSUMER_REGS)
            sl2, _, _, _, _, _ = score_constants(scale, slopes, 0, 0, ssb, ssh, float32(1.0),
                                                 False, False)
            margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                           e12, e13, e14, e15))
            s = cuda.local.array(NS, float32)
            oa = cuda.local.array(NO, float32)
            pf = cuda.local.array(NP, uint32)
            R = 0
            u = 0
            # The turns carry on from one query tile to the next (armed once here): the first
            # warpgroup starts a tile's first Q Kᵀ once the second issued the tile before's
            # last P V, not once the second is through its stores too
            if wg == 1:
                named_arrive(1, 256)
            while True:
                qb = u % QBUFS
                mbarrier_wait(smem, q_full + BAR * qb, (u // QBUFS) & 1)
                slot = el + ITEM_OFF // 2 + 16 * qb
                if PACKED == VARLEN:  # (compile-time) the tile, as the producer found it
                    word = ld_shared_u32(smem, slot)
                    if word == uint32(STOP):  # (the producer's: none left)
                        break
                    b = int64(word)
                    h = int64(ld_shared_u32(smem, slot + 2))
                    q0 = int64(ld_shared_u32(smem, slot + 4))
                    hk = h // group
                    q_row0, _, nq, nk, co = sequence(b, Nq, Nk, causal_offset, cu_q, cu_k,
                                                     seqk, PACKED)
                else:
                    item = int64(ld_shared_u32(smem, slot))
                    if item >= n_items:  # (the producer's: none left)
                        break
                    b, h, hk, q0, q_row0, _, nq, nk, co = tile_rows(
                        item, GX, GY, Hq, group, BM, Nq, Nk, causal_offset, cu_q, cu_k,
                        seqk, CAUSAL, PACKED)
                cbase = b * csb + h * csh  # (MMOD) this head's tile classes
                n_begin, n_tiles, n_lo, n_full = key_tiles(q0, BM, BN, nq, nk, co, CAUSAL,
                                                           LEFT, RIGHT, WINDOW, False, cls,
                                                           cbase, csq)
                if MMOD:  # (compile-time) the span of the classes, as the producer found it
                    n_begin = int64(ld_shared_u32(smem, slot + 8))
                    n_tiles = int64(ld_shared_u32(smem, slot + 10))
                qa = at + Q_OFF + qb * QBYTES + 64 * wg * LINE
                acc = zero_accumulators(D)
                ma = mb = NEG_INF
                la = lb = float32(0.0)
                w0 = q0 + 64 * wg + 16 * warp  # this warp's 16 rows
                i = w0 + g

                if n_tiles > 0:
                    # (MMOD: the tile's class loaded before the wait, under the product)
                    cl = 0
                    if MMOD:
                        cl = tile_class(cls, cbase, csq, q0, BM, nq, n_begin, BN, nk)
                    wait_full(smem, full_k, R, STAGES)
                    take_turn(wg)
                    sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                    at + K_OFF + stage_of(R, STAGES) * STAGE, KSTEPS, BM, BN)
                    pass_turn(wg)
                    sacc = wgmma_wait_group_acc(0, sacc)
                    release(smem, empty_k, R, STAGES, lane)
                    if n_tiles == 1 and lane == 0:  # (this warp is done with Q)
                        mbarrier_arrive(smem, q_empty + BAR * qb)
                    acc_to_local(sacc, s)
                    ma, mb, la, lb, al0, al1 = step_softmax(s, n_begin, n_full, n_lo, i, w0,
                                                            nq, nk, co, b, h, tq, ma, mb, la,
                                                            lb, sl2, margs, cl)
                    pack_p(BF16, pf, s, NP)
                else:  # (a tile that sees no key reads no Q) once every thread of the
                    # warpgroup has read the tile's word: the producer writes the buffer's
                    # next after these arrivals (a warp's lanes need not run in step)
                    wg_barrier(wg)
                    if lane == 0:
                        mbarrier_arrive(smem, q_empty + BAR * qb)
                for it in range(1, n_tiles):
                    n0 = n_begin + it * BN
                    r = R + it
                    cl = 0
                    if MMOD:
                        cl = tile_class(cls, cbase, csq, q0, BM, nq, n0, BN, nk)
                    wait_full(smem, full_k, r, STAGES)
                    wait_full(smem, full_v, r - 1, STAGES)
                    take_turn(wg)
                    sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                    at + K_OFF + stage_of(r, STAGES) * STAGE, KSTEPS, BM, BN)
                    acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                                   at + V_OFF + stage_of(r - 1, STAGES) * STAGE, PSTEPS,
                                   V_LBO)
                    pass_turn(wg)
                    sacc = wgmma_wait_group_acc(1, sacc)  # S_it (P V may still run)
                    release(smem, empty_k, r, STAGES, lane)
                    if it == n_tiles - 1 and lane == 0:  # (this warp is done with Q)
                        mbarrier_arrive(smem, q_empty + BAR * qb)
                    acc_to_local(sacc, s)
                    ma, mb, la, lb, al0, al1 = step_softmax(s, n0, n_full, n_lo, i, w0, nq,
                                                            nk, co, b, h, tq, ma, mb, la, lb,
                                                            sl2, margs, cl)
                    acc = wgmma_wait_group_acc(0, acc)
                    release(smem, empty_v, r - 1, STAGES, lane)
                    acc_to_local(acc, oa)
                    rescale(oa, al0, al1, DTILES)
                    acc = acc_from_local(oa, D)
                    pack_p(BF16, pf, s, NP)
                if n_tiles > 0:
                    last = R + n_tiles - 1
                    wait_full(smem, full_v, last, STAGES)
                    if PACKED == VARLEN:  # (compile-time) the value rows past the sequence
                        # (the next one's, by the bulk copy) zeroed by the first warpgroup
                        # before its turn, which the second's waits for (pingpong.py's)
                        nl = n_begin + (n_tiles - 1) * BN
                        # (then fenced for the products' async proxy: only those writes)
                        if wg == 0 and nl + BN > nk:
                            clear_rows(smem, el + (V_OFF + stage_of(last, STAGES) * STAGE) // 2,
                                       nk - nl, BN, PANELS, wtid)
                            fence_proxy_async()
                    take_turn(wg)
                    acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                                   at + V_OFF + stage_of(last, STAGES) * STAGE, PSTEPS, V_LBO)
                    pass_turn(wg)  # (the second's: to the first's next tile, or its end)
                    acc = wgmma_wait_group_acc(0, acc)
                    release(smem, empty_v, last, STAGES, lane)
                R += n_tiles
                u += 1

                acc_to_local(acc, oa)
                obase = b * osb + h * osh + q_row0 * osn
                lrow, _ = stat_rows(b, h, Hq, nq, q_row0, TQ, PACKED)
                inv0 = finish_row(lse, lrow, i, nq, ma, sl2, la, tq)
                inv1 = finish_row(lse, lrow, i + 8, nq, mb, sl2, lb, tq)
                if STAGED:  # (compile-time) through the O tile, 16-byte stores
                    store_o(BF16, smem, el + O_OFF // 2, o, obase, q0 + 64 * wg, i, nq, osn,
                            osd, oa, inv0, inv1, D, BM, wg, warp, g, tq, wtid)
                else:
                    store_frags(o, obase, i, nq, osn, osd, oa, 0, inv0, inv1, DTILES, tq)
            if wg == 0:  # the second's last pass, matched
                take_turn(wg)

    attn_forward_wgmma.__qualname__ = var.tag
    return attn_forward_wgmma
