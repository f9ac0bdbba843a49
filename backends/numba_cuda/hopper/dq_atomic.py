"""The steps that fold dQ into the wgmma dK/dV kernel (``kernel`` "dkdvq", the backward's
non-deterministic mode): per query step, after ``dSᵀ`` (keys as rows, this warpgroup's
64 keys) is computed for ``dK += dSᵀ Q``,

- :func:`store_ds`: ``dSᵀ``, rounded to the input dtype, into a shared tile of the step's
  queries as rows and the warpgroup's keys as columns (K-major, the 128-byte swizzle of
  ``forward.load_tile``'s tiles), so that it is the Bᵀ operand of the next product;
- :func:`issue_dqt`: ``dQᵀ = Kᵀ dSᵀ`` (``D / 64`` wgmma chains of m64nBNk16 over the 64
  keys, A = Kᵀ read MN-major, ``trans_a``, straight from the resident K tile);
- :func:`stage_dq`: this thread's part of ``dQᵀ`` stored transposed, as dQ's rows, into
  one of two staging buffers per warpgroup, each row rotated by 4 floats per row (head
  dim ``d`` of row ``i`` at ``(d + 4 i) mod D``: the 32 lanes of a store hit 32 banks, and
  the buffer stays one contiguous block); :func:`reduce_dq`: one thread adds the block's
  rows into a float32 accumulator in global memory, rotated the same way, with one bulk
  asynchronous reduction (``device/pipeline.py``: the copy engine adds, the thread goes on),
  and a last kernel un-rotates, scales and converts it to dQ (``simt/dq_convert.py``). A
  buffer is written again two steps later, once its reduction has read it
  (``bulk_wait_read``).

The adds of different key blocks into one element land in any order, so dQ may differ in
its last bits from run to run (dK and dV do not: each is summed by one thread in a fixed
order). What it saves is the dQ kernel's recomputation of ``S`` and ``dP``: 5 matrix
products per step pair instead of 7. On an H100 it is still 1.08-1.29x slower than the
two-kernel backward (each step waits for its dQ and two more barriers;
notes/fused_backward_2026-11-26.md), which is why it is off by default.
"""
from __future__ import annotations

from numba import float32, uint16, uint64

from ..device.convert import device_function
from ..device.pipeline import bulk_commit, bulk_reduce_add_f32, st_shared_f32
from ..device.stmatrix import stmatrix_x4_trans
from ..device.wgmma import (
    SWIZZLE_128B,
    smem_descriptor,
    wgmma_commit_group,
    wgmma_ss_bf16,
    wgmma_ss_f16,
)
from ..tensor_core.fragments import pack
from .forward import LINE, PATTERN, k_start


@device_function
def store_ds(smem, e0, dp, BF16, warp, g, tq, NTILES):
    """``dSᵀ`` (``dp``, fp32 in wgmma's accumulator order: ``dp[4 jn + 2 r + e]`` is key
    ``16 warp + g + 8 r`` of the warpgroup, query ``8 jn + 2 tq + e`` of the step) rounded
    and stored at element (query, key) of the ``8 NTILES``-row tile at element ``e0``: line
    = query, 16-byte chunk ``key // 8`` swizzled by the line (``chunk ^ (line % 8)``)."""
    for jn in range(NTILES):
        for e in range(2):
            row = 8 * jn + 2 * tq + e
            for r in range(2):
                chunk = (2 * warp + r) ^ (row & 7)
                bits = pack(BF16, dp[4 * jn + 2 * r + e], float32(0.0))
                smem[e0 + row * 64 + chunk * 8 + g] = uint16(bits & 0xFFFF)


