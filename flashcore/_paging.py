"""Where a KV cache keeps key position ``p`` of sequence ``b``, and the in-place append.

Contiguous cache ``(B, capacity, Hkv, D)``: at ``[b, p]``. Paged cache
``(num_pages, page_size, Hkv, D)``: at ``[block_table[b, p // page_size], p % page_size]``.
Index arrays are built on the host with NumPy from host copies of ``cache_seqlens`` and
``block_table`` (the checks read those anyway).
"""
from __future__ import annotations

import numpy as np


def slots(positions_b, positions_p, block_table, page_size):
    """The cache indices ``(first, second)`` of key positions ``p`` of sequences ``b``
    (1-D int64 host arrays of equal length)."""
    if block_table is None:
        return positions_b, positions_p
    return block_table[positions_b, positions_p // page_size], positions_p % page_size


def new_key_slots(seqlens, n_new, block_table, page_size):
    """Indices of the ``n_new`` positions after each sequence's cached keys, sequence by
    sequence: ``(B * n_new,)`` each."""
    B = seqlens.shape[0]
    b = np.repeat(np.arange(B, dtype=np.int64), n_new)
    p = (seqlens[:, None] + np.arange(n_new, dtype=np.int64)[None, :]).reshape(-1)
    return slots(b, p, block_table, page_size)


def append_in_place(k_cache, v_cache, k_new, v_new, seqlens, block_table, page_size, asarray):
    """Write ``k_new``/``v_new`` ``(B, n_new, Hkv, D)`` into the caches (any library whose
    arrays take item assignment with integer index arrays: NumPy, torch, CuPy).
    ``asarray`` turns a host index array into one the caches' library indexes with."""
    B, n_new = int(k_new.shape[0]), int(k_new.shape[1])
    if B * n_new == 0:
        return
    first, second = (asarray(x) for x in new_key_slots(seqlens, n_new, block_table, page_size))
    rows = (B * n_new, *(int(n) for n in k_new.shape[2:]))
    k_cache[first, second] = k_new.reshape(rows)
    v_cache[first, second] = v_new.reshape(rows)


def sequence_keys(cache, b, length, block_table, page_size):
    """The first ``length`` keys (or values) of sequence ``b``: ``(length, Hkv, D)`` (a host
    array; a gather, so a copy when paged)."""
    p = np.arange(length, dtype=np.int64)
    first, second = slots(np.full(length, b, np.int64), p, block_table, page_size)
    return cache[first, second]
