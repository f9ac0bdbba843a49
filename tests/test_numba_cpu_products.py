"""numba_cpu's SIMD building blocks (simd.py, products.py, softmax.py) on their own."""
import math

import numpy as np
import pytest
from flashcore.backends.numba_cpu import simd
from flashcore.backends.numba_cpu.products import (
    block_product4,
    block_product8,
    product,
    product_into,
)
from flashcore.backends.numba_cpu.scalar import tanh
from flashcore.backends.numba_cpu.softmax import online_softmax_t, probabilities
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
def _tanh_all(x, out, like):
    for i in range(x.shape[0]):
        out[i] = tanh(x[i], like)


def test_rational_tanh_is_float32_accurate_and_odd():
    """scalar.tanh in a float32 kernel (the softcap's, vectorized): within 2.5e-8 of
    tanh relative (half a float32 ulp is 6e-8), odd, +-1 past the clamp; float64 kernels
    keep libm's."""
    x = np.concatenate([np.linspace(-12.0, 12.0, 400_001), np.geomspace(1e-30, 1e-2, 1000),
                        [9.0, 9.5, 30.0, 1e30, np.inf]])
    out = np.empty_like(x)
    _tanh_all(x, out, np.float32(0))
    want = np.tanh(x)
    nz = x != 0
    assert np.all(np.abs(out[nz] - want[nz]) <= 2.5e-8 * np.abs(want[nz]))
    neg = np.empty_like(x)
    _tanh_all(-x, neg, np.float32(0))
    assert np.array_equal(neg, -out) and np.float32(out.max()) == 1.0
    _tanh_all(x, out, np.float64(0))  # (libm's, as NumPy's to an ulp)
    assert np.allclose(out, want, rtol=1e-15, atol=0)


