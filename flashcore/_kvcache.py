"""Attention against a key/value cache, contiguous or paged, with the new keys appended in
place (FlashAttention 2's ``flash_attn_with_kvcache``; vLLM's PagedAttention layout).

Decoding is bound by memory bandwidth and has few query rows, so backends split each
sequence's keys into ``num_splits`` ranges computed in parallel and merged by their lse
(split-KV, "flash-decoding").
"""
from __future__ import annotations

from ._api import _framework, _torch_compiling
from ._checks import check_flag
from ._mods import options as _options
from ._packed_checks import kvcache_plan


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None,
                           block_table=None, causal=False, window=None, softcap=None,
                           alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(),
                           scale=None, return_lse=False, num_splits=0, backend="auto"):
    """Attention of new query rows against a KV cache, appending ``k``, ``v`` to it first.

    Parameters
    ----------
    q : array ``(B, Nq, Hq, D)`` (layout ``"bnhd"``, as FlashAttention 2)
    k_cache, v_cache : arrays
        Contiguous: ``(B, capacity, Hkv, D)``. Paged (with ``block_table``):
        ``(num_pages, page_size, Hkv, D)``, a pool of pages shared by every sequence.
    cache_seqlens : int32 (or int64) array ``(B,)``
        How many keys each sequence has cached (before the append). On the caches' device,
        or **on the host**: a NumPy array (beside any library's arrays) or a CPU torch
        tensor (beside torch GPU tensors). Host lengths are read where they are and copied
        to the GPU on the call's stream (torch: through a pinned ring, ``non_blocking``),
        so a decode loop that keeps them on the host never waits for the GPU; lengths on
        the GPU are read back for the checks (a synchronization whenever the tensor was
        written since the last call). Python lists are not taken (pass ``np.asarray``).
        A step captured in a CUDA graph takes its lengths on the GPU (host ones are
        refused there) and splits the keys for the capacity, so that its replays are
        right for any lengths up to it.
    k, v : arrays ``(B, Nnew, Hkv, D)``, optional (both or neither)
        New keys and values, written **in place** into the caches at positions
        ``cache_seqlens[b] ... cache_seqlens[b] + Nnew - 1`` (through the block table when
        paged) and attended too. ``cache_seqlens`` itself is not changed: add ``Nnew`` to it
        for the next step. In JAX, whose arrays are immutable, nothing is changed in place:
        the updated caches are returned instead, ``(o, k_cache, v_cache)``.
    block_table : int32 array ``(B, max_pages_per_seq)``, optional
        Key position ``p`` of sequence ``b`` lives in slot ``p % page_size`` of page
        ``block_table[b, p // page_size]``. Only the pages a sequence uses are read (and
        checked to lie inside the pool). On the caches' device; a torch GPU table is read
        back once and remembered until it is written (so an unchanged table costs no
        synchronization).
    causal : bool
        The query rows are the last ``Nq`` positions of each sequence (bottom-right): query
        ``i`` sees key ``j`` iff ``j <= i + cache_seqlens[b] + Nnew - Nq``.
    window, softcap, alibi_slopes, score_mod, mask_mod, mod_args
        As for :func:`flashcore.attention`, with ``Nk = cache_seqlens[b] + Nnew`` per
        sequence: ``i`` is the query row, ``j`` the key position in the cache, ``b`` the
        sequence.
    scale : float, optional
        Defaults to ``1/sqrt(D)``.
    num_splits : int
        How many key ranges each (sequence, head) is split into and computed in parallel,
        merged by their lse. 0 (default) lets the backend choose (numba_cpu: enough to give
        every thread about 4 jobs, with at least 512 keys per split, at most 64; numba_cuda:
        enough splits for 8 warps per multiprocessor, at least 4 key tiles per split,
        at most 64); 1 turns split-KV off. The result does not depend on it beyond
        rounding.
    backend : {"auto", "numba_cuda", "numba_cpu", "reference"}
        numba_cuda serves torch, CuPy and JAX GPU arrays (JAX: the returned caches alias
        the given ones, so with the caches donated to ``jit`` the append is in place).
        With one query row per sequence and grouped heads (a decode step without window,
        ALiBi or user mods) it computes a group's query heads in one block, so the cache
        is read once per key/value head.

    Returns
    -------
    o : array like q; and with ``return_lse=True``, ``lse`` float32 ``(B, Hq, Nq)``.
    JAX returns ``(o, k_cache, v_cache)`` (or ``(o, lse, k_cache, v_cache)``) with the
    updated caches. Forward only (inference): no gradient.

    Every value is checked before anything is written: a rejected call leaves the caches
    as they were.
    """
    check_flag("return_lse", return_lse)
    kw = {"causal": causal, "scale": scale, "num_splits": num_splits}
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, None)
    fw = _framework(q, k_cache, v_cache)
    if fw == "jax":
        from . import _jax_varlen

        return _jax_varlen.kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                   return_lse=return_lse, backend=backend, options=options,
                                   **kw)
    if fw == "torch" and _torch_compiling():
        from . import _torch_varlen

        o, lse = _torch_varlen.kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                       backend=backend, options=options, **kw)
        return (o, lse) if return_lse else o
    case, impl = kvcache_plan(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend,
                              need_lse=return_lse, explicit=backend != "auto", options=options,
                              **kw)
    o, lse = impl.forward(q, k_cache, v_cache, case)
    return (o, lse) if return_lse else o
