"""Tile products written out in SIMD registers (simd.py), in place of a BLAS call per tile.

``product(a, a0, a_row, a_col, b, c, m, n, k, accumulate)`` computes
``c[:m, :n] (+)= A @ b[:k, :n]`` where ``A[i, p] = a.flat[a0 + i * a_row + p * a_col]``: the left
operand is read through strides (a tile or its transpose), the right one row by row in
vectors. A block of ``ROWS`` rows by two vectors of ``c`` stays in registers through the
whole reduction: 8 accumulators, which keep both FMA pipes of an AVX2 core busy (FMA
latency 4 cycles x 2 pipes), and leave registers for the operands (16 under AVX2).
``m`` must be a multiple of ``ROWS`` and ``n`` of two vectors: the kernels pad their tiles.
"""
from numba import njit

from .simd import at, splat, vfma, vload, vstore, vzero, width_of
from .tiles import PRODUCT_ROWS as ROWS


@njit
def product(a, a0, a_row, a_col, b, c, m, n, k, accumulate):
    """``c[:m, :n] (+)= A @ b[:k, :n]`` with ``A[i, p] = a.flat[a0 + i * a_row + p * a_col]``."""
    block_product(a, a0, a_row, a_col, b, c, 0, m, n, k, accumulate)


@njit
def product_into(a, a0, a_row, a_col, b, c, c_row0, m, n, k):
    """``c[c_row0:c_row0 + m, :n] += A @ b[:k, :n]`` (A as in :func:`product`)."""
    block_product(a, a0, a_row, a_col, b, c, c_row0, m, n, k, True)


@njit
def block_product(a, a0, a_row, a_col, b, c, c_row0, m, n, k, accumulate):
    w = width_of(c)
    ldb = b.shape[1]
    ldc = c.shape[1]
    zero = vzero(c)
    for i in range(0, m, ROWS):
        ai = a0 + i * a_row
        for j in range(0, n, 2 * w):
            c0 = (c_row0 + i) * ldc + j
            if accumulate:
                x00 = vload(c, c0)
                x01 = vload(c, c0 + w)
                x10 = vload(c, c0 + ldc)
                x11 = vload(c, c0 + ldc + w)
                x20 = vload(c, c0 + 2 * ldc)
                x21 = vload(c, c0 + 2 * ldc + w)
                x30 = vload(c, c0 + 3 * ldc)
                x31 = vload(c, c0 + 3 * ldc + w)
            else:
                x00 = x01 = x10 = x11 = x20 = x21 = x30 = x31 = zero
            for p in range(k):
                bp = p * ldb + j
                b0 = vload(b, bp)
                b1 = vload(b, bp + w)
                ap = ai + p * a_col
                s0 = splat(at(a, ap))
                x00 = vfma(s0, b0, x00)
                x01 = vfma(s0, b1, x01)
                s1 = splat(at(a, ap + a_row))
                x10 = vfma(s1, b0, x10)
                x11 = vfma(s1, b1, x11)
                s2 = splat(at(a, ap + 2 * a_row))
                x20 = vfma(s2, b0, x20)
                x21 = vfma(s2, b1, x21)
                s3 = splat(at(a, ap + 3 * a_row))
                x30 = vfma(s3, b0, x30)
                x31 = vfma(s3, b1, x31)
            vstore(c, c0, x00)
            vstore(c, c0 + w, x01)
            vstore(c, c0 + ldc, x10)
            vstore(c, c0 + ldc + w, x11)
            vstore(c, c0 + 2 * ldc, x20)
            vstore(c, c0 + 2 * ldc + w, x21)
            vstore(c, c0 + 3 * ldc, x30)
            vstore(c, c0 + 3 * ldc + w, x31)
