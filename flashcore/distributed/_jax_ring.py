"""Ring attention in JAX: inside ``shard_map``, the sequence axis sharded over ``axis_name``.

The same ring as the torch one (``_torch_ring``): W unrolled steps, the key/value block
moving one device on by ``lax.ppermute`` (XLA schedules the transfer beside the step's
kernel), partial outputs merged by lse, and a ``custom_vjp`` whose backward is a second ring
carrying float32 dK/dV (float64 for float64 inputs, as lse) home with their block. Shards
are equal (``shard_map`` cuts equal pieces), so every step's shapes are static; which part
of a block a device computes depends on its index, a traced value, so each step is a
``lax.cond`` between the two parts its devices may need (contiguous causal: all or nothing; balanced: the block's first chunk for
all queries, or all of it for the second query chunk).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax import lax

from .. import _jax_ops


def _axis_size(axis_name):
    size = getattr(lax, "axis_size", None)
    if size is not None:
        return int(size(axis_name))
    return int(lax.psum(1, axis_name))


class _Cfg(tuple):
    """Static configuration (hashable, for custom_vjp's nondiff argument)."""

    __slots__ = ()

    def __new__(cls, axis_name, world, causal, scale, layout, balanced, backend):
        return super().__new__(cls, (axis_name, world, causal, scale, layout, balanced,
                                     backend))

    axis_name = property(lambda s: s[0])
    world = property(lambda s: s[1])
    causal = property(lambda s: s[2])
    scale = property(lambda s: s[3])
    layout = property(lambda s: s[4])
    balanced = property(lambda s: s[5])
    backend = property(lambda s: s[6])


def _ax(cfg):
    return 2 if cfg.layout == "bhnd" else 1


def _calls(q, k, v, causal, cfg):
    """``(forward, backward)`` of flashcore's kernels for blocks shaped like q, k, v."""
    entries = _jax_ops.plan(q, k, v, causal, cfg.scale, cfg.layout, cfg.backend)

    def one(case, impl):
        if impl.NAME in _jax_ops._TRACEABLE:
            fcase = replace(case, need_lse=True)
            bcase = replace(case, direction="backward")
            return (lambda q, k, v: impl.forward(q, k, v, fcase),
                    lambda *a: impl.backward(*a, bcase))
        return _jax_ops.numba_calls(impl.NAME, case)

    if len(entries) == 1:
        return one(*entries[0][1:])
    pairs = {p: one(case, impl) for p, case, impl in entries}
    fwd = lambda *a: lax.platform_dependent(*a, **{p: f for p, (f, _) in pairs.items()})  # noqa
    bwd = lambda *a: lax.platform_dependent(*a, **{p: b for p, (_, b) in pairs.items()})  # noqa
    return fwd, bwd


def _rows(x, ax, start, stop):
    return lax.slice_in_dim(x, start, stop, axis=ax)


def _parts(cfg, n):
    """The parts a step may compute, as (q rows, kv rows, causal) of static slices:
    ``whole``, ``diag`` (own block, causal), ``first_kv`` and ``second_q`` (balanced)."""
    h = n // 2
    return {"whole": ((0, n), (0, n), False), "diag": ((0, n), (0, n), True),
            "first_kv": ((0, n), (0, h), False), "second_q": ((h, n), (0, n), False)}


def _step_choice(cfg, s, rank):
    """``(part if the predicate holds, part otherwise, predicate)`` of step ``s`` (the
    source is device ``rank - s``, earlier than us when ``rank >= s``); None: skip."""
    if not cfg.causal:
        return "whole", "whole", None
    if s == 0:
        return "diag", "diag", None
    if cfg.balanced:
        return "first_kv", "second_q", rank >= s
    return "whole", None, rank >= s


def _acc(x):
    """The dtype the ring accumulates o, lse and the gradients in: float64 for float64
    inputs (as the kernels' lse), float32 otherwise."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _fwd_part(q, k, v, part, cfg):
    """(o, lse) of the part, spread over all local rows (zeros, -inf elsewhere)."""
    ax = _ax(cfg)
    n = q.shape[ax]
    (qa, qb), (ka, kb), causal = _parts(cfg, n)[part]
    qs, ks, vs = _rows(q, ax, qa, qb), _rows(k, ax, ka, kb), _rows(v, ax, ka, kb)
    fwd, _ = _calls(qs, ks, vs, causal, cfg)
    o, lse = fwd(qs, ks, vs)
    o = o.astype(_acc(q))
    if (qa, qb) != (0, n):
        pad = [(0, 0)] * 4
        pad[ax] = (qa, n - qb)
        o = jnp.pad(o, pad)
        lse = jnp.pad(lse, ((0, 0), (0, 0), (qa, n - qb)), constant_values=-jnp.inf)
    return o, lse


def _skip_fwd(q, cfg):
    B, Hq = q.shape[0], q.shape[1 if cfg.layout == "bhnd" else 2]
    n = q.shape[_ax(cfg)]
    return jnp.zeros(q.shape, _acc(q)), jnp.full((B, Hq, n), -jnp.inf, _acc(q))


def _merge(o, lse, o_b, lse_b, cfg):
    new = jnp.logaddexp(lse, lse_b)
    empty = jnp.isneginf(new)
    safe = jnp.where(empty, 0.0, new)
    w_old = jnp.where(empty, 0.0, jnp.exp(lse - safe))
    w_new = jnp.where(empty, 0.0, jnp.exp(lse_b - safe))
    expand = (lambda w: w[..., None]) if cfg.layout == "bhnd" else (
        lambda w: jnp.swapaxes(w, 1, 2)[..., None])
    return o * expand(w_old) + o_b * expand(w_new), new


def _varying(x, axis_name):
    """``x`` typed as varying over the axis (shard_map's checks want a branch's, a custom
    VJP's and its cotangents' types to agree; zeros made here are otherwise invariant)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return x
    aval = typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10: aval.mat.varying; before: aval.vma
    varying = mat.varying if mat is not None else getattr(aval, "vma", None)
    if varying is None or axis_name in varying:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axis_name, to="varying")
    return lax.pvary(x, axis_name)


