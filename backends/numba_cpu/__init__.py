"""Numba CPU backend: tiled FlashAttention kernels parallel over (batch, head, tile).

Inputs are read in place through strides (NumPy views of torch/JAX CPU buffers included);
float16 and bfloat16 are computed in float32, float32 and float64 in their own precision;
lse is float64 for float64 inputs and float32 otherwise (_rules.lse_dtype).
"""
from __future__ import annotations

import numpy as np

from flashcore import _interop, _poison, _rules

from .tiles import choose_tiles, product_tiles, q_tiles_per_job

NAME = "numba_cpu"
#: storage dtype the kernels see, and the dtype they compute in
_KERNEL_VIEW = {"float16": (np.int16, np.float32), "bfloat16": (np.uint16, np.float32),
                "float32": (np.float32, np.float32), "float64": (np.float64, np.float64)}
MAX_HEAD_DIM = 256


def unavailable_reason():
    return None


def supports(case):
    if case.device != "cpu":
        return f"it runs on the CPU; the arrays are on {case.device}"
    if case.head_dim > MAX_HEAD_DIM:
        return f"head dim {case.head_dim} > {MAX_HEAD_DIM}"
    return None


def _as_kernel_view(a, case):
    """A host array as the kernels read it: bhnd order, 16-bit floats as raw integer bits
    (a view: same memory, same strides)."""
    a = a if case.layout == "bhnd" else a.transpose(0, 2, 1, 3)
    return a.view(_KERNEL_VIEW[case.dtype][0])


def _kernel_view(x, case):
    return _as_kernel_view(_interop.host_view(x, case.library), case)


def _empty(shape, dtype):
    return np.full(shape, np.nan, dtype) if _poison.ENABLED else np.empty(shape, dtype)


def _alloc_like(x, case):
    """A host result buffer of x's shape in the call's dtype, and its kernel view."""
    a = _empty(tuple(map(int, x.shape)), _interop.np_dtype(case.dtype))
    return a, _as_kernel_view(a, case)


def _work(case):
    """The compute dtype as the kernels take it: a ``np.dtype`` object (its ``.type(x)``
    converts), which Numba types in 0.6 µs per call where a NumPy class such as
    ``np.float32`` takes its slow path, 5.6 µs (notes/fixed_cost_varlen_cpu_2026-11-26.md)."""
    return _WORK_DTYPES[case.dtype]


_WORK_DTYPES = {name: np.dtype(w) for name, (_, w) in _KERNEL_VIEW.items()}


def _give(a, case):
    return _interop.from_host(a, case.library)