@njit
def _softmax_steps(st, n_keys, m_i, l_i, acc, alpha, s2, n_rows, n_cols, lse2):
    online_softmax_t(st, n_keys, m_i, l_i, acc, 0, alpha)
    probabilities(s2, n_rows, n_cols, lse2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_softmax_steps_zero_the_tails_and_keep_nan_rows(dtype):
    """The forward's online softmax on transposed scores (a column per query row) and the
    backward's probabilities (a row per query row)."""
    rng = np.random.default_rng(1)
    tiles = product_tiles(64, dtype)
    rows, cols = tiles.block_q, tiles.block_k
    s = rng.standard_normal((rows, cols)).astype(dtype)
    s[1, 3] = np.nan
    s[2, :] = -np.inf  # a row that sees nothing yet
    s2 = s.copy()
    x = s.astype(np.float64)
    m_i = np.full(rows, -np.inf, dtype)
    l_i = np.zeros(rows, dtype)
    acc = np.ones((rows, tiles.d_pad), dtype)
    alpha = np.empty(rows, dtype)
    lse2 = np.full(rows, 3.0, dtype)
    n_cols = cols - 5
    st = s.T.copy()
    _softmax_steps(st, n_cols, m_i, l_i, acc, alpha, s2, rows - 1, n_cols, lse2)
    ok = [0] + list(range(3, rows))
    want = np.exp2(x[ok, :n_cols] - x[ok, :n_cols].max(axis=1, keepdims=True))
    assert np.allclose(st[:n_cols, ok].T, want, rtol=1e-6)
    assert np.allclose(l_i[ok], want.sum(axis=1), rtol=1e-6)
    ok2 = ok[:-1]  # probabilities: rows before n_rows
    assert np.allclose(s2[ok2, :n_cols], np.exp2(x[ok2, :n_cols] - 3.0), rtol=1e-6)
    assert np.all(st[n_cols:] == 0) and np.all(s2[:, n_cols:] == 0)
    assert np.isnan(l_i[1]) and np.all(st[:, 2] == 0) and l_i[2] == 0
    assert np.all(acc == 0)  # first tile: every factor exp2(-inf - m) = 0
    assert np.all(s2[rows - 1] == 0)  # rows past n_rows
    # a second key tile whose scores are 1 higher: factor 1/2, sums 1/2 + 1 of the old
    l_old = l_i.astype(np.float64)
    acc[:] = 1.0
    st = (s + 1).T.copy()
    _softmax_steps(st, n_cols, m_i, l_i, acc, alpha, s2, rows - 1, n_cols, lse2)
    assert np.allclose(st[:n_cols, ok].T, want, rtol=1e-6)
    assert np.allclose(l_i[ok], 1.5 * l_old[ok], rtol=1e-6)
    assert np.allclose(acc[ok], 0.5, rtol=1e-6) and np.isnan(l_i[1]) and l_i[2] == 0


_BITS = ("from flashcore.backends.numba_cpu import simd, tiles; "
         "print(simd.VECTOR_BITS, tiles.PRODUCT_ROWS)")


@pytest.mark.parametrize("env,expected", [
    ({"NUMBA_CPU_NAME": "generic"}, "128 4"),
    ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,-avx512f"}, "256 4"),
    ({"NUMBA_CPU_NAME": "skylake-avx512", "NUMBA_CPU_FEATURES": "+avx2,+fma,+avx512f"},
     "512 8"),
])
def test_vectors_follow_the_cpu_numba_compiles_for(env, expected):
    """A portable build (``NUMBA_CPU_NAME``, e.g. ``generic`` for a disk cache shared by
    hosts of different instruction sets) gets vectors of its own width, not the host's."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")} | env
    out = subprocess.run([sys.executable, "-c", _BITS], env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout.split()
    assert " ".join(out[-2:]) == expected


@pytest.mark.slow
def test_a_generic_build_computes_the_same_attention():
    """The kernels compiled for ``NUMBA_CPU_NAME=generic`` (128-bit vectors) agree with the
    float64 reference (compiles every forward kernel afresh: slow)."""
    import os
    import subprocess
    import sys

    script = ("import numpy as np, flashcore\n"
              "rng = np.random.default_rng(0)\n"
              "q, k, v = (rng.standard_normal((1, 2, 70, 64)).astype(np.float32) "
              "for _ in range(3))\n"
              "o, _ = flashcore.attention_forward(q, k, v, causal=True, backend='numba_cpu')\n"
              "r, _ = flashcore.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), "
              "causal=True, backend='reference')\n"
              "print(float(np.linalg.norm(o - r) / np.linalg.norm(r)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    env["NUMBA_CPU_NAME"] = "generic"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True, timeout=1200).stdout.split()
    assert float(out[-1]) < 2e-5


def test_forward_jobs_even_out_the_threads():
    """Non-causal jobs cost alike: the job size is the one whose busiest thread has the
    least work with each job's fixed cost counted (B=1 H=8 N=1024 on 16 threads: one job of
    16 query tiles per thread, not four of 4); causal and masked calls keep at least 4 jobs
    per thread for the balance."""
    from flashcore.backends.numba_cpu.tiles import JOB_COST, q_tiles_per_job

    tiles = 8 * 1024 // 32
    assert q_tiles_per_job(tiles, 16, 32) == 4
    assert q_tiles_per_job(tiles, 16, 32, 8) == 16
    for threads in (1, 2, 3, 5, 7, 16, 64):
        for heads, per_head in ((8, 32), (3, 5), (1, 1), (12, 128)):
            per = q_tiles_per_job(heads * per_head, threads, 32, heads)
            assert 1 <= per <= min(per_head, 16)
            busiest = lambda p: -(-heads * -(-per_head // p) // threads) * (p + JOB_COST)  # noqa: E731
            assert busiest(per) <= min(busiest(p) for p in range(1, min(per_head, 16) + 1))


def _uses_tanh(s, b, h, i, j):
    return math.tanh(s) + np.tanh(s) + math.exp(0.0)


def _no_tanh(s, b, h, i, j):
    return s * 2.0


def test_with_tanh_swaps_math_and_numpy_tanh_only():
    """masked_kernels.with_tanh (the float32 kernels' score_mod): math.tanh and np.tanh
    become the given function, other math stays, a function without tanh is returned as it
    is, and the user's own function and globals are untouched."""
    from flashcore.backends.numba_cpu.masked_kernels import with_tanh

    five = njit(lambda x: 5.0)
    swapped = with_tanh(_uses_tanh, five)
    assert njit(swapped)(0.3, 0, 0, 0, 0) == 11.0
    assert _uses_tanh(0.3, 0, 0, 0, 0) == math.tanh(0.3) + np.tanh(0.3) + 1.0
    assert globals()["math"] is math and globals()["np"] is np
    assert with_tanh(_no_tanh, five) is _no_tanh


def _tanh_of_an_array(s, b, h, i, j, bias):
    return s + np.tanh(bias[b])[j] + math.tanh(0.25 * s)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_score_mod_may_take_tanh_of_an_array(dtype):
    """In the float32 kernels a score_mod's np.tanh is the rational tanh of a number and
    NumPy's of an array (scalar.tanh_any): np.tanh of a mod_args row compiles there as in
    float64 (it failed to type before), and agrees with the reference."""
    from helpers import TOL_BWD, TOL_FWD, rel_err

    import flashcore

    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((2, 2, 40, 16)).astype(dtype) for _ in range(4))
    bias = rng.standard_normal((2, 40)).astype(dtype)
    opts = dict(score_mod=_tanh_of_an_array, mod_args=(bias,), causal=True)
    got = flashcore.attention_forward(q, k, v, backend="numba_cpu", **opts)
    ref = flashcore.attention_forward(q, k, v, backend="reference", **opts)
    assert rel_err(got[0], ref[0]) < TOL_FWD[dtype], rel_err(got[0], ref[0])
    grads = flashcore.attention_backward(do, q, k, v, *got, backend="numba_cpu", **opts)
    refs = flashcore.attention_backward(do, q, k, v, *ref, backend="reference", **opts)
    for g, r in zip(grads, refs):
        assert rel_err(g, r) < TOL_BWD[dtype], rel_err(g, r)
