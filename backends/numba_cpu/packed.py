"""Packed calls on the CPU: varlen forward and backward, and KV-cache decoding with split-KV.

Both run the masked kernels (masked_kernels.py), which read per-sequence rows through
``seams.query_rows``/``key_rows``: packed ``(total, H, D)`` arrays are seen as one batch entry
``(1, H, total, D)`` whose sequences are row ranges given by the offsets; a KV cache is a
dense ``(B, Hkv, capacity, D)`` view or a paged ``(num_pages, Hkv, page_size, D)`` view read
through the block table, with per-sequence key counts. The KV-cache forward always writes
split partials (float32, or float64 for float64 inputs) and merges them (split_kernels.py),
so one compiled forward serves every split count.
"""
from __future__ import annotations

import numpy as np

from flashcore import _interop, _paging
from flashcore._packed_checks import host_ints
from flashcore._rules import lse_dtype

from . import _NO_ROWS, _NO_TABLE, _as_kernel_view, _empty, _give, _mod_inputs, _work
from .decode_kernels import DECODE_BLOCK_K, MAX_DECODE_ROWS
from .tiles import choose_splits, choose_tiles, decode_tiles, q_tiles_per_job


def _packed_view(a, case):
    """A host ``(total, H, D)`` array as the kernels' ``(1, H, total, D)`` view."""
    return _as_kernel_view(a[None], case)


def _read_only(a):
    """An input's kernel view, marked read-only: NumPy and torch buffers arrive writable and
    JAX's read-only, and Numba compiles a kernel per kind, so every input is made one kind
    (the caller's array keeps its own flag)."""
    a = a.view()
    a.flags.writeable = False
    return a


def _host_packed(x, case):
    return _read_only(_packed_view(_interop.host_view(x, case.library), case))


def _alloc_packed(x, case):
    a = _empty(tuple(int(n) for n in x.shape), _interop.np_dtype(case.dtype))
    return a, _packed_view(a, case)


def _lse(shape, case):
    return _empty(shape, np.dtype(lse_dtype(case.dtype)))


