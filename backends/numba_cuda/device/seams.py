"""The two seams every kernel family calls (SIMT, tensor-core; the CPU kernels have the
same two in ``numba_cpu/seams.py``).

1. **Which tiles a tile visits, and which of them need a per-element mask.**
   :func:`key_range` gives the keys a block of query rows visits and the keys every one of
   those rows sees whole; :func:`query_range` is its transpose for the dK/dV pass (which
   query rows a block of keys is seen by). Tiles outside the range are never loaded or
   computed; tiles inside the full range take no per-element mask.
2. **What a raw score becomes.** :func:`score` takes the score of query ``i`` and key
   ``j`` as the kernel holds it (SIMT kernels fold the scale and log2 e into Q when it is
   loaded; tensor-core kernels scale in the softmax) and returns what the softmax sees,
   ``-inf`` where ``j`` is masked; :func:`visible` is the mask with the key bound, as the
   backward passes use it (P = 0 where not visible), :func:`hides` the mask alone.

The variant's mask options arrive as compile-time arguments (``CAUSAL``), so after
inlining each kernel keeps only the arithmetic its variant needs. Masks and score
modifiers (window, softcap, ALiBi, user functions), varlen bounds and paged caches extend
these functions and the variant that parametrizes them, not the kernels.
"""
from __future__ import annotations

from .constants import NEG_INF
from .convert import device_function


@device_function
def key_range(q0, rows, Nk, causal_offset, CAUSAL):
    """``(n_end, n_full)`` for query rows ``q0 .. q0 + rows - 1``: they visit keys
    ``[0, n_end)``, and every one of them sees each key before ``n_full``, so a key tile
    that ends at or before ``n_full`` needs no mask (the tail past ``Nk`` always does)."""
    n_end = Nk
    n_full = Nk
    if CAUSAL:
        n_end = max(0, min(Nk, q0 + rows + causal_offset))
        n_full = min(Nk, q0 + 1 + causal_offset)
    return n_end, n_full


@device_function
def query_range(k0, cols, step, causal_offset, CAUSAL):
    """``(m_begin, m_full)`` for keys ``k0 .. k0 + cols - 1`` in the dK/dV pass: query rows
    before ``m_begin`` (a multiple of ``step``) see none of them, and a query tile that
    starts at or after ``m_full`` sees all of them (no mask). Queries run to the end."""
    m_begin = 0
    if CAUSAL:
        m_begin = max(0, k0 - causal_offset) // step * step
    m_full = k0 + cols - 1 - causal_offset
    return m_begin, m_full


@device_function
def hides(i, j, causal_offset, CAUSAL):
    """Whether the mask hides key ``j`` from query ``i`` (causal: ``j`` after the diagonal
    of ``i`` aligned to the bottom right), bounds aside. The dK/dV pass uses it alone: a
    key past ``Nk`` only feeds a dK/dV row that is never stored."""
    return CAUSAL and j > i + causal_offset


@device_function
def visible(i, j, Nk, causal_offset, CAUSAL):
    """Whether query ``i`` sees key ``j``: ``j`` is a key, and the mask does not hide it."""
    return j < Nk and not hides(i, j, causal_offset, CAUSAL)


@device_function
def score(s, i, j, Nk, causal_offset, CAUSAL):
    """The score the softmax sees for query ``i`` and key ``j``: ``s``, or ``-inf`` where
    ``j`` is masked."""
    if visible(i, j, Nk, causal_offset, CAUSAL):
        return s
    return NEG_INF
