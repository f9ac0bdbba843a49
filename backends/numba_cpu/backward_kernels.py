"""Backward pass with no atomics, so it is deterministic.

``attn_backward_preprocess`` computes ``D_i = rowsum(dO_i * O_i)``. ``attn_backward_kv``
owns key/value tiles and loops over the query tiles (of every query head that shares the
key/value head) that see them; it recomputes ``P = exp(S - lse)`` once per tile pair and
makes dK, dV and a part of dQ from it (five tile products per pair, where separate dK/dV
and dQ passes need seven). ``attn_backward_dq_sum`` adds the dQ parts in a fixed order.
The parts are bounded: where a part per split for every query
row would take more than :data:`PARTS_BYTES` or twice dQ's size, the query rows are taken
in phases (:func:`phase_bounds`), each a pass of the same jobs over its rows, dK and dV
carried between phases in the compute dtype; every sum runs in the same order, so the
results do not depend on the phase count. The masked kernels (masked_kernels.py) take the same form.
"""
import numpy as np
from numba import njit, prange

from .forward_kernels import load_padded, load_padded_t
from .products import product, product_into
from .scalar import LOG2E, load, store
from .seams import mask_scores, needs_mask, query_start
from .softmax import FASTMATH, dscores_tile, probabilities, probabilities_tile, zero_tail  # noqa: F401


