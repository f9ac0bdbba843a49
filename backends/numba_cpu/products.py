"""Tile products written out in SIMD registers (simd.py), in place of a BLAS call per tile.

``product(a, a0, a_row, a_col, b, c, m, n, k, accumulate)`` computes
``c[:m, :n] (+)= A @ b[:k, :n]`` where ``A[i, p] = a.flat[a0 + i * a_row + p * a_col]``: the left
operand is read through strides (a tile or its transpose), the right one row by row in
vectors. A block of ``ROWS`` rows by two vectors of ``c`` stays in registers through the
whole reduction. Under AVX2 (16 vector registers) ``ROWS`` is 4: 8 accumulators, which
keep both FMA pipes busy (FMA latency 4 cycles x 2 pipes), with registers left for the
operands. Under AVX-512 (32 registers) it is 8 (:func:`block_product8`): 16 accumulators,
and per step 2 vector loads and 8 broadcasts feed 16 FMAs instead of 2 and 4 feeding 8.
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
def block_product4(a, a0, a_row, a_col, b, c, c_row0, m, n, k, accumulate):
    """The product in blocks of 4 rows x 2 vectors (``m`` a multiple of 4)."""
    w = width_of(c)
    ldb = b.shape[1]
    ldc = c.shape[1]
    zero = vzero(c)
    for i in range(0, m, 4):
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


@njit
def block_product8(a, a0, a_row, a_col, b, c, c_row0, m, n, k, accumulate):
    """The product in blocks of 8 rows x 2 vectors (``m`` a multiple of 8): 16
    accumulators, for hosts with 32 vector registers."""
    w = width_of(c)
    ldb = b.shape[1]
    ldc = c.shape[1]
    zero = vzero(c)
    for i in range(0, m, 8):
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
                x40 = vload(c, c0 + 4 * ldc)
                x41 = vload(c, c0 + 4 * ldc + w)
                x50 = vload(c, c0 + 5 * ldc)
                x51 = vload(c, c0 + 5 * ldc + w)
                x60 = vload(c, c0 + 6 * ldc)
                x61 = vload(c, c0 + 6 * ldc + w)
                x70 = vload(c, c0 + 7 * ldc)
                x71 = vload(c, c0 + 7 * ldc + w)
            else:
                x00 = x01 = x10 = x11 = x20 = x21 = x30 = x31 = zero
                x40 = x41 = x50 = x51 = x60 = x61 = x70 = x71 = zero
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
                s4 = splat(at(a, ap + 4 * a_row))
                x40 = vfma(s4, b0, x40)
                x41 = vfma(s4, b1, x41)
                s5 = splat(at(a, ap + 5 * a_row))
                x50 = vfma(s5, b0, x50)
                x51 = vfma(s5, b1, x51)
                s6 = splat(at(a, ap + 6 * a_row))
                x60 = vfma(s6, b0, x60)
                x61 = vfma(s6, b1, x61)
                s7 = splat(at(a, ap + 7 * a_row))
                x70 = vfma(s7, b0, x70)
                x71 = vfma(s7, b1, x71)
            vstore(c, c0, x00)
            vstore(c, c0 + w, x01)
            vstore(c, c0 + ldc, x10)
            vstore(c, c0 + ldc + w, x11)
            vstore(c, c0 + 2 * ldc, x20)
            vstore(c, c0 + 2 * ldc + w, x21)
            vstore(c, c0 + 3 * ldc, x30)
            vstore(c, c0 + 3 * ldc + w, x31)
            vstore(c, c0 + 4 * ldc, x40)
            vstore(c, c0 + 4 * ldc + w, x41)
            vstore(c, c0 + 5 * ldc, x50)
            vstore(c, c0 + 5 * ldc + w, x51)
            vstore(c, c0 + 6 * ldc, x60)
            vstore(c, c0 + 6 * ldc + w, x61)
            vstore(c, c0 + 7 * ldc, x70)
            vstore(c, c0 + 7 * ldc + w, x71)


#: The block the kernels call: the host's (ROWS, tiles.PRODUCT_ROWS).
block_product = block_product8 if ROWS == 8 else block_product4
