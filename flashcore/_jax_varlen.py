"""JAX glue of the packed calls: varlen behind a ``jax.custom_vjp``, and the KV cache as a
pure function that returns the updated caches.

The kernels run on the host through ``jax.pure_callback`` (NumPy views of the operands; the
backend is the one chosen at trace time, numba_cpu for CPU arrays): they work eagerly and
under ``jit``. Arguments are checked where the call is written, on zero-byte stand-ins of
the arrays; under ``jit`` the values of the offsets, lengths and page table are checked
when the callback runs.

JAX arrays are immutable, so ``attention_with_kvcache`` cannot write into the caches: JAX
itself scatters the new keys into copies (``k_cache.at[...].set(k)``, which XLA does in
place when the old cache is donated or dead) and the call returns ``(o, k_cache, v_cache)``.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from . import _dispatch
from ._mods import options as _options
from ._packed_checks import make_kvcache_case, make_varlen_case
from ._rules import lse_dtype


def _stand_in(x):
    return np.broadcast_to(np.zeros((), dtype=np.dtype(x.dtype)), tuple(x.shape))


def _concrete(*xs):
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def _small(x, concrete):
    """An index array as the checks read it: its values when known, else a stand-in."""
    if x is None:
        return None
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


def _stand_in_options(options, concrete):
    if options is None:
        return None
    out = dict(options)
    if out["alibi_slopes"] is not None:
        out["alibi_slopes"] = _stand_in(out["alibi_slopes"])
    out["mod_args"] = tuple(_stand_in(a) for a in out["mod_args"])
    return out


def _select(case, backend):
    device = "cpu" if jax.default_backend() == "cpu" else "cuda:0"
    return _dispatch.select(replace(case, library="jax", device=device), backend).NAME


def _lse_type(shape, q):
    return jax.ShapeDtypeStruct(shape, np.dtype(lse_dtype(jnp.dtype(q.dtype).name)))


# --- varlen -------------------------------------------------------------------------------


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
           causal=False, window=None, softcap=None, alibi_slopes=None, score_mod=None,
           mask_mod=None, mod_args=(), scale=None, backend="auto"):
    """Differentiable, jit-able varlen forward for JAX arrays: ``(o, lse)``."""
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, None)
    concrete = _concrete(cu_seqlens_q, cu_seqlens_k)
    case = make_varlen_case(
        _stand_in(q), _stand_in(k), _stand_in(v), _small(cu_seqlens_q, concrete),
        _small(cu_seqlens_k, concrete), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, scale=scale, need_lse=True, explicit=backend != "auto",
        options=_stand_in_options(options, concrete), values=concrete)
    name = _select(case, backend)
    static, arrays = _split(options)
    f = _varlen_fn((max_seqlen_q, max_seqlen_k, causal, case.scale, name, static))
    o, lse = f(q, k, v, cu_seqlens_q, cu_seqlens_k, *arrays)
    return o, jax.lax.stop_gradient(lse)


@functools.cache
def _varlen_fn(static):
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

    @jax.custom_vjp
    def f(q, k, v, cq, ck, *arrays):
        return call_fwd(q, k, v, cq, ck, *arrays)

    def f_fwd(q, k, v, cq, ck, *arrays):
        o, lse = call_fwd(q, k, v, cq, ck, *arrays)
        return (o, lse), (q, k, v, o, lse, cq, ck, arrays)

    def f_bwd(res, cts):
        do, _ = cts  # lse leaves through stop_gradient
        q, k, v, o, lse, cq, ck, arrays = res
        types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        grads = jax.pure_callback(bwd_host, types, do, q, k, v, o, lse, cq, ck, *arrays,
                                  vmap_method="sequential")
        return (*grads, *(_no_cotangent(x) for x in (cq, ck, *arrays)))

    f.defvjp(f_fwd, f_bwd)
    return f


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
        _stand_in(q), stand(k_cache), stand(v_cache), _small(cache_seqlens, concrete), stand(k),
        stand(v), _small(block_table, concrete), causal=causal, scale=scale,
        num_splits=num_splits, need_lse=True, explicit=backend != "auto",
        options=_stand_in_options(options, concrete), values=concrete, in_place=False)
    name = _select(case, backend)
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
        lengths = lengths + kv.n_new
    static, arrays = _split(options)
    f = _kvcache_fn((causal, case.scale, num_splits, name, static, block_table is not None))
    table = () if block_table is None else (block_table,)
    o, lse = f(q, k_cache, v_cache, lengths, *table, *arrays)
    return (o, lse, k_cache, v_cache) if return_lse else (o, k_cache, v_cache)


@functools.cache
def _kvcache_fn(static):
    causal, scale, num_splits, name, mods, paged = static

    def host(q, kc, vc, lengths, *rest):
        q, kc, vc, lengths = (np.asarray(x) for x in (q, kc, vc, lengths))
        table = np.asarray(rest[0]) if paged else None
        arrays = [np.asarray(a) for a in rest[1 if paged else 0:]]
        case = make_kvcache_case(q, kc, vc, lengths, None, None, table, causal=causal,
                                 scale=scale, num_splits=num_splits, need_lse=True,
                                 explicit=True, options=_join(mods, arrays))
        o, lse = _dispatch.select(case, name).forward(q, kc, vc, case)
        return np.asarray(o, q.dtype), np.asarray(lse)

    def f(q, kc, vc, lengths, *rest):
        B, Nq, Hq, _ = q.shape
        types = (jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_type((B, Hq, Nq), q))
        return jax.pure_callback(host, types, q, kc, vc, lengths, *rest,
                                 vmap_method="sequential")

    return f
