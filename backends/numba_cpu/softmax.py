"""The softmax steps of the dense kernels on whole tiles, in SIMD vectors (simd.py) for
float32 and as scalar loops for float64 (whose exp2 must be float64-accurate).

Both forms take a tile whose columns from ``n_cols`` on are a tail past the last key, and
leave probabilities there equal to 0 (and in rows past the last query), so the products that
follow run on whole tiles.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from .scalar import exp2, exp2_f32
from .simd import hmax, hsum, splat, vadd, vexp2, vload, vmax, vmul, vstore, vsub, vzero, width_of

FASTMATH = {"reassoc", "contract", "arcp", "nsz"}  # no 'nnan'/'ninf': -inf marks masked scores


@njit(fastmath=FASTMATH | {"nnan"})
def row_max(row, n, m):
    """max(m, row[:n]). 'nnan' lets it vectorize; a NaN score still poisons its row through
    exp2 below, and a row of only NaN and -inf is caught by the caller."""
    for c in range(n):
        x = row[c]
        m = x if x > m else m
    return m


@njit(fastmath=FASTMATH)
def row_exp2_sum(row, n, m):
    """row[:n] <- exp2(row[:n] - m); returns their sum."""
    total = m - m  # zero of the compute dtype (m is finite here, or NaN for a NaN row)
    for c in range(n):
        p = exp2(row[c] - m)
        row[c] = p
        total += p
    return total


@njit(fastmath=FASTMATH)
def online_softmax_tile(s, n_rows, n_cols, m_i, l_i, acc):
    """Turn scores (log2 units) into probabilities against the running max; rescale acc."""
    for r in range(n_rows):
        row = s[r]
        m_new = row_max(row, n_cols, m_i[r])
        if m_new == -np.inf:
            for c in range(n_cols):
                if row[c] != -np.inf:  # only NaN scores: the row's result must be NaN
                    m_new = row[c]  # (NaN, in the compute dtype)
        if m_new == -np.inf:  # nothing visible yet in this row
            row[:n_cols] = 0.0
            continue
        alpha = exp2(m_i[r] - m_new)
        l_i[r] = l_i[r] * alpha + row_exp2_sum(row, n_cols, m_new)
        m_i[r] = m_new
        if alpha != 1.0:
            a = acc[r]
            for d in range(a.shape[0]):
                a[d] *= alpha


@njit(fastmath=FASTMATH)
def probabilities_tile(s, n_rows, n_cols, lse2):
    """s (scores in log2 units) -> P = exp2(s - lse2); rows with lse = -inf (they see no key)
    arrive with lse2 = +inf and get P = 0."""
    for r in range(n_rows):
        m = lse2[r]
        for c in range(n_cols):
            s[r, c] = exp2(s[r, c] - m)


@njit(fastmath=FASTMATH)
def dscores_tile(p, dp, n_rows, n_cols, delta):
    """dp <- P * (dP - D): the gradient of the scores."""
    for r in range(n_rows):
        dr = delta[r]
        for c in range(n_cols):
            dp[r, c] = p[r, c] * (dp[r, c] - dr)


@njit
def zero_tail(x, n_rows, n_cols):
    """Zero rows >= n_rows and columns >= n_cols of a tile (tails hold stale values)."""
    x[n_rows:, :] = 0.0
    x[:, n_cols:] = 0.0




def online_softmax(s, n_rows, n_cols, m_i, l_i, acc, row0):
    """Scores ``s`` (log2 units) -> probabilities against the running row max ``m_i[row0:]``;
    updates the row sums ``l_i`` and rescales the output rows ``acc[row0:]``."""
    raise NotImplementedError


@overload(online_softmax)
def _online_softmax(s, n_rows, n_cols, m_i, l_i, acc, row0):
    if s.dtype == types.float32:
        return lambda s, n_rows, n_cols, m_i, l_i, acc, row0: online_softmax_vec(
            s, n_rows, n_cols, m_i, l_i, acc, row0)
    def scalar(s, n_rows, n_cols, m_i, l_i, acc, row0):
        online_softmax_tile(s, n_rows, n_cols, m_i[row0:], l_i[row0:], acc[row0:])
        s[:, n_cols:] = 0.0
        s[n_rows:, :] = 0.0

    return scalar


@njit
def online_softmax_vec(s, n_rows, n_cols, m_i, l_i, acc, row0):
    w = width_of(s)
    ld = s.shape[1]
    if n_cols < ld:
        s[:, n_cols:] = -np.inf
    for r in range(n_rows):
        base = r * ld
        mv = splat(m_i[row0 + r])
        mv2 = mv
        for c in range(0, ld, 2 * w):  # two chains: max and sum wait on one another less
            mv = vmax(mv, vload(s, base + c))
            mv2 = vmax(mv2, vload(s, base + c + w))
        m_new = hmax(vmax(mv, mv2))
        if m_new == -np.inf:
            for c in range(n_cols):
                if s[r, c] != -np.inf:  # only NaN scores: the row's result must be NaN
                    m_new = s[r, c]
        if m_new == -np.inf:  # nothing visible yet in this row
            s[r, :] = 0.0
            continue
        mn = splat(m_new)
        total = vzero(s)
        total2 = total
        for c in range(0, ld, 2 * w):
            p = vexp2(vsub(vload(s, base + c), mn))
            vstore(s, base + c, p)
            total = vadd(total, p)
            p2 = vexp2(vsub(vload(s, base + c + w), mn))
            vstore(s, base + c + w, p2)
            total2 = vadd(total2, p2)
        m_old = m_i[row0 + r]
        alpha = exp2_f32(m_old - m_new)
        l_i[row0 + r] = l_i[row0 + r] * alpha + hsum(vadd(total, total2))
        m_i[row0 + r] = m_new
        if alpha != 1.0:
            av = splat(alpha)
            a0 = (row0 + r) * acc.shape[1]
            for c in range(0, acc.shape[1], w):
                vstore(acc, a0 + c, vmul(vload(acc, a0 + c), av))
    s[n_rows:, :] = 0.0  # rows past the last query: no stale scores reach the product


def probabilities(s, n_rows, n_cols, lse2):
    """``s <- exp2(s - lse2)`` per row (rows that see no key have lse2 = +inf: P = 0);
    columns from ``n_cols`` and rows from ``n_rows`` set to 0."""
    raise NotImplementedError


@overload(probabilities)
def _probabilities(s, n_rows, n_cols, lse2):
    if s.dtype == types.float32:
        return lambda s, n_rows, n_cols, lse2: probabilities_vec(s, n_rows, n_cols, lse2)
    def scalar(s, n_rows, n_cols, lse2):
        probabilities_tile(s, n_rows, n_cols, lse2)
        zero_tail(s, n_rows, n_cols)

    return scalar


@njit
def probabilities_vec(s, n_rows, n_cols, lse2):
    w = width_of(s)
    ld = s.shape[1]
    if n_cols < ld:
        s[:, n_cols:] = -np.inf
    for r in range(n_rows):
        base = r * ld
        m = splat(lse2[r])
        for c in range(0, ld, w):
            vstore(s, base + c, vexp2(vsub(vload(s, base + c), m)))
    s[n_rows:, :] = 0.0

