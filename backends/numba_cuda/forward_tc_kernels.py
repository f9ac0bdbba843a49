"""Tensor-core forward kernel for fp16/bf16: ``attn_forward_tc``, FlashAttention-2 partition.

One thread block per (query tile, batch * query head); the block's ``warps`` warps own 16
query rows each (no inter-warp reduction). Per key tile of ``block_n`` keys:

- ``S = Q Kᵀ`` with mma m16n8k16 (fp32 accumulators). Q's A fragments are loaded once with
  ldmatrix and stay in registers; K rows give B fragments through plain ldmatrix.
- Online softmax in fp32 on the accumulator fragments: scores scaled by
  ``scale * log2(e)`` (exp2), row maxima over the 4 lanes sharing a row by two xor
  shuffles, running max ``m`` and sum ``l`` per row (each lane owns rows ``g`` and ``g+8``).
- ``O += P V``: the fp32 P fragments, rounded to the input dtype and packed in pairs, are
  exactly the A fragments of the next MMA (the C layout of two adjacent n-tiles is the A
  layout of one k-step), so P never leaves registers; V rows give B fragments through
  ``ldmatrix.trans``.

K and V tiles are double-buffered in shared memory and filled with 16-byte ``cp.async``
copies one tile ahead (separate commit groups for K and V, so the ``S`` product waits only
for K). Rows are padded by 8 elements (16 bytes): a row stride of an odd number of 16-byte
units puts the 8 rows of each ldmatrix on distinct banks.

Needs sm_80+, head dim a multiple of 16 (32, 64, 96 and 128 are routed here), unit stride along the
head dim and 16-byte aligned rows; launch arguments are those of ``attn_forward``, so the
host side (launch.signature, the argument packing of launch.run_forward) is shared.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint16, uint32

from .convert import SIMULATOR, smem_pointer
from .mma import cp_async_commit, cp_async_wait, ldmatrix_x4, shfl_xor_f32
from .tile_product_tc import PAD, load_rows, mma, mma_frags_rows, store_frags

SMEM_ALIGN = None if SIMULATOR else 16
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = np.float32(-np.inf)


_CACHE: dict = {}


def make_attn_forward_tc(head_dim: int, t, causal: bool, dtype: str):
    """The kernel for one head dim, tiling (tile_product_tc.TCTiles), causality and input
    dtype (fp16 or bf16)."""
    key = (head_dim, t, causal, dtype)
    if key in _CACHE:
        return _CACHE[key]
    if head_dim % 16:
        raise ValueError(f"{head_dim=} must be a multiple of 16 for the tensor-core kernel")
    D = head_dim
    NW, BN = t.warps, t.block_n
    BM, NT = t.block_m, t.threads
    LDS = D + PAD
    CH = D // 8  # 16-byte chunks per row
    KSTEPS = D // 16  # k-steps of Q Kᵀ
    NTILES = BN // 8  # 8-key n-tiles of S
    PSTEPS = BN // 16  # k-steps of P V
    DTILES = D // 8  # 8-column n-tiles of O
    NQF, NACC, NS = 4 * KSTEPS, 4 * DTILES, 4 * NTILES  # register fragments per lane
    Q_OFF = 0
    K_OFF = BM * LDS
    V_OFF = K_OFF + 2 * BN * LDS
    BUF = BN * LDS
    CAUSAL = bool(causal)
    BF16 = dtype == "bfloat16"

    def attn_forward_tc(q, k, v, o, lse, Nq, Nk, Hq, group, causal_offset,
                        qsb, qsh, qsn, qsd, ksb, ksh, ksn, ksd,
                        vsb, vsh, vsn, vsd, osb, osh, osn, osd, scale):
        smem = smem_pointer(cuda.shared.array(0, uint16, alignment=SMEM_ALIGN))
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3
        n_qtiles = cuda.gridDim.x
        qt = n_qtiles - 1 - cuda.blockIdx.x if CAUSAL else cuda.blockIdx.x
        bh = cuda.blockIdx.y
        b = bh // Hq
        h = bh - b * Hq
        hk = h // group
        q0 = qt * BM
        qbase = b * qsb + h * qsh
        kbase = b * ksb + hk * ksh
        vbase = b * vsb + hk * vsh
        sl2 = float32(scale * LOG2E)

        n_end = Nk
        n_full = Nk
        if CAUSAL:
            n_end = max(0, min(Nk, q0 + BM + causal_offset))
            n_full = min(Nk, q0 + 1 + causal_offset)
        n_tiles = (n_end + BN - 1) // BN

        # groups in flight, oldest first: {Q, K0}, {V0}
        load_rows(smem, Q_OFF, q, qbase, q0, Nq, qsn, BM, LDS, CH, tid, NT)
        if n_tiles > 0:
            load_rows(smem, K_OFF, k, kbase, 0, Nk, ksn, BN, LDS, CH, tid, NT)
        cp_async_commit()
        if n_tiles > 0:
            load_rows(smem, V_OFF, v, vbase, 0, Nk, vsn, BN, LDS, CH, tid, NT)
        cp_async_commit()
        cp_async_wait(1)
        cuda.syncthreads()

        qf = cuda.local.array(NQF, uint32)
        qrow = Q_OFF + (warp * 16 + (lane & 15)) * LDS + 8 * (lane >> 4)
        for kk in range(KSTEPS):
            r0, r1, r2, r3 = ldmatrix_x4(smem, qrow + 16 * kk)
            qf[4 * kk] = r0
            qf[4 * kk + 1] = r1
            qf[4 * kk + 2] = r2
            qf[4 * kk + 3] = r3

        acc = cuda.local.array(NACC, float32)
        for e in range(4 * DTILES):
            acc[e] = float32(0.0)
        s = cuda.local.array(NS, float32)
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = float32(0.0)
        l1 = float32(0.0)
        i0 = q0 + warp * 16 + g  # this lane's two rows
        i1 = i0 + 8
        # lane-dependent parts of the ldmatrix addresses
        krow = (lane & 7) + 8 * (lane >> 4)
        kcol = 8 * ((lane >> 3) & 1)

        for it in range(n_tiles):
            n0 = it * BN
            kb = K_OFF + (it & 1) * BUF
            vb = V_OFF + (it & 1) * BUF
            if it > 0:
                cp_async_wait(1)  # K[it] (V[it] may still be in flight)
                cuda.syncthreads()
            # Every warp is past tile it-1: its buffers take tile it+1.
            nb = (1 - (it & 1)) * BUF
            if it + 1 < n_tiles:
                load_rows(smem, K_OFF + nb, k, kbase, n0 + BN, Nk, ksn, BN, LDS, CH, tid, NT)
            cp_async_commit()
            if it + 1 < n_tiles:
                load_rows(smem, V_OFF + nb, v, vbase, n0 + BN, Nk, vsn, BN, LDS, CH, tid, NT)
            cp_async_commit()

            # S = Q Kᵀ
            for e in range(4 * NTILES):
                s[e] = float32(0.0)
            for kk in range(KSTEPS):
                a0 = qf[4 * kk]
                a1 = qf[4 * kk + 1]
                a2 = qf[4 * kk + 2]
                a3 = qf[4 * kk + 3]
                for jp in range(NTILES // 2):
                    r0, r1, r2, r3 = ldmatrix_x4(smem, kb + (16 * jp + krow) * LDS
                                                 + 16 * kk + kcol)
                    j = 8 * jp
                    s[j], s[j + 1], s[j + 2], s[j + 3] = mma(
                        BF16, a0, a1, a2, a3, r0, r1, s[j], s[j + 1], s[j + 2], s[j + 3])
                    s[j + 4], s[j + 5], s[j + 6], s[j + 7] = mma(
                        BF16, a0, a1, a2, a3, r2, r3, s[j + 4], s[j + 5], s[j + 6], s[j + 7])

            # online softmax, in the log2 domain
            for e in range(4 * NTILES):
                s[e] *= sl2
            if n0 + BN > n_full:  # a diagonal or tail tile: mask
                for jn in range(NTILES):
                    col = n0 + 8 * jn + 2 * tq
                    for e in range(2):
                        j = col + e
                        if j >= Nk or (CAUSAL and j > i0 + causal_offset):
                            s[4 * jn + e] = NEG_INF
                        if j >= Nk or (CAUSAL and j > i1 + causal_offset):
                            s[4 * jn + 2 + e] = NEG_INF
            mx0 = m0
            mx1 = m1
            for jn in range(NTILES):
                mx0 = max(mx0, max(s[4 * jn], s[4 * jn + 1]))
                mx1 = max(mx1, max(s[4 * jn + 2], s[4 * jn + 3]))
            mx0 = max(mx0, shfl_xor_f32(mx0, 1))
            mx0 = max(mx0, shfl_xor_f32(mx0, 2))
            mx1 = max(mx1, shfl_xor_f32(mx1, 1))
            mx1 = max(mx1, shfl_xor_f32(mx1, 2))
            # a row that has seen no key yet keeps m = -inf; subtract 0 instead
            mu0 = mx0 if mx0 != NEG_INF else float32(0.0)
            mu1 = mx1 if mx1 != NEG_INF else float32(0.0)
            al0 = math.exp2(m0 - mu0)
            al1 = math.exp2(m1 - mu1)
            m0 = mx0
            m1 = mx1
            ps0 = float32(0.0)
            ps1 = float32(0.0)
            for jn in range(NTILES):
                p = math.exp2(s[4 * jn] - mu0)
                s[4 * jn] = p
                ps0 += p
                p = math.exp2(s[4 * jn + 1] - mu0)
                s[4 * jn + 1] = p
                ps0 += p
                p = math.exp2(s[4 * jn + 2] - mu1)
                s[4 * jn + 2] = p
                ps1 += p
                p = math.exp2(s[4 * jn + 3] - mu1)
                s[4 * jn + 3] = p
                ps1 += p
            l0 = l0 * al0 + ps0
            l1 = l1 * al1 + ps1
            for dn in range(DTILES):
                acc[4 * dn] *= al0
                acc[4 * dn + 1] *= al0
                acc[4 * dn + 2] *= al1
                acc[4 * dn + 3] *= al1

            cp_async_wait(2)  # V[it] (K and V of it+1 may still be in flight)
            cuda.syncthreads()
            # O += P V, P straight from the S fragments
            mma_frags_rows(BF16, acc, s, smem, vb, LDS, PSTEPS, DTILES, lane)
        cp_async_wait(0)

        # each lane summed its own columns: add up the 4 lanes of a row
        l0 += shfl_xor_f32(l0, 1)
        l0 += shfl_xor_f32(l0, 2)
        l1 += shfl_xor_f32(l1, 1)
        l1 += shfl_xor_f32(l1, 2)
        obase = b * osb + h * osh
        inv0 = float32(1.0) / l0 if l0 > 0 else float32(0.0)
        inv1 = float32(1.0) / l1 if l1 > 0 else float32(0.0)
        store_frags(o, obase, i0, Nq, osn, osd, acc, inv0, inv1, DTILES, tq)
        if tq == 0:
            lrow = (b * Hq + h) * Nq
            if i0 < Nq:
                val = NEG_INF
                if l0 > 0:
                    val = (m0 + math.log2(l0)) * float32(LN2)
                lse[lrow + i0] = val
            if i1 < Nq:
                val = NEG_INF
                if l1 > 0:
                    val = (m1 + math.log2(l1)) * float32(LN2)
                lse[lrow + i1] = val

    tag = f"d{D}_w{NW}_n{BN}_{'causal' if CAUSAL else 'full'}_{dtype}"
    attn_forward_tc.__qualname__ = f"attn_forward_tc_{tag}"
    _CACHE[key] = attn_forward_tc
    return attn_forward_tc
