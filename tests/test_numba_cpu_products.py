"""numba_cpu's SIMD building blocks (simd.py, products.py, softmax.py) on their own."""
import numpy as np
import pytest
from flashcore.backends.numba_cpu import simd
from flashcore.backends.numba_cpu.products import (
    block_product4,
    block_product8,
    product,
    product_into,
)
from flashcore.backends.numba_cpu.softmax import online_softmax, probabilities
from flashcore.backends.numba_cpu.tiles import product_tiles
from numba import njit


@njit
def _products(a, at, b, c, c2):
    m, k = a.shape
    n = b.shape[1]
    product(a, 0, k, 1, b, c, m, n, k, False)  # c = a @ b
    product(at, 0, 1, m, b, c2, m, n, k, False)  # the left operand read transposed
    product_into(a, 0, k, 1, b, c2, 0, m, n, k)  # c2 += a @ b


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_products_match_a_float64_product(dtype):
    rng = np.random.default_rng(0)
    w = 2 * simd.lanes(np.dtype(dtype).itemsize)
    m, k, n = 8, 37, 3 * w
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.full((m, n), np.nan, dtype)
    c2 = np.full((m, n), np.nan, dtype)
    _products(a, np.ascontiguousarray(a.T), b, c, c2)
    want = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-14 if dtype == "float64" else 1e-5
    assert np.abs(c - want).max() <= tol * np.abs(want).max()
    assert np.abs(c2 - 2 * want).max() <= 2 * tol * np.abs(want).max()


@njit
def _blocks(a, b, c4, c8):
    m, k = a.shape
    n = b.shape[1]
    block_product4(a, 0, k, 1, b, c4, 0, m, n, k, False)
    block_product8(a, 0, k, 1, b, c8, 0, m, n, k, False)
    block_product8(a, 0, k, 1, b, c8, 0, m, n, k, True)  # c8 = 2 a @ b


def test_both_row_blocks_on_any_host():
    """The 4-row block (AVX2 hosts) and the 8-row block (AVX-512 hosts; products.ROWS picks
    one per host) give the same product wherever they run (the 8-row one spills on a
    16-register host, which only slows it)."""
    rng = np.random.default_rng(1)
    w = 2 * simd.lanes(4)
    m, k, n = 16, 29, 2 * w
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c4, c8 = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
    _blocks(a, b, c4, c8)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(c4 - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(c8 - 2 * want).max() <= 2e-5 * np.abs(want).max()


@njit
def _exp2_all(x, out):
    w = simd.width_of(x)
    for i in range(0, x.shape[0], w):
        simd.vstore(out, i, simd.vexp2(simd.vload(x, i)))


def test_vector_exp2_is_float32_accurate_and_keeps_nan():
    w = simd.lanes(4)
    x = np.concatenate([np.linspace(-130, 0, 64 * w - 4, dtype=np.float32),
                        np.array([-np.inf, np.nan, -126.5, 0.0], np.float32)])
    out = np.empty_like(x)
    _exp2_all(x, out)
    want = np.exp2(x.astype(np.float64))
    finite = np.isfinite(x) & (x >= -126)
    assert np.all(np.abs(out[finite] - want[finite]) <= 4e-7 * want[finite])
    assert out[-4] == 0.0 and np.isnan(out[-3]) and out[-2] == 0.0 and out[-1] == 1.0


@njit
def _softmax_steps(s, n_rows, n_cols, m_i, l_i, acc, s2, lse2):
    online_softmax(s, n_rows, n_cols, m_i, l_i, acc, 0)
    probabilities(s2, n_rows, n_cols, lse2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_softmax_steps_zero_the_tails_and_keep_nan_rows(dtype):
    rng = np.random.default_rng(1)
    rows, cols = 8, product_tiles(64, dtype).block_k
    s = rng.standard_normal((rows, cols)).astype(dtype)
    s[1, 3] = np.nan
    s[2, :] = -np.inf  # a row that sees nothing yet
    s2 = s.copy()
    x = s.astype(np.float64)
    m_i = np.full(rows, -np.inf, dtype)
    l_i = np.zeros(rows, dtype)
    acc = np.ones((rows, 8), dtype)
    lse2 = np.full(rows, 3.0, dtype)
    n_cols = cols - 5
    _softmax_steps(s, rows - 1, n_cols, m_i, l_i, acc, s2, lse2)
    ok = [0, 3, 4, 5, 6]
    want = np.exp2(x[ok, :n_cols] - x[ok, :n_cols].max(axis=1, keepdims=True))
    assert np.allclose(s[ok, :n_cols], want, rtol=1e-6)
    assert np.allclose(l_i[ok], want.sum(axis=1), rtol=1e-6)
    assert np.allclose(s2[ok, :n_cols], np.exp2(x[ok, :n_cols] - 3.0), rtol=1e-6)
    assert np.all(s[:, n_cols:] == 0) and np.all(s2[:, n_cols:] == 0)
    assert np.isnan(l_i[1]) and np.all(s[2] == 0) and m_i[2] == -np.inf
    assert np.all(s2[rows - 1] == 0)  # rows past n_rows
