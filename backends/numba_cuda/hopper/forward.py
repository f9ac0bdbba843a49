"""Hopper (sm_90a) forward kernel for fp16/bf16: ``attn_forward_wgmma``, warpgroup MMAs.

One thread block per (query tile, batch * query head), as ``tensor_core/forward.py``; the
block's ``warpgroups`` warpgroups (128 threads each) own 64 query rows each. Per key tile
of ``block_n`` keys:

- ``S = Q Kᵀ``: ``D / 16`` wgmma m64nNk16 (N = ``block_n``) with both operands in shared
  memory, K-major with the 128-byte swizzle: Q's 64 rows of the warpgroup as A, the key
  tile's rows as Bᵀ. The accumulators (a tuple, ``device/wgmma.py``) are stored into a
  local array whose layout is mma.sync's C fragments n-tile by n-tile (wgmma's accumulator
  layout repeats m16n8 per warp), so the row code of the mma.sync forward serves as it is:
  the seam's mask (``mask_bounds``) on diagonal and tail tiles, ``softmax_row``, ``finish_row``.
- ``O += P V``: ``block_n / 16`` wgmma with A from registers: the fp32 P of two adjacent
  8-key n-tiles, rounded and packed in pairs, is exactly the register A fragment of one
  k-step (rows ``g`` and ``g + 8`` of the warp's 16, as mma.sync's m16n8k16 A), so P never
  leaves registers; V is the B operand straight from its rows, MN-major (``trans_b`` 1)
  with the 128-byte swizzle. O's accumulators are rescaled through a local array too.

Q, K and V reach shared memory by 16-byte ``cp.async`` copies into the swizzled layout
(``device/wgmma.tile_offset``; a 16-byte chunk is never split by the swizzle), K and V
double-buffered one tile ahead in separate commit groups, as in the mma.sync forward. The
copies are ordinary (generic-proxy) writes that a wgmma reads through the async proxy, so
every thread runs ``fence.proxy.async`` after its copies have landed and before the barrier
that publishes them. The dynamic shared memory's start is aligned to 1024 bytes at run time
(the swizzle pattern's span; descriptors' base offset 0).

v1 leaves out what FlashAttention 3 adds on top (notes/hopper_forward_2026-11-24.md): TMA
loads issued by a producer warp (``setmaxnreg`` moving registers to the consumers),
mbarrier pipelines instead of ``cp.async`` + ``bar.sync``, two warpgroups ping-ponging so
one's softmax hides under the other's GEMMs, and the softmax of tile ``j`` overlapped with
``Q K_{j+1}ᵀ`` inside a warpgroup. Each wgmma group here is waited for at once.

Masks and score modifiers go through the seams as in the mma.sync forward (the same row
functions on the same fragment layout): the window's key range and edge tiles, the softcap,
ALiBi, the user's score_mod and mask_mod (tiles a mask_mod's classes leave empty are
skipped: such variants take a schedule without the overlap, where a tile can be skipped
between its copies). Dense rows only: packed rows and split-KV go to the mma.sync kernels
(``launch.hopper_serves``). Launch arguments are those of every forward (``launch.signature``), so the host
side is shared.
"""
from __future__ import annotations

from numba import cuda, float32, int64, uint16, uint32, uint64

from ..device.constants import (
    DENSE,
    EMPTY,
    FLT_MIN,
    HEAD_GROUP,
    LOG2E,
    NEG_INF,
    PACKING,
    PARTIAL,
    SMEM_ALIGN,
)
from ..device.convert import device_function, smem_pointer
from ..device.intrinsics import cp_async16, cp_async_commit, cp_async_wait, warp_uniform
from ..device.prologue import block_tile, split_heads
from ..device.seams import (
    distance,
    packed_tile,
    sequence,
    slope_of,
    softcap,
    stat_rows,
    tile_class,
    visited_keys,
)
from ..device.user_mods import kernel_mods
from ..device.wgmma import (
    SWIZZLE_128B,
    acc_from_local,
    acc_to_local,
    fence_proxy_async,
    smem_address,
    smem_descriptor,
    wgmma_commit_group,
    wgmma_fence_acc,
    wgmma_rs_bf16,
    wgmma_rs_f16,
    wgmma_ss_bf16,
    wgmma_ss_f16,
    wgmma_wait_group_acc,
    zero_accumulators,
)
from ..tensor_core.forward import (
    alibi_row,
    alibi_side,
    finish_row,
    mask_bounds,
    mask_row,
    rescale_row,
    softmax_row,
    user_row,
)
from ..tensor_core.fragments import pack
from ..tilings import HOPPER_ALIGN, HOPPER_ROWS
from .epilogue import store_o

