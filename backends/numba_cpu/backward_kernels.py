"""Backward pass in two parallel passes and no atomics, so it is deterministic.

``attn_backward_preprocess`` computes ``D_i = rowsum(dO_i * O_i)``. ``attn_backward_dkdv``
owns one key/value tile per job and loops over the query tiles (of every query head that
shares the key/value head) to accumulate dK and dV; ``attn_backward_dq`` owns one query tile
per job and loops over key/value tiles for dQ. Both recompute ``P = exp(S - lse)`` tile by
tile; neither writes where another job writes.
"""
import numpy as np
from numba import njit, prange

from .forward_kernels import load_padded, load_padded_t
from .products import product
from .scalar import LOG2E, load, store
from .seams import key_end, mask_scores, needs_mask, query_start
from .softmax import FASTMATH, dscores_tile, probabilities, probabilities_tile, zero_tail  # noqa: F401


@njit(parallel=True, cache=True)
def attn_backward_preprocess(do, o, delta, work_dtype):
    """delta[b, h, i] = sum_d do[b, h, i, d] * o[b, h, i, d] (in the compute dtype)."""
    B, H, N, D = o.shape
    zero = work_dtype(0.0)
    for bh in prange(B * H):
        b, h = bh // H, bh % H
        for i in range(N):
            acc = zero
            for d in range(D):
                acc += load(do[b, h, i, d]) * load(o[b, h, i, d])
            delta[b, h, i] = acc


@njit
def load_rows(src, b, h, r0, n, out):
    """out[:n] = src[b, h, r0:r0+n]: a tile's per-row statistic (delta)."""
    for r in range(n):
        out[r] = src[b, h, r0 + r]


@njit
def prepare_lse2(lse, b, h, i0, n, out):
    for r in range(n):
        x = lse[b, h, i0 + r]
        out[r] = np.inf if x == -np.inf else x * LOG2E


