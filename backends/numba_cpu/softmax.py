"""The softmax steps of the dense kernels on whole tiles, in SIMD vectors (simd.py) for
float32 and as scalar loops for float64 (whose exp2 must be float64-accurate).

Both forms take a tile whose columns from ``n_cols`` on are a tail past the last key, and
leave probabilities there equal to 0 (and in rows past the last query), so the products that
follow run on whole tiles.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from .scalar import exp2
from .simd import splat, vadd, vexp2, vload, vmax, vmul, vstore, vsub, vzero, width_of

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




def online_softmax_t(st, n_keys, m_i, l_i, acc, row0, alpha):
    """The online softmax on transposed scores: ``st[c, r]`` (log2 units) is query
    ``row0 + r``'s score of key ``c``. Turns ``st[:n_keys]`` into probabilities against the
    running max ``m_i[row0:]``, updates the sums ``l_i[row0:]``, rescales the rows
    ``acc[row0:]`` (``alpha`` gets the factors) and zeroes the rows from ``n_keys``.

    Down the columns, the max, sum and rescale factor of ``w`` query rows are elementwise
    vector operations (no horizontal reduction, no scalar exp2 per row). A column that has
    seen only -inf keeps ``m_i`` at -inf-as-lowest (the lowest finite value, so that
    exp2(-inf - m) is 0, not NaN) and ``l_i`` at 0; a NaN score makes its column's sum NaN.
    """
    raise NotImplementedError


@overload(online_softmax_t)
def _online_softmax_t(st, n_keys, m_i, l_i, acc, row0, alpha):
    if st.dtype == types.float32:
        lowest = np.float32(np.finfo(np.float32).min)
        return lambda st, n_keys, m_i, l_i, acc, row0, alpha: online_softmax_t_vec(
            st, n_keys, m_i, l_i, acc, row0, alpha, lowest)
    lowest = np.finfo(np.float64).min
    return lambda st, n_keys, m_i, l_i, acc, row0, alpha: online_softmax_t_scalar(
        st, n_keys, m_i, l_i, acc, row0, alpha, lowest)


@njit
def online_softmax_t_vec(st, n_keys, m_i, l_i, acc, row0, alpha, lowest):
    w = width_of(st)
    ld = st.shape[1]
    for g in range(0, ld, w):
        m_old = vload(m_i, row0 + g)
        m = vmax(splat(lowest), m_old)
        for c in range(n_keys):
            m = vmax(m, vload(st, c * ld + g))
        total = vzero(st)
        for c in range(n_keys):
            p = vexp2(vsub(vload(st, c * ld + g), m))
            vstore(st, c * ld + g, p)
            total = vadd(total, p)
        a = vexp2(vsub(m_old, m))
        vstore(alpha, g, a)
        vstore(l_i, row0 + g, vadd(vmul(vload(l_i, row0 + g), a), total))
        vstore(m_i, row0 + g, m)
    st[n_keys:, :] = 0.0
    rescale_rows(acc, row0, alpha)


@njit(fastmath=FASTMATH)
def online_softmax_t_scalar(st, n_keys, m_i, l_i, acc, row0, alpha, lowest):
    """online_softmax_t with scalar float64-accurate exp2 (one column at a time)."""
    for r in range(st.shape[1]):
        m_old = m_i[row0 + r]
        m = m_old if m_old > lowest else lowest
        for c in range(n_keys):
            x = st[c, r]
            m = x if x > m else m
        total = m - m
        for c in range(n_keys):
            p = exp2(st[c, r] - m)
            st[c, r] = p
            total += p
        alpha[r] = exp2(m_old - m)
        l_i[row0 + r] = l_i[row0 + r] * alpha[r] + total
        m_i[row0 + r] = m
    st[n_keys:, :] = 0.0
    rescale_rows(acc, row0, alpha)


@njit
def rescale_rows(acc, row0, alpha):
    """acc[row0 + r] *= alpha[r] where alpha[r] != 1 (after the first key tiles, rarely)."""
    w = width_of(acc)
    for r in range(alpha.shape[0]):
        if alpha[r] != 1.0:
            a = splat(alpha[r])
            base = (row0 + r) * acc.shape[1]
            for d in range(0, acc.shape[1], w):
                vstore(acc, base + d, vmul(vload(acc, base + d), a))


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

