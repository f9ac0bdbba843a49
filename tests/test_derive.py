"""The forward-mode twin of a score_mod (flashcore._derive): its value is the function's own,
bit for bit, and its derivative the analytic one; what it cannot differentiate gives None
(the backends then take a finite difference). Plain Python here (no kernel compiles), and
one Numba compile of a twin."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flashcore._derive import value_and_slope

CAP = 2.5


def softcap_global(s, b, h, i, j):
    return CAP * math.tanh(s / CAP)


def make_softcap(cap):
    def softcap_closure(score, b, h, i, j):
        """softcap with the cap in a closure cell (numpy's tanh)."""
        return cap * np.tanh(score / cap)
    return softcap_closure


def rel_bias(s, b, h, i, j, table):
    return s + table[h, i - j + 3]


def piecewise(s, b, h, i, j):
    x = s
    if i >= j:
        x = x * 2.0 + 1.0
    else:
        x -= 0.5
    y, z = x, s * s
    for _ in range(3):
        y = y + 0.1 * z
    return max(y, -5.0) + abs(s) ** 1.5 + (math.exp(s) if s < 1 else math.log(s * s + 1))


def d_piecewise(s, b, h, i, j):
    x, dx = (2 * s + 1, 2.0) if i >= j else (s - 0.5, 1.0)
    y, dy = x + 0.3 * s * s, dx + 0.6 * s
    d = dy if y >= -5.0 else 0.0
    d += 1.5 * abs(s) ** 0.5 * (1 if s >= 0 else -1)
    return d + (math.exp(s) if s < 1 else 2 * s / (s * s + 1))


def self_products(s, b, h, i, j):
    x = s
    x = x * x  # reads the old x on both sides
    x *= x
    return x / (1.0 + s * s)


def lazy_branch(s, b, h, i, j):
    """The untaken branch would divide by zero at s == 0."""
    return 1.0 / s if s != 0.0 else 0.0 * s + 3.0


def functions(s, b, h, i, j):
    return (math.sqrt(s * s + 1.0) * math.sin(s) - math.atan(s) + math.erf(s) + math.cos(s)
            + math.log1p(s * s) + math.expm1(0.5 * s) + np.exp2(s) + math.log2(2 + s * s)
            + math.log10(3 + s * s) + math.tan(0.3 * s) + math.sinh(0.2 * s)
            + math.cosh(0.2 * s) + float(s) + math.pow(s * s + 1, 0.5) + min(s, 0.5, -s)
            - int(s) + 2.0 ** s + s % 1.5 - s // 1.0)


def d_functions(s, b, h, i, j):
    r = math.sqrt(s * s + 1.0)
    return (s / r * math.sin(s) + r * math.cos(s) - 1 / (1 + s * s)
            + 2 / math.sqrt(math.pi) * math.exp(-s * s) - math.sin(s)
            + 2 * s / (1 + s * s) + 0.5 * math.exp(0.5 * s) + math.log(2) * 2 ** s
            + 2 * s / ((2 + s * s) * math.log(2)) + 2 * s / ((3 + s * s) * math.log(10))
            + 0.3 / math.cos(0.3 * s) ** 2 + 0.2 * math.cosh(0.2 * s) + 0.2 * math.sinh(0.2 * s)
            + 1 + s / r + (1 if s <= 0.5 and s <= -s else (-1 if -s < min(s, 0.5) else 0))
            + math.log(2) * 2 ** s + 1)


def halves(s, b, h, i, j):
    """A loop whose test reads s: its derivative is that of the path taken."""
    x = s
    while abs(x) > 1.0:
        x = x * 0.5
    return x


lam = lambda s, b, h, i, j: s * math.tanh(s) if i > j else -s  # noqa: E731


CASES = [
    (softcap_global, lambda s, *_: 1 - math.tanh(s / CAP) ** 2, ()),
    (make_softcap(7.0), lambda s, *_: 1 - math.tanh(s / 7.0) ** 2, ()),
    (rel_bias, lambda s, *_: 1.0, (np.arange(40.0).reshape(4, 10),)),
    (piecewise, d_piecewise, ()),
    (self_products, lambda s, *_: (4 * s ** 3 * (1 + s * s) - s ** 4 * 2 * s)
     / (1 + s * s) ** 2, ()),
    (lazy_branch, lambda s, *_: -1 / s ** 2 if s != 0.0 else 0.0, ()),
    (functions, d_functions, ()),
    (halves, lambda s, *_: 0.5 ** max(0, math.ceil(math.log2(abs(s)))) if s else 1.0, ()),
    (lam, lambda s, b, h, i, j: (math.tanh(s) + s * (1 - math.tanh(s) ** 2)) if i > j else -1,
     ()),
]


@pytest.mark.parametrize("fn,slope,args", CASES, ids=[c[0].__name__ for c in CASES])
def test_twin_value_is_the_function_and_slope_the_derivative(fn, slope, args):
    twin = value_and_slope(fn)
    assert twin is not None, fn.__name__
    for s in (-3.3, -0.4, 0.0, 0.7, 1.25, 2.5):
        for i, j in ((2, 1), (1, 2)):
            v, d = twin(s, 0, 1, i, j, *args)
            assert v == fn(s, 0, 1, i, j, *args)
            want = slope(s, 0, 1, i, j)
            assert d == pytest.approx(want, rel=1e-13, abs=1e-13), (s, i, j)


def _calls_a_helper(s, b, h, i, j):
    return _helper(s)


def _helper(x):
    return 2.0 * x


def _indexes_by_s(s, b, h, i, j, table):
    return table[int(s)] + 0.0 * s


def _ranges_by_s(s, b, h, i, j):
    x = s
    for _ in range(int(s)):
        x = x * 0.5
    return x


def _or_of_values(s, b, h, i, j):
    return s or 1.0


def _hypot(s, b, h, i, j):
    return math.hypot(s, 1.0)


@pytest.mark.parametrize("fn", [_calls_a_helper, _indexes_by_s, _or_of_values, _hypot,
                                _ranges_by_s])
def test_what_it_cannot_differentiate_gives_none(fn):
    assert value_and_slope(fn) is None


def test_a_function_without_source_gives_none():
    ns = {}
    exec("def made(s, b, h, i, j):\n    return s * 2.0\n", ns)  # noqa: S102
    assert value_and_slope(ns["made"]) is None


def test_two_lambdas_on_one_line_are_told_apart():
    f, g = (lambda s, b, h, i, j: s * 3.0), (lambda s, b, h, i, j: s * s)  # noqa: E731
    assert value_and_slope(f)(2.0, 0, 0, 0, 0) == (6.0, 3.0)
    assert value_and_slope(g)(2.0, 0, 0, 0, 0) == (4.0, 4.0)


def test_numba_compiles_the_twin():
    """The twin is what the kernels compile: Numba types it (its returns unify) and gives
    the Python values."""
    from numba import njit

    for fn, _, args in CASES[:4]:
        jitted = njit(value_and_slope(fn))
        for s in (-1.5, 0.25, 3.0):
            got = jitted(s, 0, 1, 2, 1, *args)
            want = value_and_slope(fn)(s, 0, 1, 2, 1, *args)
            assert got[0] == pytest.approx(want[0], rel=1e-15)
            assert got[1] == pytest.approx(want[1], rel=1e-14)