@njit(parallel=True, cache=True)
def attn_backward_preprocess(do, o, delta, work_dtype):
    """delta[b, h, i] = sum_d do[b, h, i, d] * o[b, h, i, d] (in the compute dtype)."""
    B, H, N, D = o.shape
    zero = work_dtype.type(0.0)
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
def attn_backward_kv(do, q, k, v, lse, delta, dk, dv, dq_part, scale, causal, block_q,
                     block_k, d_pad, work_dtype, q_lo, q_hi, dkv_acc, first, last):
    """dK and dV, and dQ in parts: a job owns (batch, key/value head, split) and the key
    tiles ``split, split + splits, ...`` (interleaved, so causal work stays balanced). For
    each it visits the query tiles (of every query head sharing the key/value head) that
    see it and computes S, P, dP and dS once for all three gradients (five tile products).
    dK and dV of a key tile are its own; dQ goes into the job's part ``dq_part[split, b,
    h]`` (query rows x d_pad, the compute dtype, scaled by log2 e), and the parts are
    summed in a fixed order afterwards: no atomics, and no dependence on thread timing.
    One phase (:func:`attn_backward`): the query rows ``q_lo:q_hi`` (part row ``i -
    q_lo``); dK and dV start from zero (``first``) or from ``dkv_acc`` and end in dk, dv
    (``last``) or in ``dkv_acc``."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    splits = dq_part.shape[0]
    group = Hq // Hkv
    offset = Nk - Nq
    n_kt = (Nk + block_k - 1) // block_k
    one = work_dtype.type(1.0)
    q_mult = work_dtype.type(scale * LOG2E)
    for job in prange(B * Hkv * splits):
        b = job // (Hkv * splits)
        hk = (job // splits) % Hkv
        split = job % splits
        kt = np.empty((block_k, d_pad), work_dtype)
        kt_t = np.empty((d_pad, block_k), work_dtype)
        vt_t = np.empty((d_pad, block_k), work_dtype)
        qt = np.empty((block_q, d_pad), work_dtype)
        dot = np.empty((block_q, d_pad), work_dtype)
        s = np.empty((block_q, block_k), work_dtype)
        dp = np.empty((block_q, block_k), work_dtype)
        lse2 = np.empty(block_q, work_dtype)
        dlt = np.empty(block_q, work_dtype)
        dk_acc = np.empty((block_k, d_pad), work_dtype)
        dv_acc = np.empty((block_k, d_pad), work_dtype)
        for kt_i in range(split, n_kt, splits):
            j0 = kt_i * block_k
            nk = min(block_k, Nk - j0)
            if first:
                dk_acc[:] = 0.0
                dv_acc[:] = 0.0
            else:
                dk_acc[:] = dkv_acc[0, b, hk, j0:j0 + block_k]
                dv_acc[:] = dkv_acc[1, b, hk, j0:j0 + block_k]
            i_start = max(query_start(j0, block_q, offset, causal), q_lo)
            if i_start < q_hi:
                load_padded(k, b, hk, j0, nk, kt, one)
                load_padded_t(k, b, hk, j0, nk, kt_t, one)
                load_padded_t(v, b, hk, j0, nk, vt_t, one)
            # (query tiles outer, heads inner: phases then split the same sequence of
            # additions into dK and dV as one pass makes)
            for i0 in range(i_start, q_hi, block_q):
                nq = min(block_q, Nq - i0)
                for h in range(hk * group, (hk + 1) * group):
                    dq_h = dq_part[split, b, h]
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
                    # dQ += dS K, rows past nq land in the part's padding rows
                    product_into(dp, 0, block_k, 1, kt, dq_h, i0 - q_lo, block_q, d_pad,
                                 block_k)
            if last:
                dk_mult = work_dtype.type(1.0 / LOG2E)
                for r in range(nk):
                    for d in range(D):
                        dk[b, hk, j0 + r, d] = store(dk_acc[r, d] * dk_mult, dk[0, 0, 0, 0])
                        dv[b, hk, j0 + r, d] = store(dv_acc[r, d], dv[0, 0, 0, 0])
            else:
                dkv_acc[0, b, hk, j0:j0 + block_k] = dk_acc
                dkv_acc[1, b, hk, j0:j0 + block_k] = dv_acc


@njit(parallel=True, cache=True)
def attn_backward_dq_sum(dq_part, dq, scale, q_lo, q_hi, clear):
    """dq[:, :, q_lo:q_hi] = scale * (sum of the parts over the splits, in split order; part
    row ``i - q_lo``), the parts' rows zeroed after where ``clear`` (the next phase's)."""
    splits, B, Hq = dq_part.shape[0], dq_part.shape[1], dq_part.shape[2]
    D = dq.shape[3]
    for bh in prange(B * Hq):
        b, h = bh // Hq, bh % Hq
        for i in range(q_lo, q_hi):
            for d in range(D):
                x = dq_part[0, b, h, i - q_lo, d]
                for sp in range(1, splits):
                    x += dq_part[sp, b, h, i - q_lo, d]
                dq[b, h, i, d] = store(x * scale, dq[0, 0, 0, 0])
        if clear:
            for sp in range(splits):
                dq_part[sp, b, h] = 0.0


#: most dQ parts (key-tile splits) per (batch, key/value head); each is as large as dq
MAX_BACKWARD_SPLITS = 16
#: bytes the dQ parts may always take; beyond, at most PARTS_DQ times dQ's size in the
#: compute dtype (:func:`phase_bounds`)
PARTS_BYTES = 64 << 20
PARTS_DQ = 2


def backward_splits(batch, heads_kv, key_tiles, threads):
    """Key-tile splits per (batch, key/value head): enough jobs for 4 per thread. The split
    count sets dQ's summation order, so results are the same from run to run on one host
    (same thread count), and may differ in the last bits between thread counts."""
    want = -(-4 * max(threads, 1) // max(batch * heads_kv, 1))
    return max(1, min(want, key_tiles, MAX_BACKWARD_SPLITS))


def phase_bounds(starts, n_rows, splits, row_bytes):
    """``[(lo, hi), ...]``: the query rows ``[0, n_rows)`` cut at query tile starts
    (``starts``, sorted: a tile never straddles two phases) into the fewest phases, taken
    greedily, whose dQ parts (``splits`` parts of ``row_bytes`` a row) stay within
    :data:`PARTS_BYTES` or :data:`PARTS_DQ` times dQ (``n_rows * row_bytes``), whichever
    is larger; one phase ``(0, 0)`` where there is no row."""
    budget = max(PARTS_BYTES, PARTS_DQ * n_rows * row_bytes)
    most = max(1, budget // max(splits * row_bytes, 1))  # rows a phase may take
    bounds, lo = [], 0
    while lo < n_rows:
        if lo + most >= n_rows:
            hi = n_rows
        else:
            i = int(np.searchsorted(starts, lo + most, side="right")) - 1
            if i >= 0 and starts[i] > lo:  # the last tile start within the budget
                hi = int(starts[i])
            else:  # (one tile over the budget: that tile alone)
                j = int(np.searchsorted(starts, lo, side="right"))
                hi = int(starts[j]) if j < len(starts) else n_rows
        bounds.append((lo, hi))
        lo = hi
    return bounds or [(0, 0)]


def run_phases(bounds, splits, lead, kv_shape, d_pad, work_dtype, dq, scale, kv_pass,
               round_to=1):
    """The query rows in ``bounds``' phases (:func:`phase_bounds`): per phase
    ``kv_pass(lo, hi, dq_part, dkv_acc, first, last)`` (the fused pass of that phase's rows
    into the dQ parts, dK and dV carried in ``dkv_acc`` between phases; None where there
    is none), then the parts' sum into ``dq``. The parts are ``(splits, *lead, rows,
    d_pad)``, rows those of the largest phase rounded up to ``round_to``; the carry
    ``(2, *kv_shape, d_pad)`` where there is more than one phase."""
    rows = max(-(-(hi - lo) // round_to) * round_to for lo, hi in bounds) or round_to
    dq_part = np.zeros((splits, *lead, rows, d_pad), work_dtype)
    dkv_acc = np.empty((2, *kv_shape, d_pad) if len(bounds) > 1 else (2, 1, 1, 1, 1),
                       work_dtype)
    for n, (lo, hi) in enumerate(bounds):
        last = n == len(bounds) - 1
        if kv_pass is not None:
            kv_pass(lo, hi, dq_part, dkv_acc, n == 0, last)
        if dq.size:
            attn_backward_dq_sum(dq_part, dq, work_dtype.type(scale), lo, hi, not last)


def attn_backward(do, q, k, v, o, lse, dq, dk, dv, scale, causal, block_q, block_k, d_pad,
                  work_dtype, threads):
    """Host driver: preprocess, then the fused pass and the sum of the dQ parts (bhnd
    views), over the query rows in :func:`phase_bounds`' phases."""
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    delta = np.empty((B, Hq, Nq), work_dtype)
    if q.size:
        attn_backward_preprocess(do, o, delta, work_dtype)
    if not (dk.size or dq.size):
        return
    n_kt = -(-Nk // block_k)
    splits = backward_splits(B, Hkv, n_kt, threads)
    bounds = phase_bounds(np.arange(0, Nq, block_q), Nq, splits,
                          B * Hq * d_pad * work_dtype.itemsize)

    def kv_pass(q_lo, q_hi, dq_part, dkv_acc, first, last):
        attn_backward_kv(do, q, k, v, lse, delta, dk, dv, dq_part, scale, causal, block_q,
                         block_k, d_pad, work_dtype, q_lo, q_hi, dkv_acc, first, last)

    # (parts of whole tiles of rows: the dQ products write them)
    run_phases(bounds, splits, (B, Hq), (B, Hkv, n_kt * block_k), d_pad, work_dtype, dq,
               scale, kv_pass if Nk else None, round_to=block_q)
