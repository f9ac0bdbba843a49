"""Split-KV: the merge of partial results computed over disjoint key ranges.

Each split ``s`` of a row's keys gives a partial output ``o_s`` (normalized over its own
keys) and its log-sum-exp ``lse_s``. The row's result is their softmax-weighted mean:
``lse = m + log(sum_s exp(lse_s - m))`` with ``m = max_s lse_s`` and
``o = sum_s exp(lse_s - lse) o_s``. Splits that saw no key (``lse_s = -inf``) weigh 0; a
row no split saw gives 0 and ``-inf``; a NaN in any split makes the row NaN.
"""
import math

import numpy as np
from numba import njit, prange

from .scalar import store


@njit(parallel=True, cache=True)
def merge_splits(o_part, lse_part, n_splits, o, lse):
    """o_part ``(n_splits * B, H, N, D)`` and lse_part ``(n_splits * B, H, N)`` (split ``s``
    of batch entry ``b`` at ``s * B + b``) -> o ``(B, H, N, D)`` (storage dtype, any
    strides) and lse ``(B, H, N)``."""
    SB, H, N, D = o_part.shape
    B = SB // n_splits
    for bh in prange(B * H):
        b, h = bh // H, bh % H
        acc = np.empty(D, o_part.dtype)
        for i in range(N):
            m = -np.inf
            nan = False
            for s in range(n_splits):
                x = lse_part[s * B + b, h, i]
                if x != x:
                    nan = True
                elif x > m:
                    m = x
            if nan or m == -np.inf:
                fill = np.nan if nan else 0.0
                for d in range(D):
                    o[b, h, i, d] = store(fill, o[0, 0, 0, 0])
                lse[b, h, i] = np.nan if nan else -np.inf
                continue
            acc[:] = 0.0
            total = 0.0
            for s in range(n_splits):
                w = math.exp(lse_part[s * B + b, h, i] - m)
                total += w
                if w > 0.0:
                    for d in range(D):
                        acc[d] += w * o_part[s * B + b, h, i, d]
            inv = 1.0 / total
            for d in range(D):
                o[b, h, i, d] = store(acc[d] * inv, o[0, 0, 0, 0])
            lse[b, h, i] = m + math.log(total)