def _per_job(case, block_q):
    import numba

    n_tiles = case.batch * case.heads_q * -(-case.seqlen_q // block_q)
    return q_tiles_per_job(n_tiles, numba.get_num_threads(), block_q)


def _offsets(case):
    vl = case.varlen
    return (host_ints(vl.cu_seqlens_q, case.library), host_ints(vl.cu_seqlens_k, case.library),
            _NO_ROWS)


def packed_forward(q, k, v, case):
    if case.varlen is not None:
        return _varlen_forward(q, k, v, case)
    return _kvcache_forward(q, k, v, case)


def _varlen_forward(q, k, v, case):
    made, opts, alibi, classes, block, args = _mod_inputs(case)
    tiles = choose_tiles(case.head_dim, case.dtype, case.causal)
    qk, kk, vk = (_host_packed(x, case) for x in (q, k, v))
    o, ok = _alloc_packed(q, case)
    lse = _lse((case.heads_q, case.varlen.total_q), case)
    if o.size:
        made[0](qk, kk, vk, ok, lse[None], case.scale, tiles.block_q, tiles.block_k,
                _per_job(case, tiles.block_q), _work(case), opts, alibi, classes, block, args,
                _offsets(case), (case.batch, case.seqlen_q, case.seqlen_k), (_NO_TABLE, 1), 1)
    return _give(o, case), _give(lse, case)


def varlen_backward(do, q, k, v, o, lse, case):
    from .backward_kernels import attn_backward_preprocess
    from .masked_kernels import run_backward

    made, opts, alibi, classes, block, args = _mod_inputs(case)
    tiles = choose_tiles(case.head_dim, case.dtype, case.causal)
    dok, qk, kk, vk, ok = (_host_packed(x, case) for x in (do, q, k, v, o))
    lse_h = _read_only(np.ascontiguousarray(_interop.host_view(lse, case.library),
                                            dtype=np.dtype(lse_dtype(case.dtype)))[None])
    dq, dqk = _alloc_packed(q, case)
    dk, dkk = _alloc_packed(k, case)
    dv, dvk = _alloc_packed(v, case)
    work = _work(case)
    delta = np.empty((1, case.heads_q, case.varlen.total_q), work)
    if qk.size:
        attn_backward_preprocess(dok, ok, delta, work)
    seqs, sizes = _offsets(case), (case.batch, case.seqlen_q, case.seqlen_k)
    run_backward(made, dok, qk, kk, vk, lse_h, delta, dqk, dkk, dvk, case.scale,
                 tiles.bwd_block_q, tiles.bwd_block_k, work, opts, alibi, classes, block, args,
                 seqs, sizes)
    return _give(dq, case), _give(dk, case), _give(dv, case)


def _kvcache_forward(q, k_cache, v_cache, case):
    import numba

    from .split_kernels import merge_splits

    kv = case.kvcache
    seqlens = host_ints(kv.cache_seqlens, case.library)
    table = None if kv.block_table is None else host_ints(kv.block_table, case.library)
    made, opts, alibi, classes, block, args = _mod_inputs(case)
    if kv.n_new:
        if case.library == "jax":
            raise ValueError("JAX arrays cannot be written in place; flashcore's JAX path "
                             "appends the new keys itself and passes none here")
        kc, vc, kn, vn = (_interop.host_view(x, case.library)
                          for x in (k_cache, v_cache, kv.k_new, kv.v_new))
        _paging.append_in_place(kc, vc, kn, vn, seqlens, table, kv.page_size, np.asarray)
    lengths = seqlens + kv.n_new
    longest = int(lengths.max()) if lengths.size else 0
    group = case.heads_q // case.heads_kv
    decode = case.seqlen_q * group <= MAX_DECODE_ROWS
    if decode:  # few query rows: one job per (sequence, KV head, split) (decode_kernels.py)
        block_q, block_k = 0, DECODE_BLOCK_K
        while kv.num_splits > 1 and block_k > 16 and -(-longest // block_k) < kv.num_splits:
            block_k //= 2
        jobs = case.batch * case.heads_kv
    else:
        block_q, block_k = decode_tiles(case.seqlen_q, case.head_dim,
                                        choose_tiles(case.head_dim, case.dtype, case.causal),
                                        longest, kv.num_splits, dtype=case.dtype)
        per_job = _per_job(case, block_q)
        jobs = case.batch * case.heads_q * -(-case.seqlen_q // (block_q * per_job))
    n_splits = choose_splits(kv.num_splits, jobs, longest, numba.get_num_threads(), block_k)
    kk, vk = (_read_only(_as_kernel_view(_interop.host_view(x, case.library), case))
              for x in (k_cache, v_cache))
    # q is a few rows: copied dense, so one compiled kernel serves every Nq (a (B, Hq, 1, D)
    # view of one query row would be C-contiguous, a new kind for Numba, and others not).
    qk = _read_only(np.ascontiguousarray(_as_kernel_view(_interop.host_view(q, case.library),
                                                         case)))
    o = _empty(tuple(int(n) for n in q.shape), _interop.np_dtype(case.dtype))
    ok = _as_kernel_view(o, case)
    lse = _lse((case.batch, case.heads_q, case.seqlen_q), case)
    if o.size:
        work = _work(case)
        shape = (n_splits * case.batch, case.heads_q, case.seqlen_q, case.head_dim)
        o_part, lse_part = np.empty(shape, work), np.empty(shape[:3], work)
        pages = (_NO_TABLE if table is None else np.ascontiguousarray(table), kv.page_size)
        seqs = (_NO_ROWS, _NO_ROWS, np.ascontiguousarray(lengths))
        sizes = (case.batch, case.seqlen_q, longest)
        if decode:
            made[2](qk, kk, vk, o_part, lse_part, case.scale, block_k, work, opts, alibi,
                    classes, block, args, seqs, sizes, pages, n_splits)
        else:
            made[0](qk, kk, vk, o_part, lse_part, case.scale, block_q, block_k, per_job, work,
                    opts, alibi, classes, block, args, seqs, sizes, pages, n_splits)
        merge_splits(o_part, lse_part, n_splits, ok, lse)
    return _give(o, case), _give(lse, case)
