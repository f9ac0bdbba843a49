"""The two seams of the CPU kernels, the same two as the CUDA kernels'
(``numba_cuda/device/seams.py``) in tile form.

1. Which tiles a tile visits: :func:`key_end` (the keys a block of query rows visits),
   :func:`query_start` (the transpose, for the dK/dV pass), :func:`visits` (whether a query
   tile sees any key of a key tile) and :func:`needs_mask` (whether it sees only part of
   it: only such tiles take the per-element mask).
2. What a raw score becomes: :func:`mask_scores` sets the scores of hidden keys to -inf
   (:func:`mask_scores_t` on the forward's transposed score tiles; the scale is folded
   into Q when it is loaded).

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


@njit
def mask_scores_t(st, n_keys, n_rows, i0, j0, offset):
    """:func:`mask_scores` on transposed scores (``st[c, r]``: key ``j0 + c``, query
    ``i0 + r``): key ``j0 + c`` is hidden from the rows before ``j0 + c - offset - i0``."""
    for c in range(n_keys):
        for r in range(min(max(j0 + c - offset - i0, 0), n_rows)):
            st[c, r] = -np.inf


# --- the general form: causal, a window and a block mask's tile classes --------------------
# ``left``/``right`` are the window's bounds, -1 for an unbounded side; ``classes`` a
# BlockMask's (Bm, Hm, q blocks, k blocks) tile classes of ``block`` rows (a single FULL
# entry with a huge block when there is no mask_mod).

EMPTY, PARTIAL, FULL = 0, 1, 2


@njit
def reach(causal, right):
    """How far right of the diagonal a query sees (-1: unbounded; causal caps it at 0)."""
    if causal:
        return 0 if right < 0 else min(right, 0)
    return right


@njit
def key_bounds(i0, n_rows, Nk, offset, causal, left, right):
    """Keys ``[lo, hi)`` that query rows ``i0 .. i0 + n_rows - 1`` may see."""
    r = reach(causal, right)
    hi = Nk if r < 0 else max(0, min(Nk, i0 + n_rows + offset + r))
    lo = 0 if left < 0 else min(hi, max(0, i0 + offset - left))
    return lo, hi


@njit
def query_bounds(j0, n_cols, Nq, offset, causal, left, right):
    """Query rows ``[lo, hi)`` that may see a key of ``j0 .. j0 + n_cols - 1``."""
    r = reach(causal, right)
    lo = 0 if r < 0 else min(Nq, max(0, j0 - offset - r))
    hi = Nq if left < 0 else max(lo, min(Nq, j0 + n_cols - 1 - offset + left + 1))
    return lo, hi


@njit
def rule_class(i0, n_rows, j0, n_cols, offset, causal, left, right):
    """EMPTY, PARTIAL or FULL: how much of the tile causal and the window let through."""
    r = reach(causal, right)
    d_min = j0 - (i0 + n_rows - 1 + offset)  # key minus diagonal, over the tile
    d_max = j0 + n_cols - 1 - (i0 + offset)
    if (r >= 0 and d_min > r) or (left >= 0 and d_max < -left):
        return EMPTY
    if (r < 0 or d_max <= r) and (left < 0 or d_min >= -left):
        return FULL
    return PARTIAL


@njit
def mask_class(classes, block, b, h, i0, n_rows, j0, n_cols):
    """The class of the tile under a BlockMask: EMPTY or FULL when every block it
    overlaps is, else PARTIAL."""
    bb = b if classes.shape[0] > 1 else 0
    hh = h if classes.shape[1] > 1 else 0
    seen_empty = False
    seen_full = False
    seen_partial = False
    for qb in range(i0 // block, (i0 + n_rows - 1) // block + 1):
        for kb in range(j0 // block, (j0 + n_cols - 1) // block + 1):
            c = classes[bb, hh, min(qb, classes.shape[2] - 1), min(kb, classes.shape[3] - 1)]
            if c == EMPTY:
                seen_empty = True
            elif c == FULL:
                seen_full = True
            else:
                seen_partial = True
    if seen_partial or (seen_empty and seen_full):
        return PARTIAL
    return FULL if seen_full else EMPTY


@njit
def tile_class(classes, block, b, h, i0, n_rows, j0, n_cols, offset, causal, left, right):
    """The tile's class under every mask: causal, the window and the BlockMask."""
    a = rule_class(i0, n_rows, j0, n_cols, offset, causal, left, right)
    if a == EMPTY:
        return EMPTY
    m = mask_class(classes, block, b, h, i0, n_rows, j0, n_cols)
    if m == EMPTY:
        return EMPTY
    return FULL if a == FULL and m == FULL else PARTIAL


# --- which rows a sequence owns: dense batches, packed sequences, KV caches ----------------
# ``cu_q``/``cu_k`` are packed offsets (empty for a dense batch), ``len_k`` per-sequence key
# counts of a KV cache (empty otherwise). A dense batch indexes the arrays' batch axis; a
# packed sequence is a row range of their single batch entry.


@njit
def query_rows(b, cu_q, Nq):
    """(batch index into q, first row, rows) of sequence ``b``'s queries."""
    if cu_q.shape[0] == 0:
        return b, 0, Nq
    return 0, cu_q[b], cu_q[b + 1] - cu_q[b]


@njit
def key_rows(b, cu_k, len_k, Nk):
    """(batch index into k, first key position, keys) of sequence ``b``."""
    if cu_k.shape[0] != 0:
        return 0, cu_k[b], cu_k[b + 1] - cu_k[b]
    if len_k.shape[0] != 0:
        return b, 0, len_k[b]
    return b, 0, Nk


@njit
def split_keys(lo, hi, split, n_splits, n_keys, block_k):
    """Keys ``[lo, hi)`` narrowed to split ``split`` of ``n_splits`` (split-KV): the key range
    ``[0, n_keys)`` is cut into ``n_splits`` equal runs of whole key tiles."""
    if n_splits == 1:
        return lo, hi
    tiles = (n_keys + block_k - 1) // block_k
    chunk = (tiles + n_splits - 1) // n_splits * block_k
    s_lo = split * chunk
    s_hi = min(n_keys, s_lo + chunk)
    lo, hi = max(lo, s_lo), min(hi, s_hi)
    return (lo, hi) if lo < hi else (0, 0)
