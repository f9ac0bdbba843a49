"""The reference backend: attention in plain Array API code, in float64 where the library has it.

It is the test oracle and an explicit fallback for any Array API library. It materializes
the ``(B, H, Nq, Nk)`` score matrix, so "auto" gives it only small inputs.
"""
from __future__ import annotations

import math

from . import _rules

NAME = "reference"
#: "auto" declines the reference beyond this many score elements (B * Hq * Nq * Nk).
AUTO_MAX_SCORES = 1 << 22


def unavailable_reason():
    return None


def supports(case):
    n = case.batch * case.heads_q * case.seqlen_q * case.seqlen_k
    if not case.explicit and n > AUTO_MAX_SCORES:
        return (f"it materializes B*Hq*Nq*Nk = {n} scores (auto allows {AUTO_MAX_SCORES}); "
                "name backend='reference' to use it anyway")
    return None


def _namespace(x):
    import array_api_compat as aac

    return aac.array_namespace(x), aac.device(x)


def _compute_dtype(xp, x):
    """float64 where the library computes it (JAX without x64 silently gives float32)."""
    try:
        if xp.astype(x[..., :0], xp.float64).dtype == xp.float64:
            return xp.float64
    except Exception:  # a namespace or device without float64
        pass
    return xp.float32


def _to_bhnd(xp, x, layout, ct):
    x = xp.astype(x, ct)
    return x if layout == "bhnd" else xp.permute_dims(x, (0, 2, 1, 3))


def _from_bhnd(xp, x, layout, dtype):
    x = x if layout == "bhnd" else xp.permute_dims(x, (0, 2, 1, 3))
    return xp.astype(x, dtype)


def _grouped(xp, x, case, heads):
    """(B, H, N, D) -> (B, Hkv, H // Hkv, N, D): the query heads of one key/value head together."""
    B, _, N, D = x.shape
    return xp.reshape(x, (B, case.heads_kv, heads // case.heads_kv, N, D))


def _probabilities(xp, dev, q, k, case, lse=None):
    """Scaled scores with the causal mask; returns (P, lse) with P = exp(S - lse), rows that
    see no key giving P = 0 and lse = -inf."""
    qg = _grouped(xp, q, case, case.heads_q)
    kg = _grouped(xp, k, case, case.heads_kv)
    s = xp.matmul(qg, xp.permute_dims(kg, (0, 1, 2, 4, 3))) * case.scale
    seen = _rules.visible(xp, case.seqlen_q, case.seqlen_k, case.causal, dev)
    if seen is not None:
        s = xp.where(seen, s, -math.inf)
    if lse is None:
        m = xp.max(s, axis=-1, keepdims=True) if case.seqlen_k else xp.full(
            (*s.shape[:-1], 1), -math.inf, dtype=s.dtype, device=dev)
        m = xp.where(xp.isinf(m) & (m < 0), xp.zeros_like(m), m)
        total = xp.sum(xp.exp(s - m), axis=-1, keepdims=True)
        seen = total > 0
        lse = xp.where(seen, xp.log(xp.where(seen, total, xp.ones_like(total))) + m,
                       xp.full_like(total, -math.inf))
    else:
        lse = xp.reshape(xp.astype(lse, s.dtype), (*s.shape[:-1], 1))
    empty = xp.isinf(lse) & (lse < 0)
    p = xp.where(empty, xp.zeros_like(s), xp.exp(s - xp.where(empty, xp.zeros_like(lse), lse)))
    return p, lse


def forward(q, k, v, case):
    xp, dev = _namespace(q)
    ct = _compute_dtype(xp, q)
    qb, kb, vb = (_to_bhnd(xp, x, case.layout, ct) for x in (q, k, v))
    p, lse = _probabilities(xp, dev, qb, kb, case)
    o = xp.matmul(p, _grouped(xp, vb, case, case.heads_kv))
    B, Hq, Nq = case.batch, case.heads_q, case.seqlen_q
    o = xp.reshape(o, (B, Hq, Nq, case.head_dim))
    return _from_bhnd(xp, o, case.layout, q.dtype), xp.astype(xp.reshape(lse, (B, Hq, Nq)), xp.float32)


def backward(do, q, k, v, o, lse, case):
    xp, dev = _namespace(q)
    ct = _compute_dtype(xp, q)
    qb, kb, vb, ob, dob = (_to_bhnd(xp, x, case.layout, ct) for x in (q, k, v, o, do))
    p, _ = _probabilities(xp, dev, qb, kb, case, lse=lse)
    dog = _grouped(xp, dob, case, case.heads_q)
    qg = _grouped(xp, qb, case, case.heads_q)
    kg = _grouped(xp, kb, case, case.heads_kv)
    vg = _grouped(xp, vb, case, case.heads_kv)
    t = lambda x: xp.permute_dims(x, (0, 1, 2, 4, 3))  # noqa: E731
    dv = xp.sum(xp.matmul(t(p), dog), axis=2)
    dp = xp.matmul(dog, t(vg))
    delta = xp.sum(dog * _grouped(xp, ob, case, case.heads_q), axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = xp.matmul(ds, kg) * case.scale
    dk = xp.sum(xp.matmul(t(ds), qg), axis=2) * case.scale
    B, D = case.batch, case.head_dim
    dq = xp.reshape(dq, (B, case.heads_q, case.seqlen_q, D))
    return tuple(_from_bhnd(xp, x, case.layout, q.dtype) for x in (dq, dk, dv))