def forward(q, k, v, case):
    if case.packed:
        from .packed import packed_forward

        return packed_forward(q, k, v, case)
    if case.mods is not None:
        return _masked_forward(q, k, v, case)
    from .forward_kernels import attn_forward

    tiles = product_tiles(case.head_dim, case.dtype)
    qk, kk, vk = (_kernel_view(x, case) for x in (q, k, v))
    o, ok = _alloc_like(q, case)
    lse = _empty((case.batch, case.heads_q, case.seqlen_q), _rules.lse_dtype(case.dtype))
    if o.size or lse.size:
        import numba

        n_tiles = case.batch * case.heads_q * -(-case.seqlen_q // tiles.block_q)
        per_job = q_tiles_per_job(n_tiles, numba.get_num_threads(), tiles.block_q,
                                  0 if case.causal else case.batch * case.heads_q)
        attn_forward(qk, kk, vk, ok, lse, case.scale, case.causal, tiles.block_q, tiles.block_k,
                     per_job, tiles.d_pad, _work(case))
    return _give(o, case), _give(lse, case)


def backward(do, q, k, v, o, lse, case):
    if case.packed:
        from .packed import varlen_backward

        return varlen_backward(do, q, k, v, o, lse, case)
    if case.mods is not None:
        return _masked_backward(do, q, k, v, o, lse, case)
    import numba

    from .backward_kernels import attn_backward

    tiles = product_tiles(case.head_dim, case.dtype)
    dok, qk, kk, vk, ok = (_kernel_view(x, case) for x in (do, q, k, v, o))
    lse_h = np.ascontiguousarray(_interop.host_view(lse, case.library),
                                 dtype=_rules.lse_dtype(case.dtype))
    dq, dqk = _alloc_like(q, case)
    dk, dkk = _alloc_like(k, case)
    dv, dvk = _alloc_like(v, case)
    attn_backward(dok, qk, kk, vk, ok, lse_h, dqk, dkk, dvk, case.scale, case.causal,
                  tiles.bwd_block_q, tiles.bwd_block_k, tiles.d_pad, _work(case),
                  numba.get_num_threads())
    return _give(dq, case), _give(dk, case), _give(dv, case)


# --- masks and score modifiers (masked_kernels.py) ---------------------------------------


def _mod_inputs(case):
    """The masked kernels' inputs beyond the arrays: their three kernels, ``opts``, the
    ALiBi slopes, the tile classes of mask_mod and their block, the host mod_args. Compile
    errors of the user's functions surface here, before any output is allocated."""
    from flashcore import _mods

    from .masked_kernels import kernels

    mods = case.mods if case.mods is not None else _mods.Mods()
    args = tuple(_interop.host_view(a, case.library) for a in case.mod_args)
    score_mod = mask_mod = None
    if mods.score_mod is not None:
        score_mod = _mods.checked("score_mod", mods.score_mod, (numba_float64(),), args)
    if mods.mask_mod is not None:
        mask_mod = _mods.checked("mask_mod", mods.mask_mod, (), args)
    left, right = mods.window_ints
    opts = (case.causal, left, right, mods.softcap or 0.0, mods.alibi is not None)
    alibi = (np.zeros((1, 1), np.float32) if mods.alibi is None else
             np.ascontiguousarray(_interop.host_view(case.alibi_slopes, case.library),
                                  np.float32).reshape(-1, case.heads_q))
    if mask_mod is None:
        classes, block = np.full((1, 1, 1, 1), _mods.FULL, np.int8), 1 << 40
    elif mods.block_mask is not None:
        classes, block = mods.block_mask.classes, mods.block_mask.block
    else:
        lengths = None
        if case.varlen is not None:  # (each sequence's mask asked inside its own ends)
            from flashcore._packed_checks import sequence_lengths

            lengths = sequence_lengths(case.varlen, case.library)
        classes = _mods.block_classes(mods.mask_mod, case.batch, case.heads_q, case.seqlen_q,
                                      case.seqlen_k, _mods.BLOCK, args, remember=True,
                                      lengths=lengths)
        block = _mods.BLOCK
    fast_tanh = _work(case).itemsize == 4  # (float32 kernels: scalar.tanh_f32 for tanh)
    return kernels(score_mod, mask_mod, fast_tanh), opts, alibi, classes, block, args


def numba_float64():
    from numba import types

    return types.float64


_NO_ROWS = np.zeros(0, np.int64)
_NO_TABLE = np.zeros((0, 0), np.int64)


def dense_rows(case):
    """The masked kernels' ``seqs``, ``sizes`` and ``pages`` for a dense batch: no offsets,
    no page table (one sequence per batch entry, every row of it)."""
    return ((_NO_ROWS, _NO_ROWS, _NO_ROWS), (case.batch, case.seqlen_q, case.seqlen_k),
            (_NO_TABLE, 1))


def _masked_forward(q, k, v, case):
    made, opts, alibi, classes, block, args = _mod_inputs(case)
    tiles = choose_tiles(case.head_dim, case.dtype, case.causal)
    qk, kk, vk = (_kernel_view(x, case) for x in (q, k, v))
    o, ok = _alloc_like(q, case)
    lse = _empty((case.batch, case.heads_q, case.seqlen_q), _rules.lse_dtype(case.dtype))
    if o.size or lse.size:
        import numba

        n_tiles = case.batch * case.heads_q * -(-case.seqlen_q // tiles.block_q)
        per_job = q_tiles_per_job(n_tiles, numba.get_num_threads(), tiles.block_q)
        made[0](qk, kk, vk, ok, lse, case.scale, tiles.block_q, tiles.block_k, per_job,
                _work(case), opts, alibi, classes, block, args, *dense_rows(case), 1)
    return _give(o, case), _give(lse, case)


def _masked_backward(do, q, k, v, o, lse, case):
    from .backward_kernels import attn_backward_preprocess
    from .masked_kernels import run_backward

    made, opts, alibi, classes, block, args = _mod_inputs(case)
    tiles = choose_tiles(case.head_dim, case.dtype, case.causal)
    dok, qk, kk, vk, ok = (_kernel_view(x, case) for x in (do, q, k, v, o))
    lse_h = np.ascontiguousarray(_interop.host_view(lse, case.library),
                                 dtype=_rules.lse_dtype(case.dtype))
    dq, dqk = _alloc_like(q, case)
    dk, dkk = _alloc_like(k, case)
    dv, dvk = _alloc_like(v, case)
    work = _work(case)
    delta = np.empty((case.batch, case.heads_q, case.seqlen_q), work)
    if qk.size:
        attn_backward_preprocess(dok, ok, delta, work)
    run_backward(made, dok, qk, kk, vk, lse_h, delta, dqk, dkk, dvk, case.scale,
                 tiles.bwd_block_q, tiles.bwd_block_k, work, opts, alibi, classes, block, args,
                 *dense_rows(case)[:2])
    return _give(dq, case), _give(dk, case), _give(dv, case)
