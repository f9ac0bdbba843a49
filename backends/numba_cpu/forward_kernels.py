"""Forward pass: tiles of Q against tiles of K and V with the online softmax.

``attn_forward`` runs one job per (batch, query head, query tile) in parallel; each job
streams the key/value tiles its rows can see, keeps the running row max ``m_i``, row sum
``l_i`` and output accumulator ``acc`` in its own tiles, and normalizes once at the end.
Memory beyond the inputs and outputs is a few tiles per thread, never ``Nq x Nk``.
"""
import math

import numpy as np
from numba import njit, prange

from .products import product, product_into
from .scalar import LOG2E, load, store
from .seams import key_end, mask_scores_t, needs_mask, visits
from .softmax import FASTMATH, online_softmax_t, online_softmax_tile  # noqa: F401 (decode_kernels)


@njit
def load_tile(src, b, h, r0, n, out, mult):
    """out[:n, :D] = src[b, h, r0:r0+n, :] converted to the compute dtype and multiplied
    (out may be wider than D: its other columns are left as they are)."""
    for r in range(n):
        for d in range(src.shape[3]):
            out[r, d] = load(src[b, h, r0 + r, d]) * mult


@njit
def load_tile_t(src, b, h, r0, n, out, mult):
    """out[:, :n] = src[b, h, r0:r0+n, :].T, converted: a tile that is the right operand of
    a product with its transpose is stored transposed, since BLAS runs A @ B about 1.4x
    faster than A @ B.T at these sizes (notes/numba_cpu.md)."""
    for r in range(n):
        for d in range(src.shape[3]):
            out[d, r] = load(src[b, h, r0 + r, d]) * mult


@njit
def load_padded(src, b, h, r0, n, out, mult):
    """out[:n, :D] = src[b, h, r0:r0+n, :] converted and multiplied; the rest of out (rows
    from n, columns from D) zero, so whole-tile products see no stale values."""
    D = src.shape[3]
    zero = out.dtype.type(0.0)
    for r in range(n):
        for d in range(D):
            out[r, d] = load(src[b, h, r0 + r, d]) * mult
        for d in range(D, out.shape[1]):
            out[r, d] = zero
    for r in range(n, out.shape[0]):
        for d in range(out.shape[1]):
            out[r, d] = zero


@njit
def load_padded_t(src, b, h, r0, n, out, mult):
    """out[:D, :n] = src[b, h, r0:r0+n, :].T converted and multiplied; the rest zero."""
    D = src.shape[3]
    zero = out.dtype.type(0.0)
    out[:, n:] = zero
    out[D:, :] = zero
    for r in range(n):
        for d in range(D):
            out[d, r] = load(src[b, h, r0 + r, d]) * mult


@njit(parallel=True, cache=True)
def attn_forward(q, k, v, o, lse, scale, causal, block_q, block_k, q_tiles_per_job, d_pad,
                 work_dtype):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), any strides; writes o (like q) and lse
    (B, Hq, Nq) (float64 for float64 inputs, else float32). float16/bfloat16 arrive as
    int16/uint16 bits (see scalar.py).

    A job owns ``q_tiles_per_job`` query tiles of one (batch, head): each key/value tile it
    loads once serves all of them. A head's jobs run in zigzag order (row chunks 0, n-1, 1,
    n-2, ...): prange hands each thread a contiguous run of jobs, and under a causal mask a
    chunk's work grows with its rows, so in sequence order the threads holding a head's
    last chunks took 1.5x the average (a 16-core host: causal 1.34x slower than non-causal
    per FLOP at N=16384). Tiles are ``d_pad`` wide (D rounded up to the products' vector
    block, zero-padded); both products (products.py) run on whole tiles.

    Scores are computed transposed, S^T = K @ Q^T (keys down, queries across): the job's
    query tiles are transposed once, key tiles are used as stored, and the online softmax
    runs down the columns, a vector of query rows at a time (softmax.online_softmax_t);
    P @ V reads P through S^T's strides.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    offset = Nk - Nq
    rows_per_job = block_q * q_tiles_per_job
    n_jobs = (Nq + rows_per_job - 1) // rows_per_job
    q_mult = work_dtype.type(scale * LOG2E)  # scores in log2 units: exp2 instead of exp
    one = work_dtype.type(1.0)
    for job in prange(B * Hq * n_jobs):
        b = job // (Hq * n_jobs)
        h = (job // n_jobs) % Hq
        hk = h // group
        c = job % n_jobs
        row0 = (c // 2 if c % 2 == 0 else n_jobs - 1 - c // 2) * rows_per_job
        rows = min(rows_per_job, Nq - row0)
        qt_t = np.empty((q_tiles_per_job, d_pad, block_q), work_dtype)
        kt = np.empty((block_k, d_pad), work_dtype)
        vt = np.empty((block_k, d_pad), work_dtype)
        st = np.empty((block_k, block_q), work_dtype)
        alpha = np.empty(block_q, work_dtype)
        acc = np.zeros((rows_per_job, d_pad), work_dtype)
        m_i = np.full(rows_per_job, -np.inf, work_dtype)
        l_i = np.zeros(rows_per_job, work_dtype)
        for t0 in range(0, rows, block_q):
            load_padded_t(q, b, h, row0 + t0, min(block_q, rows - t0), qt_t[t0 // block_q],
                          q_mult)
        k_end = key_end(row0, rows, Nk, offset, causal)
        for j0 in range(0, k_end, block_k):
            nk = min(block_k, k_end - j0)
            load_padded(k, b, hk, j0, nk, kt, one)
            load_padded(v, b, hk, j0, nk, vt, one)
            for t0 in range(0, rows, block_q):
                i0 = row0 + t0
                nq = min(block_q, rows - t0)
                if not visits(i0, nq, j0, offset, causal):
                    continue
                product(kt, 0, d_pad, 1, qt_t[t0 // block_q], st, block_k, block_q, d_pad,
                        False)
                if needs_mask(i0, j0, nk, offset, causal):
                    mask_scores_t(st, nk, nq, i0, j0, offset)
                online_softmax_t(st, nk, m_i, l_i, acc, t0, alpha)
                product_into(st, 0, 1, block_q, vt, acc, t0, block_q, d_pad, block_k)
        for r in range(rows):
            empty = l_i[r] == 0.0
            inv = 0.0 if empty else 1.0 / l_i[r]
            for d in range(D):
                o[b, h, row0 + r, d] = store(acc[r, d] * inv, o[0, 0, 0, 0])
            lse[b, h, row0 + r] = -np.inf if empty else (m_i[r] + math.log2(l_i[r])) / LOG2E
