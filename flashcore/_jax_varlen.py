"""JAX glue of the packed calls: varlen behind a ``jax.custom_vjp``, and the KV cache as a
pure function that returns the updated caches.

On the host (numba_cpu for CPU arrays) the kernels run through ``jax.pure_callback`` on
NumPy views of the operands; on a GPU (numba_cuda) through ``jax.experimental.buffer_callback``
on XLA's own buffers and stream, as dense calls do (:mod:`flashcore._jax_ops`). Both work
eagerly and under ``jit``. Arguments are checked where the call is written, on zero-byte
stand-ins of the arrays; under ``jit`` the values of the offsets, lengths and page table
are checked when the callback runs (on a GPU it copies them to the host on XLA's stream
and waits: one synchronization per index array and call), before anything is written.

JAX arrays are immutable, so ``attention_with_kvcache`` cannot write into the caches the
caller holds: it returns ``(o, k_cache, v_cache)``. On the host JAX scatters the new keys
into copies (``k_cache.at[...].set(k)``, which XLA does in place when the old cache is
donated or dead). On a GPU the callback's cache outputs alias its cache inputs
(``input_output_aliases``) and numba_cuda's append kernel writes the new keys into them:
with the caches donated (``jax.jit(..., donate_argnums=...)``) nothing else is copied;
without, XLA first copies each cache into the output (one device copy of the whole cache
per call, at the copy bandwidth).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from . import _dispatch
from ._checks import check_array
from ._jax_ops import (
    _buffer_callback,
    _device,
    _Folded,
    _gpu_launcher,
    _stand_in,
    _stand_in_options,
    check_cpu_mods,
)
from ._mods import options as _options
from ._packed_checks import check_max_seqlen, make_kvcache_case, make_varlen_case
from ._rules import lse_dtype


def _concrete(*xs):
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def _small(x, concrete, name):
    """An index array as the checks read it: its values when known, else a stand-in (an
    array, as NumPy and torch calls require: a Python list is refused by ``name``)."""
    if x is None:
        return None
    check_array(name, x)
    return np.asarray(x) if concrete else _stand_in(x)


def _split(options):
    """(static part, arrays) of the options: the arrays travel as callback operands."""
    if options is None:
        return None, []
    static = tuple((n, options[n]) for n in ("window", "softcap", "score_mod", "mask_mod"))
    arrays = [] if options["alibi_slopes"] is None else [options["alibi_slopes"]]
    return (static, options["alibi_slopes"] is not None), arrays + list(options["mod_args"])


def _join(static, arrays):
    if static is None:
        return None
    pairs, has_alibi = static
    arrays = list(arrays)
    out = dict(pairs)
    out["alibi_slopes"] = arrays.pop(0) if has_alibi else None
    out["mod_args"] = tuple(arrays)
    out["block_mask"] = None
    return out


def _where(*xs):
    """``"cpu"``/``"cuda:N"``: the device of the first concrete array, else (traced arrays)
    the default backend's, where ``jit`` will run them."""
    for x in xs:
        d = None if x is None else _device(x)
        if d is not None:
            return d
    return "cpu" if jax.default_backend() == "cpu" else "cuda:0"


def _select(case, backend, device):
    """The name of the backend for ``case`` on ``device``, and whether it runs on XLA's
    buffers on a GPU (a backend with a ``buffer_launcher``) rather than on host copies."""
    impl = _dispatch.select(replace(case, library="jax", device=device), backend)
    on_buffers = device.startswith("cuda") and hasattr(impl, "buffer_launcher")
    return impl.NAME, on_buffers


def _lse_type(shape, q):
    return jax.ShapeDtypeStruct(shape, np.dtype(lse_dtype(jnp.dtype(q.dtype).name)))