def _choose(cfg, pred, then, other, *args):
    vary = lambda f: (lambda *a: tuple(_varying(x, cfg.axis_name) for x in f(*a)))  # noqa
    if pred is None:
        return vary(then)(*args)
    return lax.cond(pred, vary(then), vary(other), *args)


def _shift(cfg, *xs):
    perm = [(i, (i + 1) % cfg.world) for i in range(cfg.world)]
    return tuple(lax.ppermute(x, cfg.axis_name, perm) for x in xs)


def _ring_forward(q, k, v, cfg):
    rank = lax.axis_index(cfg.axis_name)
    o, lse = (_varying(x, cfg.axis_name) for x in _skip_fwd(q, cfg))
    for s in range(cfg.world):
        then, other, pred = _step_choice(cfg, s, rank)
        run = lambda part: (lambda q, k, v: _fwd_part(q, k, v, part, cfg))  # noqa: E731
        skip = lambda q, k, v: _skip_fwd(q, cfg)  # noqa: E731
        o_b, lse_b = _choose(cfg, pred, run(then), skip if other is None else run(other),
                             q, k, v)
        o, lse = _merge(o, lse, o_b, lse_b, cfg)
        if s < cfg.world - 1:
            k, v = _shift(cfg, k, v)
    return o.astype(q.dtype), lse


def _bwd_part(do, q, k, v, o, lse, part, cfg):
    """(dq, dk, dv) in the accumulator dtype (_acc) of the part, spread over all local rows."""
    ax = _ax(cfg)
    n = q.shape[ax]
    (qa, qb), (ka, kb), causal = _parts(cfg, n)[part]
    r = lambda x, a, b: _rows(x, ax, a, b)  # noqa: E731
    qs, ks, vs = r(q, qa, qb), r(k, ka, kb), r(v, ka, kb)
    _, bwd = _calls(qs, ks, vs, causal, cfg)
    dq, dk, dv = bwd(r(do, qa, qb), qs, ks, vs, r(o, qa, qb), lse[:, :, qa:qb])

    def spread(x, a, b):
        x = x.astype(_acc(x))
        if (a, b) == (0, n):
            return x
        pad = [(0, 0)] * 4
        pad[ax] = (a, n - b)
        return jnp.pad(x, pad)

    return spread(dq, qa, qb), spread(dk, ka, kb), spread(dv, ka, kb)


def _ring_backward(do, q, k, v, o, lse, cfg):
    rank = lax.axis_index(cfg.axis_name)
    dq, dk, dv = (_varying(jnp.zeros(x.shape, _acc(x)), cfg.axis_name) for x in (q, k, v))
    zeros = lambda *a: tuple(jnp.zeros(x.shape, _acc(x)) for x in (q, k, v))  # noqa: E731
    for s in range(cfg.world):
        then, other, pred = _step_choice(cfg, s, rank)
        run = lambda part: (lambda *a: _bwd_part(*a, part, cfg))  # noqa: E731
        dq_b, dk_b, dv_b = _choose(cfg, pred, run(then),
                                   zeros if other is None else run(other), do, q, k, v, o, lse)
        dq, dk, dv = dq + dq_b, dk + dk_b, dv + dv_b
        # The block moves on with its dK/dV; after W moves both are home.
        k, v, dk, dv = _shift(cfg, k, v, dk, dv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, cfg):
    return _ring_forward(q, k, v, cfg)


def _ring_fwd(q, k, v, cfg):
    o, lse = _ring_forward(q, k, v, cfg)
    return (o, lse), (q, k, v, o, lse)


def _ring_bwd(cfg, res, cts):
    do, _ = cts  # lse leaves through stop_gradient
    return tuple(_varying(x, cfg.axis_name) for x in _ring_backward(do, *res, cfg))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name, causal=False, scale=None, layout="bhnd",
                   balanced=True, return_lse=False, backend="auto"):
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"{layout=} is not one of ('bhnd', 'bnhd')")
    world = _axis_size(axis_name)
    ax = 2 if layout == "bhnd" else 1
    n = q.shape[ax]
    if k.shape[ax] != n:
        raise ValueError(f"ring attention is self-attention over one sequence: q and k "
                         f"must hold the same tokens; got {n} and {k.shape[ax]} per shard")
    if balanced and causal and n % 2:
        raise ValueError(f"balanced order gives each shard two equal chunks: the local "
                         f"sequence ({n} tokens) must be even (N divisible by 2W)")
    if scale is None:
        scale = 1.0 / float(q.shape[-1]) ** 0.5
    cfg = _Cfg(axis_name, world, bool(causal), float(scale), layout, bool(balanced), backend)
    o, lse = _ring(q, k, v, cfg)
    lse = lax.stop_gradient(lse)
    return (o, lse) if return_lse else o
