"""The KV-cache forward for few query rows (decoding): one job per (sequence, KV head, split).

Decoding reads a long cache for a handful of query rows, so its cost is the cache's bytes.
The general forward (masked_kernels.py) makes one job per query head and copies each key
tile transposed for a BLAS product: under GQA every K/V row is then read ``group`` times,
and for one query row the copy costs more than the product. Here a job takes every query
row of every query head sharing one KV head (``group * Nq`` rows), and reads each K and V
row once, where it lies (through the page table: pages.py's addressing), straight into the
dot products with all those rows. The score step (modifiers, masks), the online softmax and
the split-KV bounds are the general kernels' (``scores`` is the one of the kernel set of the
call's score_mod / mask_mod).
"""
import math

import numpy as np
from numba import njit, prange

from .forward_kernels import FASTMATH, load_tile, online_softmax_tile
from .scalar import LOG2E, load, store
from .seams import EMPTY, PARTIAL, key_bounds, key_rows, query_rows, split_keys, tile_class

#: Query rows (query heads of a group x query tokens) up to which the KV-cache forward takes
#: the decode kernel.
MAX_DECODE_ROWS = 64
#: Keys per tile of the decode kernel (its score tile is rows x this).
DECODE_BLOCK_K = 256


@njit
def _row(src, table, page_size, b, h, pos):
    """Row ``pos`` (a key or value vector) of sequence ``b``, KV head ``h`` of a dense
    ``(B, Hkv, N, D)`` or paged ``(num_pages, Hkv, page_size, D)`` view."""
    if table.shape[0] == 0:
        return src[b, h, pos]
    return src[table[b, pos // page_size], h, pos % page_size]


def make_decode(scores):
    """The decode forward with the score step ``scores`` (masked_kernels' for the call's
    mods) compiled in."""

    @njit(fastmath=FASTMATH)  # (the dot products vectorize only with reassociation)
    def decode_job(q, k, v, o, lse, ob, qb, q_base, kb, k_base, b, hk, group, nq, nk_b,
                   offset, split, n_splits, block_k, q_mult, work_dtype, opts, alibi,
                   classes, block, mod_args, table, page_size):
        """Query rows ``0 .. nq - 1`` of sequence ``b`` for query heads ``hk * group ..``
        (row ``g * nq + i`` is head ``hk * group + g``, query ``i``) against the keys of
        split ``split``; writes o and lse at batch index ``ob``."""
        causal, left, right = opts[0], opts[1], opts[2]
        D = q.shape[3]
        R = group * nq
        qt = np.empty((R, D), work_dtype)
        for g in range(group):
            load_tile(q, qb, hk * group + g, q_base, nq, qt[g * nq:(g + 1) * nq], q_mult)
        s = np.empty((R, block_k), work_dtype)
        gd = np.empty((1, 1), work_dtype)
        row = np.empty(D, work_dtype)
        acc = np.zeros((R, D), work_dtype)
        m_i = np.full(R, -np.inf, work_dtype)
        l_i = np.zeros(R, work_dtype)
        cls = np.empty(group, np.int8)
        lo, hi = key_bounds(0, nq, nk_b, offset, causal, left, right)
        lo, hi = split_keys(lo, hi, split, n_splits, nk_b, block_k)
        for j0 in range(lo // block_k * block_k, hi, block_k):
            nk = min(block_k, hi - j0)
            seen = False
            for g in range(group):
                cls[g] = tile_class(classes, block, b, hk * group + g, 0, nq, j0, nk, offset,
                                    causal, left, right)
                seen = seen or cls[g] != EMPTY
            if not seen:
                continue
            for c in range(nk):  # S = Q Kᵀ, each key row read once for every query row
                kr = _row(k, table, page_size, kb, hk, k_base + j0 + c)
                for d in range(D):
                    row[d] = load(kr[d])
                for r in range(R):
                    x = work_dtype.type(0.0)
                    for d in range(D):
                        x += qt[r, d] * row[d]
                    s[r, c] = x
            for g in range(group):
                rows = s[g * nq:(g + 1) * nq]
                if cls[g] == EMPTY:
                    rows[:, :nk] = -np.inf
                else:
                    scores(rows, gd, False, nq, nk, 0, j0, b, hk * group + g, offset, opts,
                           cls[g] == PARTIAL, alibi, mod_args)
            online_softmax_tile(s, R, nk, m_i, l_i, acc)
            for c in range(nk):  # O += P V, each value row read once
                vr = _row(v, table, page_size, kb, hk, k_base + j0 + c)
                for d in range(D):
                    row[d] = load(vr[d])
                for r in range(R):
                    p = s[r, c]
                    if p != 0.0:
                        for d in range(D):
                            acc[r, d] += p * row[d]
        for r in range(R):
            h = hk * group + r // nq
            i = q_base + r % nq
            empty = l_i[r] == 0.0
            inv = 0.0 if empty else 1.0 / l_i[r]
            for d in range(D):
                o[ob, h, i, d] = store(acc[r, d] * inv, o[0, 0, 0, 0])
            lse[ob, h, i] = -np.inf if empty else (m_i[r] + math.log2(l_i[r])) / LOG2E

    @njit(parallel=True)
    def decode(q, k, v, o, lse, scale, block_k, work_dtype, opts, alibi, classes, block,
               mod_args, seqs, sizes, pages, n_splits):
        """Jobs over (sequence, KV head, key split); arguments as masked_kernels' forward
        (``seqs``, ``sizes``, ``pages``; o and lse are the split partials where
        ``n_splits`` > 1)."""
        cu_q, cu_k, len_k = seqs
        B, Nq, Nk = sizes
        table, page_size = pages
        Hkv = k.shape[1]
        group = q.shape[1] // Hkv
        q_mult = work_dtype.type(scale * LOG2E)
        n_out = o.shape[0] // n_splits
        for job in prange(B * Hkv * n_splits):
            split = job % n_splits
            rest = job // n_splits
            b = rest // Hkv
            hk = rest % Hkv
            qb, q_base, nq_b = query_rows(b, cu_q, Nq)
            kb, k_base, nk_b = key_rows(b, cu_k, len_k, Nk)
            if nq_b > 0:
                decode_job(q, k, v, o, lse, split * n_out + qb, qb, q_base, kb, k_base, b,
                           hk, group, nq_b, nk_b, nk_b - nq_b, split, n_splits, block_k,
                           q_mult, work_dtype, opts, alibi, classes, block, mod_args, table,
                           page_size)

    return decode