# --- varlen -------------------------------------------------------------------------------


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
           causal=False, window=None, softcap=None, alibi_slopes=None, score_mod=None,
           mask_mod=None, mod_args=(), scale=None, backend="auto"):
    """Differentiable, jit-able varlen forward for JAX arrays: ``(o, lse)``."""
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, None)
    concrete = _concrete(cu_seqlens_q, cu_seqlens_k)
    if not concrete:  # (their values are checked against the offsets in the callback)
        check_max_seqlen("max_seqlen_q", max_seqlen_q, 0)
        check_max_seqlen("max_seqlen_k", max_seqlen_k, 0)
    case = make_varlen_case(
        _stand_in(q), _stand_in(k), _stand_in(v),
        _small(cu_seqlens_q, concrete, "cu_seqlens_q"),
        _small(cu_seqlens_k, concrete, "cu_seqlens_k"),
        max_seqlen_q=max_seqlen_q if concrete else None,
        max_seqlen_k=max_seqlen_k if concrete else None, causal=causal, scale=scale,
        need_lse=True, explicit=backend != "auto",
        options=_stand_in_options(options), values=concrete)
    where = _where(q, k, v)
    name, on_buffers = _select(case, backend, where)
    check_cpu_mods(name, case, where)
    static, arrays = _split(options)
    f = _varlen_fn((max_seqlen_q, max_seqlen_k, causal, case.scale, name, static, on_buffers))
    o, lse = f(q, k, v, cu_seqlens_q, cu_seqlens_k, *arrays)
    return o, jax.lax.stop_gradient(lse)


@functools.cache
def _varlen_fn(static):
    """The differentiable varlen call: a custom VJP around the forward and backward
    callbacks (on host copies, or on XLA's buffers on a GPU)."""
    calls = _varlen_gpu_calls if static[-1] else _varlen_host_calls
    call_fwd, call_bwd = calls(static[:-1])

    @jax.custom_vjp
    def f(q, k, v, cq, ck, *arrays):
        return call_fwd(q, k, v, cq, ck, *arrays)

    def f_fwd(q, k, v, cq, ck, *arrays):
        o, lse = call_fwd(q, k, v, cq, ck, *arrays)
        return (o, lse), (q, k, v, o, lse, cq, ck, arrays)

    def f_bwd(res, cts):
        do, _ = cts  # lse leaves through stop_gradient
        q, k, v, o, lse, cq, ck, arrays = res
        grads = call_bwd(do, q, k, v, o, lse, cq, ck, *arrays)
        return (*grads, *(_no_cotangent(x) for x in (cq, ck, *arrays)))

    f.defvjp(f_fwd, f_bwd)
    return f


def _varlen_host_calls(static):
    max_q, max_k, causal, scale, name, mods = static
    kw = {"max_seqlen_q": max_q, "max_seqlen_k": max_k, "causal": causal, "scale": scale,
          "explicit": True}

    def fwd_host(q, k, v, cq, ck, *arrays):
        q, k, v, cq, ck = (np.asarray(x) for x in (q, k, v, cq, ck))
        case = make_varlen_case(q, k, v, cq, ck, need_lse=True,
                                options=_join(mods, map(np.asarray, arrays)), **kw)
        o, lse = _dispatch.select(case, name).forward(q, k, v, case)
        return np.asarray(o, q.dtype), np.asarray(lse)

    def bwd_host(do, q, k, v, o, lse, cq, ck, *arrays):
        do, q, k, v, o, lse, cq, ck = (np.asarray(x) for x in (do, q, k, v, o, lse, cq, ck))
        case = make_varlen_case(q, k, v, cq, ck, direction="backward",
                                extra={"do": do, "o": o, "lse": lse},
                                options=_join(mods, map(np.asarray, arrays)), **kw)
        grads = _dispatch.select(case, name).backward(do, q, k, v, o, lse, case)
        return tuple(np.asarray(g, x.dtype) for g, x in zip(grads, (q, k, v)))

    def call_fwd(q, k, v, cq, ck, *arrays):
        types = (jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_type((q.shape[1], q.shape[0]), q))
        return jax.pure_callback(fwd_host, types, q, k, v, cq, ck, *arrays,
                                 vmap_method="sequential")

    def call_bwd(do, q, k, v, o, lse, cq, ck, *arrays):
        types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        return jax.pure_callback(bwd_host, types, do, q, k, v, o, lse, cq, ck, *arrays,
                                 vmap_method="sequential")

    return call_fwd, call_bwd