@device_function
def store_ds_packed(smem, e0, dsf, warp, lane, NTILES):
    """:func:`store_ds` from ``dSᵀ`` already packed as the A fragments of ``dK += dSᵀ Q``
    (``forward.pack_p``: register ``4 kk + r`` holds keys ``16 warp + g + 8 (r & 1)``,
    queries ``8 (2 kk + (r >> 1)) + 2 tq``, ``+ 1``: one 8x8 matrix each), by one
    ``stmatrix...x4.trans`` per k-step: lane ``l`` gives the address of row ``l & 7``
    (a query) of matrix ``l >> 3``, whose 8 keys are one swizzled 16-byte chunk."""
    m = lane >> 3
    i = lane & 7
    chunk = ((2 * warp + (m & 1)) ^ i) * 8
    for kk in range(NTILES // 2):
        row = 8 * (2 * kk + (m >> 1)) + i
        stmatrix_x4_trans(smem, e0 + row * 64 + chunk, dsf[4 * kk], dsf[4 * kk + 1],
                          dsf[4 * kk + 2], dsf[4 * kk + 3])


@device_function
def dqt_step(BF16, acc, da, db, scale_d):
    """One k-step of ``dQᵀ = Kᵀ dSᵀ``: A (Kᵀ) M-major, Bᵀ (the dS tile) K-major."""
    if BF16:
        return wgmma_ss_bf16(acc, da, db, scale_d, 1, 0)
    return wgmma_ss_f16(acc, da, db, scale_d, 1, 0)


@device_function
def issue_dqt(BF16, acc0, acc1, ka, dsa, BM, BN, HALVES, KSTEPS):
    """Issue ``dQᵀ = Kᵀ dSᵀ`` as one commit group: ``HALVES`` (``D / 64``: 1 or 2) chains of
    ``KSTEPS`` k-steps (16 keys each: 4, the warpgroup's 64 keys; 8, the block's 128 keys of
    two warpgroups), rows ``64 h ..`` of dQᵀ (head dims) into ``acc0`` and ``acc1`` (as many
    query columns as they hold). ``ka``: shared address of the first key row in the K tile
    (``BM`` lines per 64-column block, MN-major as A); ``dsa``: the dS tile's first query
    line (blocks of ``BN`` lines, 64 keys each, one per warpgroup). ``acc1`` is returned as
    it came when ``HALVES`` is 1."""
    db0 = smem_descriptor(dsa, 16, PATTERN, SWIZZLE_128B)
    da0 = smem_descriptor(ka, BM * LINE, PATTERN, SWIZZLE_128B)
    for kk in range(KSTEPS):
        # 16 keys down in K (16 lines: LINE in the descriptor's 16-byte units); 16 columns
        # along the dS tile's lines (its next block of BN lines from key 64 on)
        db = db0 + uint64(k_start(kk, BN) >> 4)
        acc0 = dqt_step(BF16, acc0, da0 + uint64(kk * LINE), db, kk)
    if HALVES == 2:
        da1 = da0 + uint64(BM * LINE >> 4)  # the next 64 head dims: the next block of K
        for kk in range(KSTEPS):
            db = db0 + uint64(k_start(kk, BN) >> 4)
            acc1 = dqt_step(BF16, acc1, da1 + uint64(kk * LINE), db, kk)
    wgmma_commit_group()
    return acc0, acc1


@device_function
def stage_dq(smem, e0, acc, half, D, warp, g, tq, NTILES, i0):
    """This thread's elements of rows ``64 half ..`` of ``dQᵀ`` (``acc``, a local array in
    accumulator order: register ``4 jn + 2 r + e`` is head dim ``64 half + 16 warp + g + 8
    r``, query ``8 jn + 2 tq + e`` of the ``8 NTILES`` the buffer holds) stored at float
    ``query D + (dim + 4 (i0 + query)) mod D`` of the staging buffer at 16-bit element
    ``e0`` (``D`` a power of two; ``i0``: the buffer's first query in the step, so that
    the rotation follows the query's row in the accumulator)."""
    for jn in range(NTILES):
        for e in range(2):
            i = 8 * jn + 2 * tq + e
            for r in range(2):
                d = (64 * half + 16 * warp + g + 8 * r + 4 * (i0 + i)) & (D - 1)
                st_shared_f32(smem, e0 + 2 * (i * D + d), acc[4 * jn + 2 * r + e])


@device_function
def reduce_dq(smem, e0, dqa, abase, D, nrows, BN):
    """The staged rows below ``nrows`` (at most ``BN``; none if it is not positive) added
    into ``dqa[abase:]`` by one bulk reduction (one group, empty then): by one thread."""
    if nrows > 0:
        bulk_reduce_add_f32(dqa, abase, smem, e0, 4 * D * min(nrows, BN))
    bulk_commit()