@njit(parallel=True, cache=True)
def attn_backward_dkdv(do, q, k, v, lse, delta, dk, dv, scale, causal, block_q, block_k, d_pad,
                       work_dtype):
    """dK and dV of one key/value tile per job, over the query tiles (of every query head
    sharing its key/value head) that see it; tiles ``d_pad`` wide and zero-padded."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    offset = Nk - Nq
    n_kt = (Nk + block_k - 1) // block_k
    one = work_dtype(1.0)
    q_mult = work_dtype(scale * LOG2E)
    for job in prange(B * Hkv * n_kt):
        b = job // (Hkv * n_kt)
        hk = (job // n_kt) % Hkv
        j0 = (job % n_kt) * block_k
        nk = min(block_k, Nk - j0)
        kt_t = np.empty((d_pad, block_k), work_dtype)
        vt_t = np.empty((d_pad, block_k), work_dtype)
        qt = np.empty((block_q, d_pad), work_dtype)
        dot = np.empty((block_q, d_pad), work_dtype)
        s = np.empty((block_q, block_k), work_dtype)
        dp = np.empty((block_q, block_k), work_dtype)
        lse2 = np.empty(block_q, work_dtype)
        dlt = np.empty(block_q, work_dtype)
        dk_acc = np.zeros((block_k, d_pad), work_dtype)
        dv_acc = np.zeros((block_k, d_pad), work_dtype)
        load_padded_t(k, b, hk, j0, nk, kt_t, one)
        load_padded_t(v, b, hk, j0, nk, vt_t, one)
        i_start = query_start(j0, block_q, offset, causal)
        for h in range(hk * group, (hk + 1) * group):
            for i0 in range(i_start, Nq, block_q):
                nq = min(block_q, Nq - i0)
                load_padded(q, b, h, i0, nq, qt, q_mult)
                load_padded(do, b, h, i0, nq, dot, one)
                prepare_lse2(lse, b, h, i0, nq, lse2)
                load_rows(delta, b, h, i0, nq, dlt)
                product(qt, 0, d_pad, 1, kt_t, s, block_q, block_k, d_pad, False)
                if needs_mask(i0, j0, nk, offset, causal):
                    mask_scores(s, nq, nk, i0, j0, offset)
                probabilities(s, nq, nk, lse2)
                # dV += P^T dO: the left operand is P read down its columns
                product(s, 0, 1, block_k, dot, dv_acc, block_k, d_pad, block_q, True)
                product(dot, 0, d_pad, 1, vt_t, dp, block_q, block_k, d_pad, False)  # dP
                dscores_tile(s, dp, nq, nk, dlt)
                zero_tail(dp, nq, nk)
                # dK += dS^T Q (qt carries scale * log2 e)
                product(dp, 0, 1, block_k, qt, dk_acc, block_k, d_pad, block_q, True)
        dk_mult = work_dtype(1.0 / LOG2E)
        for r in range(nk):
            for d in range(D):
                dk[b, hk, j0 + r, d] = store(dk_acc[r, d] * dk_mult, dk[0, 0, 0, 0])
                dv[b, hk, j0 + r, d] = store(dv_acc[r, d], dv[0, 0, 0, 0])


@njit(parallel=True, cache=True)
def attn_backward_dq(do, q, k, v, lse, delta, dq, scale, causal, block_q, block_k, d_pad,
                     work_dtype):
    """dQ of one query tile per job, over the key/value tiles it sees."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    offset = Nk - Nq
    n_qt = (Nq + block_q - 1) // block_q
    one = work_dtype(1.0)
    q_mult = work_dtype(scale * LOG2E)
    for job in prange(B * Hq * n_qt):
        b = job // (Hq * n_qt)
        h = (job // n_qt) % Hq
        hk = h // group
        i0 = (job % n_qt) * block_q
        nq = min(block_q, Nq - i0)
        qt = np.empty((block_q, d_pad), work_dtype)
        dot = np.empty((block_q, d_pad), work_dtype)
        kt = np.empty((block_k, d_pad), work_dtype)
        kt_t = np.empty((d_pad, block_k), work_dtype)
        vt_t = np.empty((d_pad, block_k), work_dtype)
        s = np.empty((block_q, block_k), work_dtype)
        dp = np.empty((block_q, block_k), work_dtype)
        lse2 = np.empty(block_q, work_dtype)
        dlt = np.empty(block_q, work_dtype)
        dq_acc = np.zeros((block_q, d_pad), work_dtype)
        load_padded(q, b, h, i0, nq, qt, q_mult)
        load_padded(do, b, h, i0, nq, dot, one)
        prepare_lse2(lse, b, h, i0, nq, lse2)
        load_rows(delta, b, h, i0, nq, dlt)
        k_end = key_end(i0, nq, Nk, offset, causal)
        for j0 in range(0, k_end, block_k):
            nk = min(block_k, k_end - j0)
            load_padded(k, b, hk, j0, nk, kt, one)
            load_padded_t(k, b, hk, j0, nk, kt_t, one)
            load_padded_t(v, b, hk, j0, nk, vt_t, one)
            product(qt, 0, d_pad, 1, kt_t, s, block_q, block_k, d_pad, False)
            if needs_mask(i0, j0, nk, offset, causal):
                mask_scores(s, nq, nk, i0, j0, offset)
            probabilities(s, nq, nk, lse2)
            product(dot, 0, d_pad, 1, vt_t, dp, block_q, block_k, d_pad, False)  # dP
            dscores_tile(s, dp, nq, nk, dlt)
            zero_tail(dp, nq, nk)
            product(dp, 0, block_k, 1, kt, dq_acc, block_q, d_pad, block_k, True)  # dQ += dS K
        dq_mult = work_dtype(scale)
        for r in range(nq):
            for d in range(D):
                dq[b, h, i0 + r, d] = store(dq_acc[r, d] * dq_mult, dq[0, 0, 0, 0])


def attn_backward(do, q, k, v, o, lse, dq, dk, dv, scale, causal, block_q, block_k, d_pad,
                  work_dtype):
    """Host driver: preprocess, then the dK/dV pass and the dQ pass (all bhnd views)."""
    B, Hq, Nq, _ = q.shape
    delta = np.empty((B, Hq, Nq), work_dtype)
    if q.size:
        attn_backward_preprocess(do, o, delta, work_dtype)
    if dk.size:
        attn_backward_dkdv(do, q, k, v, lse, delta, dk, dv, scale, causal, block_q, block_k,
                           d_pad, work_dtype)
    if dq.size:
        attn_backward_dq(do, q, k, v, lse, delta, dq, scale, causal, block_q, block_k, d_pad,
                         work_dtype)
