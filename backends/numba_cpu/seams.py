"""The two seams of the CPU kernels, the same two as the CUDA kernels'
(``numba_cuda/device/seams.py``) in tile form.

1. Which tiles a tile visits: :func:`key_end` (the keys a block of query rows visits),
   :func:`query_start` (the transpose, for the dK/dV pass), :func:`visits` (whether a query
   tile sees any key of a key tile) and :func:`needs_mask` (whether it sees only part of
   it: only such tiles take the per-element mask).
2. What a raw score becomes: :func:`mask_scores` sets the scores of hidden keys to -inf
   (the scale is folded into Q when it is loaded).

Masks and score modifiers extend these functions, not the kernels.
"""
import numpy as np
from numba import njit


@njit
def key_end(i0, n_rows, Nk, offset, causal):
    """Query rows ``i0 .. i0 + n_rows - 1`` visit keys ``[0, key_end)``: all, or (causal)
    up to the last row's diagonal."""
    if not causal:
        return Nk
    return max(0, min(Nk, i0 + n_rows + offset))


@njit
def query_start(j0, block_q, offset, causal):
    """The first query tile (a multiple of ``block_q``) whose rows see any key from ``j0``
    on; every later tile does too."""
    if not causal:
        return 0
    return max(0, j0 - offset) // block_q * block_q


@njit
def visits(i0, n_rows, j0, offset, causal):
    """Whether query rows ``i0 .. i0 + n_rows - 1`` see any key from ``j0`` on."""
    return not causal or j0 <= i0 + n_rows - 1 + offset


@njit
def needs_mask(i0, j0, n_cols, offset, causal):
    """Whether some row from ``i0`` on misses some key of ``j0 .. j0 + n_cols - 1`` (only
    the first row can: later rows see more)."""
    return causal and j0 + n_cols - 1 > i0 + offset


@njit
def mask_scores(s, n_rows, n_cols, i0, j0, offset):
    """-inf where key ``j0 + c`` lies after query ``i0 + r``'s last visible key (tiles for
    which :func:`needs_mask` holds)."""
    for r in range(n_rows):
        first_hidden = i0 + r + offset + 1 - j0
        for c in range(max(first_hidden, 0), n_cols):
            s[r, c] = -np.inf