#: Bytes of one swizzled line (64 elements of 16 bits) and of the 8-line pattern (a
#: K-major descriptor's SBO, an MN-major one's "next 8 k").
LINE = 128
PATTERN = 8 * LINE


@device_function
def load_tile(smem, e0, src, base, n0, nvalid, sn, ROWS, CH, tid, NT):
    """A whole ``ROWS``-line tile: :func:`load_rows` with column blocks of ``ROWS`` lines."""
    load_rows(smem, e0, src, base, n0, nvalid, sn, ROWS, ROWS, CH, tid, NT)


@device_function
def load_rows(smem, e0, src, base, n0, nvalid, sn, ROWS, BLOCK, CH, tid, NT):
    """Rows ``n0 .. n0 + ROWS - 1`` of ``src`` (row ``r`` at ``base + r * sn``, ``8 * CH``
    contiguous elements) into the 128B-swizzled tile at element ``e0`` of ``smem`` (a
    ``ROWS x 8 CH`` tile of ``device/wgmma``: blocks of 64 columns, ``BLOCK`` lines of 128
    bytes each, 16-byte chunk ``c`` of line ``r`` at chunk ``c ^ (r % 8)``; ``BLOCK`` >
    ``ROWS``: the rows are part of a taller tile, ``e0`` their first line), by 16-byte
    ``cp.async`` copies; rows at or past ``nvalid`` are zero-filled. Thread ``tid`` copies
    chunk ``tid % CH`` of every ``NT // CH``-th row (consecutive threads read consecutive
    16 bytes of a row; the 8 chunks of a line land on distinct banks).

    The copies are most of a kernel's integer instructions, so each costs as few as it
    can: one 64-bit row address per tile, advanced by a pass's stride; where a pass moves
    a multiple of 8 lines (the swizzle's period) its shared spot is the first pass's plus
    a constant; a tile whose rows all exist takes no bounds checks (ncu on an H100: these
    copies were ~16 integer instructions each, 55% of the ping-pong forward's).
    """
    RS = NT // CH  # rows per pass
    c = tid % CH
    r = tid // CH
    col = (c >> 3) * (BLOCK * 64) + (c & 7) * 8  # element offset of the chunk's unswizzled spot
    g = base + (n0 + r) * sn + 8 * c  # this thread's first row, then a pass further each time
    step = RS * sn
    if RS % 8 == 0:
        # the swizzle on the tile's own offset (chunk bits ^= line bits), then the tile's
        # start (1024-byte aligned in the shared state space, not in this array's indices);
        # a pass adds RS lines to the offset and leaves the chunk bits alone
        so = e0 + ((col ^ ((r & 7) << 3)) + r * 64)
        if n0 + ROWS <= nvalid:
            for p in range(ROWS // RS):
                cp_async16(smem, so + p * (RS * 64), src, g, 16)
                g += step
        else:
            left = nvalid - n0 - r  # this thread's rows p * RS below it exist
            for p in range(ROWS // RS):
                ok = p * RS < left
                cp_async16(smem, so + p * (RS * 64), src, g if ok else base, 16 if ok else 0)
                g += step
    else:
        for p in range(ROWS // RS):
            rr = r + p * RS
            so = e0 + ((col + rr * 64) ^ ((rr & 7) << 3))
            ok = n0 + rr < nvalid
            cp_async16(smem, so, src, g if ok else base, 16 if ok else 0)
            g += step


@device_function
def k_start(kk, ROWS):
    """Byte offset, in a K-major ``ROWS``-line swizzled tile, of the first element of k-step
    ``kk`` (16 columns): its 64-column block, then 32 bytes per step inside the line
    (``device/wgmma.tile_start``)."""
    return ((16 * kk) // 64) * (ROWS * LINE) + ((16 * kk) % 64) * 2


@device_function
def qk_step(BF16, acc, da, db, scale_d):
    """One k-step of ``S = Q Kᵀ``: both operands K-major (the intrinsics take literal
    trans flags: kernels call this rather than capture an intrinsic in their closure)."""
    if BF16:
        return wgmma_ss_bf16(acc, da, db, scale_d, 0, 0)
    return wgmma_ss_f16(acc, da, db, scale_d, 0, 0)


@device_function
def pv_step(BF16, acc, a0, a1, a2, a3, db):
    """One k-step of ``O += P V``: P's A fragment from registers, V MN-major."""
    if BF16:
        return wgmma_rs_bf16(acc, a0, a1, a2, a3, db, 1, 1)
    return wgmma_rs_f16(acc, a0, a1, a2, a3, db, 1, 1)


@device_function
def issue_qk(BF16, sacc, qa, kb, KSTEPS, BM, BN):
    """Issue ``S = Q Kᵀ`` (``KSTEPS`` wgmmas, K-major descriptors of Q's 64 rows at shared
    address ``qa`` in a ``BM``-line tile and of the key tile at ``kb``, ``BN`` lines) as one
    commit group; ``sacc`` (fenced zeros) is overwritten by k-step 0."""
    da0 = smem_descriptor(qa, 16, PATTERN, SWIZZLE_128B)
    db0 = smem_descriptor(kb, 16, PATTERN, SWIZZLE_128B)
    # runs of at most 8 k-steps: LLVM unrolls a loop of 8 wgmmas but left D=256's 16
    # rolled, and ptxas then serializes the wgmmas of a loop that carries accumulators
    sacc = qk_steps(BF16, sacc, da0, db0, 0, min(KSTEPS, 8), BM, BN)
    if KSTEPS > 8:  # (compile-time)
        sacc = qk_steps(BF16, sacc, da0, db0, 8, KSTEPS, BM, BN)
    wgmma_commit_group()
    return sacc


@device_function
def qk_steps(BF16, sacc, da0, db0, k0, k1, BM, BN):
    """k-steps ``k0 .. k1 - 1`` of ``S = Q Kᵀ`` (:func:`issue_qk`)."""
    for kk in range(k0, k1):
        # a k-step's descriptor is the tile's plus its start (address field: bytes / 16;
        # shared addresses stay below 256 KiB, so the 14-bit field never carries)
        da = da0 + uint64(k_start(kk, BM) >> 4)
        db = db0 + uint64(k_start(kk, BN) >> 4)
        sacc = qk_step(BF16, sacc, da, db, kk)
    return sacc


@device_function
def issue_pv(BF16, acc, pf, vb, PSTEPS, V_LBO):
    """Issue ``O += P V`` (``PSTEPS`` wgmmas, P's A fragments ``pf[4 kk:4 kk + 4]``, V
    MN-major at shared address ``vb``) as one commit group."""
    db0 = smem_descriptor(vb, V_LBO, PATTERN, SWIZZLE_128B)
    for kk in range(PSTEPS):
        db = db0 + uint64(kk * LINE)  # (16 lines down: 16 * LINE bytes, / 16)
        acc = pv_step(BF16, acc, pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                      db)
    wgmma_commit_group()
    return acc


@device_function
def softmax_tile(s, n0, BN, n_full, i, Nk, causal_offset, CAUSAL, NTILES, tq, ma, mb, la,
                 lb, sl2):
    """The online softmax of one score tile on this thread's rows ``i`` (``s[4 jn + 0,
    1]``) and ``i + 8`` (``s[4 jn + 2, 3]``), in the log2 domain, a diagonal or tail tile
    through the mask first; ``s`` becomes P (fp32). Returns the new ``(ma, mb, la, lb)``
    and the factors ``(al0, al1)`` that rescale the rows' accumulators."""
    if n0 + BN > n_full:
        mask_bounds(s, 0, n0, i, Nk, causal_offset, CAUSAL, -1, -1, NTILES, tq)
        mask_bounds(s, 2, n0, i + 8, Nk, causal_offset, CAUSAL, -1, -1, NTILES, tq)
    ma, al0, ps = softmax_row(s, 0, ma, sl2, NTILES, float32(0.0), False, 0)
    la = la * al0 + ps
    mb, al1, ps = softmax_row(s, 2, mb, sl2, NTILES, float32(0.0), False, 0)
    lb = lb * al1 + ps
    return ma, mb, la, lb, al0, al1


@device_function
def softmax_tile_mods(s, n0, BN, n_full, n_lo, partial, i, w0, Nq, Nk, causal_offset, b, h,
                      tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc, margs, CAUSAL,
                      LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE, NTILES,
                      POLY):
    """:func:`softmax_tile` with the masks and score modifiers, in the mma.sync forward's
    order: the softcap, ALiBi (warp ``w0``'s 16 rows for its linear form), the user's
    score_mod, then the masks (causal, the window, the user's mask_mod where ``partial``)
    on tiles that need them; each compile-time flag off leaves that step out, so a plain
    variant compiles to :func:`softmax_tile`'s code. ``POLY``: the tiling's share of
    exponentials on the FMA pipe (``HopperTiles.poly``, ``softmax_row``)."""
    if CAP:  # (compile-time) raw scores s -> (c / scale) tanh(s scale / c); where
        # score_constants folds the factor (capr 1), tanh(s scale / c) alone
        for e in range(4 * NTILES):
            s[e], _ = softcap(s[e], capr, rcapr, True)
    ra = rb = float32(0.0)
    if ALIBI:  # (compile-time) the distance bias, after the softcap
        side, lin = alibi_side(n0, BN, w0, 16, causal_offset, slope, CAUSAL, LINEAR)
        d0 = distance(i, n0 + 2 * tq, causal_offset)
        ra = alibi_row(s, 0, d0, slope, side, lin, NTILES)
        rb = alibi_row(s, 2, d0 + float32(8.0), slope, side, lin, NTILES)
    if SMOD:  # (compile-time) the user's score_mod, after the softcap and ALiBi
        user_row(s, 0, n0, i, Nk, NTILES, tq, VALUE, margs, b, h, Nq, unit, sc)
        user_row(s, 2, n0, i + 8, Nk, NTILES, tq, VALUE, margs, b, h, Nq, unit, sc)
    # a diagonal, edge or tail tile; with a mask_mod, every partial tile
    if partial or n0 + BN > n_full or (WINDOW and n0 < n_lo):
        mask_row(s, 0, n0, i, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq, partial,
                 KEEPS, margs, b, h, Nq)
        mask_row(s, 2, n0, i + 8, Nk, causal_offset, CAUSAL, LEFT, RIGHT, NTILES, tq,
                 partial, KEEPS, margs, b, h, Nq)
    ma, al0, ps = softmax_row(s, 0, ma, sl2, NTILES, ra, ALIBI, POLY)
    la = la * al0 + ps
    mb, al1, ps = softmax_row(s, 2, mb, sl2, NTILES, rb, ALIBI, POLY)
    lb = lb * al1 + ps
    return ma, mb, la, lb, al0, al1


@device_function
def classed_softmax(MMOD, cls, cbase, csq, q0, BM, s, n0, BN, n_full, n_lo, i, w0, Nq, Nk,
                    causal_offset, b, h, tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc,
                    margs, CAUSAL, LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE,
                    NTILES, POLY):
    """:func:`softmax_tile_mods` on a tile of the overlapped schedule (every tile of its
    range): with a mask_mod (``MMOD``) its class decides: EMPTY, every score -inf (the
    mask_mod not asked; with other mods, which -inf need not pass, it is asked), PARTIAL
    the mask_mod per score, FULL none."""
    partial = False
    if MMOD:
        cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
        partial = cl == PARTIAL or (cl == EMPTY and (SMOD or CAP or ALIBI))
        if cl == EMPTY and not partial:  # (the mask_mod not asked)
            for e in range(4 * NTILES):
                s[e] = NEG_INF
    return softmax_tile_mods(s, n0, BN, n_full, n_lo, partial, i, w0, Nq, Nk, causal_offset, b,
                             h, tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc, margs,
                             CAUSAL, LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS,
                             VALUE, NTILES, POLY)


@device_function
def sequence_bases(b, h, hk, Nq, Nk, causal_offset, cu_q, cu_k, seqk, qsb, qsh, qsn, ksb,
                   ksh, ksn, vsb, vsh, vsn, PACKED):
    """This block's rows, dense or one varlen sequence (``seams.sequence``; ``PACKED``
    compile-time): ``(q_row0, Nq, Nk, causal_offset, qbase, kbase, vbase)``, the sequence's
    first query row, its sizes and alignment, and the elements where its rows of Q (head
    ``h``), K and V (head ``hk``) start."""
    q_row0, k_row0, nq, nk, co = sequence(b, Nq, Nk, causal_offset, cu_q, cu_k, seqk, PACKED)
    return (q_row0, nq, nk, co, b * qsb + h * qsh + q_row0 * qsn,
            b * ksb + hk * ksh + k_row0 * ksn, b * vsb + hk * vsh + k_row0 * vsn)


def mask_flags(var, SMOD):
    """The compile-time mask options of a wgmma forward variant: ``(LEFT, RIGHT, WINDOW,
    CAP, CAP_C, ALIBI, LINEAR, FOLD)``, the window's bounds (-1: unbounded side) and whether
    it has one, the softcap and its cap, ALiBi (slopes in raw-score units here: slope /
    scale) and whether its per-row part leaves the scores for the softmax (``alibi_row``),
    as it does unless a score_mod (``SMOD``) must see the biased score; and whether the
    softcap's outer factor folds into the log2 factor (:func:`score_constants`: a softcap
    with neither ALiBi nor a score_mod after it, which would need the capped score in its
    own units)."""
    LEFT, RIGHT = var.bounds
    CAP = bool(var.softcap)
    CAP_C = float32(var.softcap) if CAP else float32(1.0)
    ALIBI = var.alibi
    return (LEFT, RIGHT, bool(var.window), CAP, CAP_C, ALIBI, ALIBI and not SMOD,
            CAP and not ALIBI and not SMOD)


@device_function
def score_constants(scale, slopes, b, h, ssb, ssh, CAP_C, ALIBI, FOLD):
    """Per block, what the second seam needs for head ``(b, h)``: ``(sl2, capr, rcapr,
    slope, unit, sc)``, the factor to the log2 domain (kept a normal fp32 number: -inf *
    sl2 stays -inf), the cap in raw-score units and its inverse (used where CAP), ALiBi's
    slope in raw-score units, the factor from natural scores to raw ones and the scale (a
    score_mod's). ``FOLD`` (compile-time, :func:`mask_flags`): the softmax takes a capped
    score as ``tanh(s / capr)`` alone, its factor ``capr`` moved into the log2 factor (the
    cap times log2 e: the same exponentials, lse and normalization, one multiply a score
    fewer)."""
    sl2 = float32(max(scale * LOG2E, FLT_MIN))
    capr = CAP_C / float32(scale)
    rcapr = float32(scale) / CAP_C
    if FOLD:
        sl2 = float32(CAP_C * LOG2E)
        capr = float32(1.0)
    unit = float32(1.0) / float32(scale)
    slope = slope_of(slopes, b, h, ssb, ssh, unit, ALIBI)
    return sl2, capr, rcapr, slope, unit, float32(scale)


@device_function
def pack_p(BF16, pf, s, NP):
    """P rounded to the input dtype and packed in pairs: ``pf[4 kk + r]`` is register ``r``
    of k-step ``kk``'s A fragment (wgmma's accumulator order is mma.sync's C order, whose
    two adjacent n-tiles are one A fragment)."""
    for x in range(NP):
        pf[x] = pack(BF16, s[2 * x], s[2 * x + 1])


@device_function
def rescale(oa, al0, al1, DTILES):
    """O's rows ``i`` and ``i + 8`` (local array ``oa``) times their factors."""
    rescale_row(oa, 0, al0, DTILES)
    rescale_row(oa, 2, al1, DTILES)


@device_function
def publish():
    """This thread's landed copies to the async proxy, then the barrier that shows every
    thread's to every warpgroup's wgmmas."""
    fence_proxy_async()
    cuda.syncthreads()


def make_attn_forward_wgmma(var):
    """The forward kernel of variant ``var`` (family "hopper"): head dim 64 or 128, tiling
    :class:`tilings.HopperTiles`, causal or not, fp16 or bf16, any masks and score
    modifiers (a mask_mod: any tiling; in the overlapped one the classes' key range, each
    tile of it by its class, :func:`classed_softmax`)."""
    D, t = var.head_dim, var.tiles
    if D % 64:
        raise ValueError(f"head_dim={D} must be a multiple of 64 for the wgmma forward")
    if var.packed not in HOPPER_ROWS or var.split:
        raise ValueError(f"the wgmma forward takes dense or varlen rows, no KV cache and no "
                         f"split-KV: {var.tag}")
    SMOD, MMOD, VIEWS, VALUE, _, KEEPS = kernel_mods(var)  # the user's score_mod, mask_mod
    if t.stages != 2 or t.producer:  # (the ping-pong forward has its own factory)
        raise ValueError(f"the overlapped wgmma forward double-buffers K and V, with no "
                         f"producer warpgroup: {var.tag}")
    BN = t.block_n
    BM, NT = t.block_m, t.threads
    CH = D // 8  # 16-byte chunks per row
    KSTEPS = D // 16  # k-steps of Q Kᵀ
    PSTEPS = BN // 16  # k-steps of P V
    NTILES = BN // 8  # 8-key n-tiles of S (mma.sync's C layout, 4 values each)
    DTILES = D // 8
    NS, NO = BN // 2, D // 2  # accumulators per thread: S, O
    NP = BN // 4  # registers of P packed in pairs
    # shared memory, in bytes from the aligned start: Q, K[2], V[2]
    KV_BYTES = BN * D * 2
    Q_OFF = 0
    K_OFF = BM * D * 2
    V_OFF = K_OFF + 2 * KV_BYTES
    V_LBO = BN * LINE  # MN-major: the next 64 columns of V (a block of BN lines)
    CAUSAL = bool(var.causal)
    BF16 = var.dtype == "bfloat16"
    OVERLAP = t.overlap  # the softmax of tile j under the P V wgmmas of tile j - 1
    PACKED = PACKING[var.packed]  # dense or varlen rows (device/seams.sequence)
    POLY = t.poly  # every POLY-th n-tile's exp2 on the FMA pipe (0: none)
    LEFT, RIGHT, WINDOW, CAP, CAP_C, ALIBI, LINEAR, FOLD = mask_flags(var, SMOD)

    def attn_forward_wgmma(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                           qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                           vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale, slopes, ssb, ssh,
                           m0, m1, m2, m3, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                           e12, e13, e14, e15, cls, csb, csh, csq, cu_q, cu_k, seqk, table,
                           tsb, page, psp, TQ, chunk, oss, lss, nseq):
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
        q_row0, Nq, Nk, causal_offset, qbase, kbase, vbase = sequence_bases(
            b, h, hk, Nq, Nk, causal_offset, cu_q, cu_k, seqk, qsb, qsh, qsn, ksb, ksh, ksn,
            vsb, vsh, vsn, PACKED)
        if PACKED != DENSE and q0 >= Nq:  # (compile-time test first) past the sequence
            return
        sl2, capr, rcapr, slope, unit, sc = score_constants(scale, slopes, b, h, ssb, ssh,
                                                            CAP_C, ALIBI, FOLD)
        margs = VIEWS(m0, m1, m2, m3, (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11,
                                       e12, e13, e14, e15))
        cbase = b * csb + h * csh  # (MMOD) this head's tile classes

        # the tiles start on a 1024-byte boundary of the shared state space
        raw = int64(smem_address(smem, 0))
        pad = (HOPPER_ALIGN - (raw & (HOPPER_ALIGN - 1))) & (HOPPER_ALIGN - 1)
        at = raw + pad  # shared address of the aligned start (descriptors)
        el = pad >> 1  # its element index (copies)

        n_begin, n_end, n_lo, n_full = visited_keys(q0, BM, BN, Nq, Nk, causal_offset, CAUSAL,
                                                    LEFT, RIGHT, WINDOW, MMOD, cls, cbase, csq)
        n_tiles = (n_end + BN - 1) // BN  # (n_begin is 0 here: plain variants keep this)
        if WINDOW or MMOD:  # (compile-time)
            n_tiles = (n_end - n_begin + BN - 1) // BN if n_end > n_begin else 0

        qa = at + Q_OFF + 64 * wg * LINE  # this warpgroup's 64 rows of Q
        s = cuda.local.array(NS, float32)
        oa = cuda.local.array(NO, float32)
        pf = cuda.local.array(NP, uint32)  # P, packed: 4 per k-step of P V
        acc = zero_accumulators(D)
        # running max (raw scores) and this thread's running sum of its two rows
        ma = mb = NEG_INF
        la = lb = float32(0.0)
        w0 = q0 + 64 * wg + 16 * warp  # this warp's 16 rows
        i = w0 + g  # this thread's rows: i, i + 8

        if not OVERLAP:
            # groups in flight, oldest first: {Q, K0}, {V0}
            load_tile(smem, el + Q_OFF // 2, q, qbase, q0, Nq, qsn, BM, CH, tid, NT)
            if n_tiles > 0:
                load_tile(smem, el + K_OFF // 2, k, kbase, n_begin, Nk, ksn, BN, CH, tid,
                          NT)
            cp_async_commit()
            if n_tiles > 0:
                load_tile(smem, el + V_OFF // 2, v, vbase, n_begin, Nk, vsn, BN, CH, tid,
                          NT)
            cp_async_commit()
            for it in range(n_tiles):
                n0 = n_begin + it * BN
                buf = (it & 1) * KV_BYTES
                cp_async_wait(1)  # Q and K[it] (V[it] may still be in flight)
                publish()
                # Every warpgroup has waited for its wgmmas of tile it-1: its buffers take
                # tile it+1.
                nb = (1 - (it & 1)) * KV_BYTES
                if it + 1 < n_tiles:
                    load_tile(smem, el + (K_OFF + nb) // 2, k, kbase, n0 + BN, Nk, ksn, BN,
                              CH, tid, NT)
                cp_async_commit()
                if it + 1 < n_tiles:
                    load_tile(smem, el + (V_OFF + nb) // 2, v, vbase, n0 + BN, Nk, vsn, BN,
                              CH, tid, NT)
                cp_async_commit()

                # the tile's class under a mask_mod: an empty tile is skipped (its copies
                # were issued above; the next tile's wait covers them, and its barrier the
                # reuse of this tile's buffers), a full one takes no mask_mod
                partial = MMOD
                if MMOD:  # (compile-time)
                    cl = tile_class(cls, cbase, csq, q0, BM, Nq, n0, BN, Nk)
                    if cl == EMPTY:
                        continue
                    partial = cl == PARTIAL
                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                at + K_OFF + buf, KSTEPS, BM, BN)
                sacc = wgmma_wait_group_acc(0, sacc)
                acc_to_local(sacc, s)
                ma, mb, la, lb, al0, al1 = softmax_tile_mods(
                    s, n0, BN, n_full, n_lo, partial, i, w0, Nq, Nk, causal_offset, b, h, tq,
                    ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc, margs, CAUSAL, LEFT,
                    RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE, NTILES, POLY)
                acc_to_local(acc, oa)
                rescale(oa, al0, al1, DTILES)
                acc = acc_from_local(oa, D)
                # P's A fragments, all before the fence: a register written between two
                # wgmmas makes ptxas serialize them (it injects warpgroup.arrive, C7519)
                pack_p(BF16, pf, s, NP)

                cp_async_wait(2)  # V[it] (K and V of it+1 may still be in flight)
                publish()
                acc = issue_pv(BF16, wgmma_fence_acc(acc), pf, at + V_OFF + buf, PSTEPS,
                               V_LBO)
                acc = wgmma_wait_group_acc(0, acc)
        else:
            # FlashAttention 3's intra-warpgroup overlap: step it issues S_it = Q K_itᵀ and
            # O += P_{it-1} V_{it-1} back to back, then runs the softmax of S_it while the
            # P V wgmmas run, and rescales O once they are done. One barrier per step: the
            # copies of step it (K_{it+1}, V_it, issued after it) land in the buffers that
            # step it-1's wgmmas read, which every warpgroup waited for before it.
            load_tile(smem, el + Q_OFF // 2, q, qbase, q0, Nq, qsn, BM, CH, tid, NT)
            if n_tiles > 0:
                load_tile(smem, el + K_OFF // 2, k, kbase, n_begin, Nk, ksn, BN, CH, tid,
                          NT)
            cp_async_commit()  # {Q, K0}
            if n_tiles > 1:
                load_tile(smem, el + (K_OFF + KV_BYTES) // 2, k, kbase, n_begin + BN, Nk,
                          ksn, BN, CH, tid, NT)
            if n_tiles > 0:
                load_tile(smem, el + V_OFF // 2, v, vbase, n_begin, Nk, vsn, BN, CH, tid,
                          NT)
            cp_async_commit()  # {K1, V0}
            cp_async_wait(1)
            publish()
            if n_tiles > 0:
                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                at + K_OFF, KSTEPS, BM, BN)
                sacc = wgmma_wait_group_acc(0, sacc)
                acc_to_local(sacc, s)
                ma, mb, la, lb, al0, al1 = classed_softmax(
                    MMOD, cls, cbase, csq, q0, BM, s, n_begin, BN, n_full, n_lo, i, w0, Nq,
                    Nk, causal_offset, b, h, tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit,
                    sc, margs, CAUSAL, LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS,
                    VALUE, NTILES, POLY)
                pack_p(BF16, pf, s, NP)  # (O is still zero: nothing to rescale)
            for it in range(1, n_tiles):
                n0 = n_begin + it * BN
                cp_async_wait(0)  # {K_it, V_it-1}
                publish()
                if it + 1 < n_tiles:
                    load_tile(smem, el + (K_OFF + ((it + 1) & 1) * KV_BYTES) // 2, k, kbase,
                              n0 + BN, Nk, ksn, BN, CH, tid, NT)
                load_tile(smem, el + (V_OFF + (it & 1) * KV_BYTES) // 2, v, vbase, n0, Nk,
                          vsn, BN, CH, tid, NT)
                cp_async_commit()  # {K_it+1, V_it}

                sacc = issue_qk(BF16, wgmma_fence_acc(zero_accumulators(BN)), qa,
                                at + K_OFF + (it & 1) * KV_BYTES, KSTEPS, BM, BN)
                acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                               at + V_OFF + ((it - 1) & 1) * KV_BYTES, PSTEPS, V_LBO)
                sacc = wgmma_wait_group_acc(1, sacc)  # S_it (P V may still run)
                acc_to_local(sacc, s)
                ma, mb, la, lb, al0, al1 = classed_softmax(
                    MMOD, cls, cbase, csq, q0, BM, s, n0, BN, n_full, n_lo, i, w0, Nq, Nk,
                    causal_offset, b, h, tq, ma, mb, la, lb, sl2, capr, rcapr, slope, unit, sc,
                    margs, CAUSAL, LEFT, RIGHT, WINDOW, CAP, ALIBI, LINEAR, SMOD, KEEPS, VALUE,
                    NTILES, POLY)
                acc = wgmma_wait_group_acc(0, acc)  # (pf is free again, O final for it-1)
                acc_to_local(acc, oa)
                rescale(oa, al0, al1, DTILES)
                acc = acc_from_local(oa, D)
                pack_p(BF16, pf, s, NP)
            if n_tiles > 0:
                cp_async_wait(0)  # V_last
                publish()
                acc = issue_pv(BF16, wgmma_fence_acc(acc), pf,
                               at + V_OFF + ((n_tiles - 1) & 1) * KV_BYTES, PSTEPS, V_LBO)
                acc = wgmma_wait_group_acc(0, acc)
        cp_async_wait(0)
        if n_tiles == 0:  # (uniform) other warpgroups' threads copied some of this one's Q
            cuda.syncthreads()  # lines: all landed before they take O (hopper/epilogue.py)

        acc_to_local(acc, oa)
        obase = b * osb + h * osh + q_row0 * osn
        lrow, _ = stat_rows(b, h, Hq, Nq, q_row0, TQ, PACKED)
        inv0 = finish_row(lse, lrow, i, Nq, ma, sl2, la, tq)
        inv1 = finish_row(lse, lrow, i + 8, Nq, mb, sl2, lb, tq)
        store_o(BF16, smem, el + Q_OFF // 2, o, obase, q0 + 64 * wg, i, Nq, osn, osd, oa,
                inv0, inv1, D, BM, wg, warp, g, tq, tid & 127)

    attn_forward_wgmma.__qualname__ = var.tag
    return attn_forward_wgmma
