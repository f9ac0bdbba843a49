"""The CUDA kernels' mask seam on the host: ``seams.row_keys`` (a row's visible keys as two
bounds on the offset from a lane's first key, which the tensor-core and wgmma masks compare
each score's offset with) against the mask's definition, written out here."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from flashcore.backends.numba_cuda.device import seams


def _visible(i, j, Nk, co, causal, left, right):
    """Query ``i`` sees key ``j``: a key, not after the diagonal ``i + co`` where causal,
    within ``left`` before and ``right`` after it (-1: unbounded)."""
    d = i + co
    return (0 <= j < Nk and not (causal and j > d) and not (right >= 0 and j > d + right)
            and not (left >= 0 and j < d - left))


@pytest.mark.parametrize("span", [16, 64, 256])
def test_row_keys_bounds_are_the_mask(span):
    """For rows, first keys, key counts, alignments (Nq < Nk, Nq > Nk) and every window
    shape, offset ``c`` of ``[0, span)`` lies within ``row_keys``' bounds exactly where the
    mask shows key ``j0 + c``; the bounds are int32 within ``[-1, span]``."""
    row_keys = seams.row_keys.py_func
    rng = np.random.default_rng(span)
    sides = (-1, 0, 1, 5, 40, 300)
    checked = 0
    for causal, left, right in itertools.product((False, True), sides, sides):
        for _ in range(60):
            Nk = int(rng.integers(1, 3 * span))
            co = int(rng.integers(-2 * span, 2 * span))  # (Nk - Nq: either sign)
            i = int(rng.integers(0, 3 * span))
            j0 = int(rng.integers(0, Nk + span)) // 2 * 2
            lo, hi = row_keys(i, j0, Nk, co, causal, left, right, span)
            assert isinstance(lo, np.int32) and isinstance(hi, np.int32)
            assert -1 <= lo <= span and -1 <= hi <= span
            for c in range(span):
                assert (lo <= c <= hi) == _visible(i, j0 + c, Nk, co, causal, left, right), (
                    i, j0, c, Nk, co, causal, left, right, lo, hi)
            checked += 1
    assert checked == 2 * len(sides) ** 2 * 60