def _varlen_gpu_calls(static):
    """Forward and backward through ``buffer_callback``: numba_cuda's kernels on XLA's
    buffers and stream. The offsets are made int32 by XLA before the callback, which reads
    them to the host (the checks, and the longest sequence, which the case carries)."""
    max_q, max_k, causal, scale, name, mods = static
    buffer_callback = _buffer_callback()
    launcher = _gpu_launcher(name)
    kw = {"max_seqlen_q": max_q, "max_seqlen_k": max_k, "causal": causal, "scale": scale,
          "explicit": True}

    def host_case(run, q, k, v, cq, ck, arrays, **more):
        dev = q.__dlpack_device__()[1]
        cqv, ckv = (run.read(_Folded(x, 1), dev) for x in (cq, ck))
        case = make_varlen_case(_stand_in(q), _stand_in(k), _stand_in(v), cqv, ckv,
                                options=_join(mods, map(_stand_in, arrays)), **kw, **more)
        lent = replace(case.varlen, cu_seqlens_q=_Folded(cq, 1), cu_seqlens_k=_Folded(ck, 1))
        return _on_gpu(case, dev, mods, arrays, varlen=lent)

    def fwd_cb(ctx, out, q, k, v, cq, ck, *arrays):
        o, lse = out
        run = launcher([_Folded(o, 3), _Folded(lse, 2)], ctx.stream)
        case = host_case(run, q, k, v, cq, ck, arrays, need_lse=True)
        run.forward(_Folded(q, 3), _Folded(k, 3), _Folded(v, 3), case)

    def bwd_cb(ctx, out, do, q, k, v, o, lse, cq, ck, *arrays):
        dq, dk, dv, delta = out
        run = launcher([_Folded(dq, 3), _Folded(dk, 3), _Folded(dv, 3), _Folded(delta, 2)],
                       ctx.stream)
        extra = {"do": _stand_in(do), "o": _stand_in(o), "lse": _stand_in(lse)}
        case = host_case(run, q, k, v, cq, ck, arrays, direction="backward", extra=extra)
        run.backward(*(_Folded(x, 3) for x in (do, q, k, v, o)), _Folded(lse, 2), case)

    def call_fwd(q, k, v, cq, ck, *arrays):
        types = (jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_type((q.shape[1], q.shape[0]), q))
        fwd = buffer_callback(fwd_cb, types, vmap_method="sequential")
        return fwd(q, k, v, _int32(cq), _int32(ck), *arrays)

    def call_bwd(do, q, k, v, o, lse, cq, ck, *arrays):
        types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        # scratch: D = rowsum(dO * O), float32 (Hq, total_q), at least one column
        delta = jax.ShapeDtypeStruct((q.shape[1], max(1, q.shape[0])), np.float32)
        bwd = buffer_callback(bwd_cb, (*types, delta), vmap_method="sequential")
        dq, dk, dv, _ = bwd(do, q, k, v, o, lse, _int32(cq), _int32(ck), *arrays)
        return dq, dk, dv

    return call_fwd, call_bwd


def _int32(x):
    return jnp.asarray(x).astype(jnp.int32)


def _on_gpu(case, dev, mods, arrays, **packed):
    """The host-checked ``case`` (made on stand-ins) as the kernels take it: JAX on GPU
    ``dev``, with the lent buffers of the option arrays and the packed call's."""
    lent = {}
    if arrays:
        folded = [_Folded(a, len(a.shape)) for a in arrays]
        has_alibi = mods[1]
        lent = {"alibi_slopes": folded.pop(0) if has_alibi else None,
                "mod_args": tuple(folded)}
    return replace(case, library="jax", device=f"cuda:{dev}", **lent, **packed)


def _no_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


# --- KV cache -----------------------------------------------------------------------------


def kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *, causal, scale,
            num_splits, return_lse, backend, options):
    """``(o, k_cache, v_cache)`` (with lse after o when ``return_lse``): the caches with the
    new keys written, as new arrays."""
    concrete = _concrete(cache_seqlens, block_table)
    stand = lambda x: None if x is None else _stand_in(x)  # noqa: E731
    case = make_kvcache_case(
        _stand_in(q), stand(k_cache), stand(v_cache),
        _small(cache_seqlens, concrete, "cache_seqlens"), stand(k),
        stand(v), _small(block_table, concrete, "block_table"), causal=causal, scale=scale,
        num_splits=num_splits, need_lse=True, explicit=backend != "auto",
        options=_stand_in_options(options), values=concrete, in_place=False)
    where = _where(q, k_cache, v_cache)
    name, on_buffers = _select(case, backend, where)
    check_cpu_mods(name, case, where)
    static, arrays = _split(options)
    if on_buffers:
        f = _kvcache_gpu_fn((causal, case.scale, num_splits, name, static,
                             block_table is not None, case.kvcache.n_new, _split_room(case)))
        new = () if k is None else (k, v)
        table = () if block_table is None else (block_table,)
        o, lse, k_cache, v_cache = f(q, k_cache, v_cache, cache_seqlens, *new, *table, *arrays)
        return (o, lse, k_cache, v_cache) if return_lse else (o, k_cache, v_cache)
    kv = case.kvcache
    lengths = jnp.asarray(cache_seqlens)
    if k is not None:
        pos = lengths[:, None] + jnp.arange(kv.n_new, dtype=lengths.dtype)[None, :]
        if block_table is None:
            first = jnp.broadcast_to(jnp.arange(case.batch)[:, None], pos.shape)
            second = pos
        else:
            first = jnp.take_along_axis(jnp.asarray(block_table), pos // kv.page_size, axis=1)
            second = pos % kv.page_size
        k_cache = k_cache.at[first, second].set(k)
        v_cache = v_cache.at[first, second].set(v)
    f = _kvcache_fn((causal, case.scale, num_splits, name, static, block_table is not None,
                     kv.n_new))
    table = () if block_table is None else (block_table,)
    o, lse = f(q, k_cache, v_cache, lengths, *table, *arrays)
    return (o, lse, k_cache, v_cache) if return_lse else (o, k_cache, v_cache)


@functools.cache
def _kvcache_fn(static):
    """``f(q, k_cache, v_cache, cache_seqlens, [block_table], *option arrays) -> (o, lse)``
    on the host, the caches holding the ``n_new`` appended keys (written by XLA) and
    ``cache_seqlens`` the lengths before the append: the callback checks the append's
    values as an eager call does (lengths, pages written into), whose values a traced
    call's checks could not read, then attends over ``cache_seqlens + n_new`` keys."""
    causal, scale, num_splits, name, mods, paged, n_new = static

    def host(q, kc, vc, lengths, *rest):
        q, kc, vc, lengths = (np.asarray(x) for x in (q, kc, vc, lengths))
        table = np.asarray(rest[0]) if paged else None
        arrays = [np.asarray(a) for a in rest[1 if paged else 0:]]
        # checked with the lengths before the append and stand-ins of k and v (only their
        # shapes are read), then attended as a call without new keys over the lengths after
        new = np.empty((q.shape[0], n_new, *kc.shape[2:]), kc.dtype) if n_new else None
        case = make_kvcache_case(q, kc, vc, lengths, new, new, table, causal=causal,
                                 scale=scale, num_splits=num_splits, need_lse=True,
                                 explicit=True, options=_join(mods, arrays), in_place=False)
        if n_new:
            case = replace(case, kvcache=replace(case.kvcache, cache_seqlens=lengths + n_new,
                                                 n_new=0, k_new=None, v_new=None))
        o, lse = _dispatch.select(case, name).forward(q, kc, vc, case)
        return np.asarray(o, q.dtype), np.asarray(lse)

    def f(q, kc, vc, lengths, *rest):
        B, Nq, Hq, _ = q.shape
        types = (jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_type((B, Hq, Nq), q))
        return jax.pure_callback(host, types, q, kc, vc, lengths, *rest,
                                 vmap_method="sequential")

    return f


#: Split-KV partials lent to numba_cuda under ``jit`` are sized when the call is traced,
#: before the lengths are known (its heuristic needs the longest), so the glue lends room
#: for ``num_splits`` splits, or for 64 (the heuristic's ceiling) where it is 0, within
#: ``_SPLIT_WORDS`` float32 words: 32 MiB. The kernels use as many as their plan asks, at
#: most that many (``BufferLauncher.max_splits``); a decode step (B=8, Hq=32, D=128, one
#: row) gets its 64 (8 MiB), while a call with many rows, which fills the GPU without
#: splitting, gets few or none.
_SPLITS = 64
_SPLIT_WORDS = 1 << 23


def _split_room(case):
    rows = case.batch * case.heads_q * case.seqlen_q
    room = _SPLIT_WORDS // max(1, rows * (case.head_dim + 1))
    return max(1, min(case.kvcache.num_splits or _SPLITS, room, case.seqlen_k))


@functools.cache
def _kvcache_gpu_fn(static):
    """``f(q, k_cache, v_cache, cache_seqlens, [k, v], [block_table], *option arrays) ->
    (o, lse, k_cache, v_cache)`` on a GPU: one ``buffer_callback`` whose cache outputs
    alias its cache inputs, so numba_cuda's append kernel writes the new keys into the
    returned caches (in place when the caller donates them), then attends."""
    causal, scale, num_splits, name, mods, paged, n_new, room = static
    buffer_callback = _buffer_callback()
    launcher = _gpu_launcher(name)

    def cb(ctx, out, q, kc, vc, lengths, ends, *rest):
        o, lse, kc_out, vc_out, *parts = out
        run = launcher([_Folded(o, 4), _Folded(lse, 3), *(_Folded(p, len(p.shape))
                                                           for p in parts)], ctx.stream)
        dev = q.__dlpack_device__()[1]
        k, v = rest[:2] if n_new else (None, None)
        rest = rest[2:] if n_new else rest
        table, arrays = (rest[0], rest[1:]) if paged else (None, rest)
        lens = run.read(_Folded(lengths, 1), dev)
        case = make_kvcache_case(
            _stand_in(q), _stand_in(kc), _stand_in(vc), lens,
            *(None if x is None else _stand_in(x) for x in (k, v)),
            None if table is None else run.read(_Folded(table, 2), dev), causal=causal,
            scale=scale, num_splits=num_splits, need_lse=True, explicit=True,
            options=_join(mods, map(_stand_in, arrays)), in_place=False)
        lent = replace(case.kvcache, cache_seqlens=_Lengths(lengths, ends, n_new),
                       block_table=None if table is None else _Folded(table, 2),
                       k_new=None if k is None else _Folded(k, 4),
                       v_new=None if v is None else _Folded(v, 4))
        case = _on_gpu(case, dev, mods, arrays, kvcache=lent)
        run.forward(_Folded(q, 4), _Folded(kc_out, 4), _Folded(vc_out, 4), case)

    def f(q, kc, vc, cache_seqlens, *rest):
        B, Nq, Hq, D = q.shape
        types = [jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_type((B, Hq, Nq), q),
                 jax.ShapeDtypeStruct(kc.shape, kc.dtype),
                 jax.ShapeDtypeStruct(vc.shape, vc.dtype)]
        if room > 1:  # split-KV partials: (S, rows, D) outputs, (S, rows) lse
            types += [jax.ShapeDtypeStruct((room, B * Hq * Nq, D), np.float32),
                      jax.ShapeDtypeStruct((room, B * Hq * Nq), np.float32)]
        call = buffer_callback(cb, tuple(types), vmap_method="sequential",
                               input_output_aliases={1: 2, 2: 3})
        lengths = _int32(cache_seqlens)
        if paged:
            rest = (*rest[:2], _int32(rest[2]), *rest[3:]) if n_new else (
                _int32(rest[0]), *rest[1:])
        return tuple(call(q, kc, vc, lengths, lengths + n_new, *rest)[:4])

    return f


class _Lengths(_Folded):
    """``cache_seqlens`` lent to the kernels with ``cache_seqlens + n_new``, which XLA
    computed before the callback (``shifted``: see ``BufferLauncher.int32``)."""

    def __init__(self, buf, ends, n_new):
        super().__init__(buf, 1)
        self._ends, self._n_new = ends, n_new

    def shifted(self, n):
        if n != self._n_new:
            raise ValueError(f"lengths + {n} were not lent (only + {self._n_new})")
        return _Folded(self._ends, 1)
