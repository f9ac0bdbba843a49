"""The reference backend: attention in plain Array API code, in float64 where the library has it.

It is the test oracle and an explicit fallback for any Array API library. It materializes
the ``(B, H, Nq, Nk)`` score matrix, so "auto" gives it only small inputs.
"""
from __future__ import annotations

import math

import numpy as np

from . import _rules

NAME = "reference"
#: "auto" declines the reference beyond this many score elements (B * Hq * Nq * Nk).
AUTO_MAX_SCORES = 1 << 22


def unavailable_reason():
    return None


def supports(case):
    # For packed calls an upper bound: every sequence as long as the longest.
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
    """Scaled scores, modified and masked; returns (P, lse, g) with P = exp(S - lse), rows
    that see no key giving P = 0 and lse = -inf (rows with a NaN score: NaN), and g the derivative of the final score
    in the scaled one (None where it is 1)."""
    qg = _grouped(xp, q, case, case.heads_q)
    kg = _grouped(xp, k, case, case.heads_kv)
    s = xp.matmul(qg, xp.permute_dims(kg, (0, 1, 2, 4, 3))) * case.scale
    g = None
    if case.mods is not None:
        s, g, seen = _modified(xp, dev, s, case)
    else:
        seen = _rules.visible(xp, case.seqlen_q, case.seqlen_k, case.causal, dev)
    if seen is not None:
        s = xp.where(seen, s, -math.inf)
    if lse is None:
        m = xp.max(s, axis=-1, keepdims=True) if case.seqlen_k else xp.full(
            (*s.shape[:-1], 1), -math.inf, dtype=s.dtype, device=dev)
        m = xp.where(xp.isinf(m) & (m < 0), xp.zeros_like(m), m)
        total = xp.sum(xp.exp(s - m), axis=-1, keepdims=True)
        # Only a row that sees no key sums to 0; a NaN score (in its query or in a key it
        # sees) makes the sum NaN, and lse, P and the row's output NaN, as in the kernels.
        empty = total == 0
        lse = xp.where(empty, xp.full_like(total, -math.inf),
                       xp.log(xp.where(empty, xp.ones_like(total), total)) + m)
    else:
        lse = xp.reshape(xp.astype(lse, s.dtype), (*s.shape[:-1], 1))
    empty = xp.isinf(lse) & (lse < 0)
    p = xp.where(empty, xp.zeros_like(s), xp.exp(s - xp.where(empty, xp.zeros_like(lse), lse)))
    return p, lse, g


def _modified(xp, dev, s, case):
    """The score modifiers and masks of ``case.mods`` on grouped scores ``s``
    (B, Hkv, G, Nq, Nk), in the order flashcore._mods states. Returns (s, g, seen): the
    modified scores, their derivative in the scaled score (None: 1) and the visibility
    (None: all). User functions run as plain Python, one call per element, on the host."""
    mods, B, G = case.mods, case.batch, case.group
    Nq, Nk = case.seqlen_q, case.seqlen_k
    ip = xp.reshape(xp.arange(Nq, device=dev), (Nq, 1)) + (Nk - Nq)
    j = xp.reshape(xp.arange(Nk, device=dev), (1, Nk))
    g = None
    if mods.softcap is not None:
        t = xp.tanh(s / mods.softcap)
        s = t * mods.softcap
        g = 1 - t * t
    if mods.alibi is not None:
        slopes = xp.astype(case.alibi_slopes, s.dtype)
        slopes = xp.reshape(slopes, (-1, case.heads_kv, G, 1, 1))
        s = s - slopes * xp.astype(xp.abs(ip - j), s.dtype)
    seen = _rules.visible(xp, Nq, Nk, case.causal, dev)
    if mods.window is not None:
        left, right = mods.window
        inside = xp.ones((Nq, Nk), dtype=xp.bool, device=dev)
        if left is not None:
            inside = inside & (j >= ip - left)
        if right is not None:
            inside = inside & (j <= ip + right)
        seen = inside if seen is None else seen & inside
    if mods.score_mod is not None or mods.mask_mod is not None:
        from . import _interop

        args = tuple(_interop.copy_to_host(a, case.library) for a in case.mod_args)
        b_, h_, i_, j_ = (np.arange(n).reshape(shape) for n, shape in (
            (B, (B, 1, 1, 1, 1)), (case.heads_q, (1, case.heads_kv, G, 1, 1)),
            (Nq, (1, 1, 1, Nq, 1)), (Nk, (1, 1, 1, 1, Nk))))
        if mods.score_mod is not None:
            f = np.frompyfunc(lambda x, b, h, i, j: mods.score_mod(x, b, h, i, j, *args), 5, 1)
            x = np.asarray(_interop.copy_to_host(s, case.library), np.float64)
            out = np.asarray(f(x, b_, h_, i_, j_), np.float64)
            d = _fd_derivative(f, x, (b_, h_, i_, j_))
            s = xp.asarray(out, device=dev)
            d = xp.asarray(d, device=dev)
            g = d if g is None else g * d
        if mods.mask_mod is not None:
            f = np.frompyfunc(lambda b, h, i, j: bool(mods.mask_mod(b, h, i, j, *args)), 4, 1)
            shown = xp.asarray(np.broadcast_to(np.asarray(f(b_, h_, i_, j_), bool),
                                               (B, case.heads_kv, G, Nq, Nk)), device=dev)
            seen = shown if seen is None else seen & shown
    return s, g, seen


def _fd_derivative(f, x, idx):
    """d f / d x by the fourth-order central difference of flashcore._mods (float64);
    0 where it is not finite (a mod that masks by returning -inf)."""
    from ._mods import FD_STEP

    h = FD_STEP * np.maximum(1.0, np.abs(x))
    at = lambda t: np.asarray(f(x + t * h, *idx), np.float64)  # noqa: E731
    with np.errstate(invalid="ignore"):
        d = (8 * (at(1) - at(-1)) - (at(2) - at(-2))) / (12 * h)
    return np.where(np.isfinite(d), d, 0.0)


def forward(q, k, v, case):
    if case.varlen is not None:
        return _varlen_forward(q, k, v, case)
    if case.kvcache is not None:
        return _kvcache_forward(q, k, v, case)
    xp, dev = _namespace(q)
    ct = _compute_dtype(xp, q)
    qb, kb, vb = (_to_bhnd(xp, x, case.layout, ct) for x in (q, k, v))
    p, lse, _ = _probabilities(xp, dev, qb, kb, case)
    o = xp.matmul(p, _grouped(xp, vb, case, case.heads_kv))
    B, Hq, Nq = case.batch, case.heads_q, case.seqlen_q
    o = xp.reshape(o, (B, Hq, Nq, case.head_dim))
    lse = xp.astype(xp.reshape(lse, (B, Hq, Nq)), getattr(xp, _rules.lse_dtype(case.dtype)))
    return _from_bhnd(xp, o, case.layout, q.dtype), lse


def backward(do, q, k, v, o, lse, case):
    if case.varlen is not None:
        return _varlen_backward(do, q, k, v, o, lse, case)
    xp, dev = _namespace(q)
    ct = _compute_dtype(xp, q)
    qb, kb, vb, ob, dob = (_to_bhnd(xp, x, case.layout, ct) for x in (q, k, v, o, do))
    p, _, g = _probabilities(xp, dev, qb, kb, case, lse=lse)
    dog = _grouped(xp, dob, case, case.heads_q)
    qg = _grouped(xp, qb, case, case.heads_q)
    kg = _grouped(xp, kb, case, case.heads_kv)
    vg = _grouped(xp, vb, case, case.heads_kv)
    t = lambda x: xp.permute_dims(x, (0, 1, 2, 4, 3))  # noqa: E731
    dv = xp.sum(xp.matmul(t(p), dog), axis=2)
    dp = xp.matmul(dog, t(vg))
    delta = xp.sum(dog * _grouped(xp, ob, case, case.heads_q), axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if g is not None:  # through the score modifiers (nothing flows where P = 0)
        ds = xp.where(p > 0, ds * g, xp.zeros_like(ds))
    dq = xp.matmul(ds, kg) * case.scale
    dk = xp.sum(xp.matmul(t(ds), qg), axis=2) * case.scale
    B, D = case.batch, case.head_dim
    dq = xp.reshape(dq, (B, case.heads_q, case.seqlen_q, D))
    return tuple(_from_bhnd(xp, x, case.layout, q.dtype) for x in (dq, dk, dv))


# --- packed calls: one dense call per sequence, on host float64 copies ------------------------
# Mods see the sequence as ``b`` and positions within the sequence as ``i``, ``j``: each
# sequence is a dense call of batch 1 whose mods are told the sequence index.


def _host64(x, case):
    from . import _interop

    return np.asarray(_interop.copy_to_host(x, case.library), dtype=np.float64)


def _give_back(x64, like, dtype=None):
    xp, dev = _namespace(like)
    out = xp.asarray(x64, device=dev) if dev is not None else xp.asarray(x64)
    return xp.astype(out, like.dtype if dtype is None else dtype)


def _at_sequence(fn, s, has_score):
    if fn is None:
        return None
    if has_score:
        return lambda x, b, h, i, j, *args: fn(x, s, h, i, j, *args)
    return lambda b, h, i, j, *args: fn(s, h, i, j, *args)


def _sequence_case(case, s, nq, nk):
    """The dense, batch-1, float64 NumPy Case of sequence ``s`` (``nq`` rows, ``nk`` keys)."""
    from dataclasses import replace

    from . import _interop
    from ._case import Case

    mods, extra = case.mods, {}
    if mods is not None:
        mods = replace(mods, score_mod=_at_sequence(mods.score_mod, s, True),
                       mask_mod=_at_sequence(mods.mask_mod, s, False), block_mask=None,
                       alibi=None if mods.alibi is None else (case.heads_q,))
        slopes = None
        if case.alibi_slopes is not None:
            a = np.asarray(_interop.copy_to_host(case.alibi_slopes, case.library))
            slopes = a.reshape(-1, case.heads_q)[s if a.ndim == 2 else 0]
        extra = {"alibi_slopes": slopes, "mod_args": tuple(
            _interop.copy_to_host(a, case.library) for a in case.mod_args)}
    return Case(library="numpy", device="cpu", dtype="float64", batch=1,
                heads_q=case.heads_q, heads_kv=case.heads_kv, seqlen_q=nq, seqlen_k=nk,
                head_dim=case.head_dim, causal=case.causal, scale=case.scale, layout="bnhd",
                explicit=True, mods=mods, **extra)


def _offsets(case):
    from ._packed_checks import host_ints

    return (host_ints(case.varlen.cu_seqlens_q, case.library),
            host_ints(case.varlen.cu_seqlens_k, case.library))


def _lse_dtype(xp, case):
    from ._rules import lse_dtype

    return getattr(xp, lse_dtype(case.dtype))


def _varlen_forward(q, k, v, case):
    cq, ck = _offsets(case)
    q64, k64, v64 = (_host64(x, case) for x in (q, k, v))
    o = np.zeros_like(q64)
    lse = np.full((case.heads_q, q64.shape[0]), -math.inf)
    for s in range(case.batch):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        sub = _sequence_case(case, s, rq.stop - rq.start, rk.stop - rk.start)
        os_, ls = forward(q64[None, rq], k64[None, rk], v64[None, rk], sub)
        o[rq], lse[:, rq] = os_[0], ls[0]
    xp, _ = _namespace(q)
    return _give_back(o, q), _give_back(lse, q, _lse_dtype(xp, case))


def _varlen_backward(do, q, k, v, o, lse, case):
    cq, ck = _offsets(case)
    do64, q64, k64, v64, o64, lse64 = (_host64(x, case) for x in (do, q, k, v, o, lse))
    dq, dk, dv = np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)
    for s in range(case.batch):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        sub = _sequence_case(case, s, rq.stop - rq.start, rk.stop - rk.start)
        g = backward(do64[None, rq], q64[None, rq], k64[None, rk], v64[None, rk],
                     o64[None, rq], lse64[None, :, rq], sub)
        dq[rq], dk[rk], dv[rk] = (x[0] for x in g)
    return _give_back(dq, q), _give_back(dk, k), _give_back(dv, v)


def _kvcache_forward(q, k_cache, v_cache, case):
    from . import _interop, _paging
    from ._packed_checks import host_ints

    kv = case.kvcache
    seqlens = host_ints(kv.cache_seqlens, case.library)
    table = None if kv.block_table is None else host_ints(kv.block_table, case.library)
    if kv.n_new:
        if case.library in ("numpy", "torch") and case.device == "cpu":
            # Host views share the caller's memory: the write is the caller's cache.
            kc, vc = (_interop.host_view(x, case.library) for x in (k_cache, v_cache))
            kn, vn = (_interop.host_view(x, case.library) for x in (kv.k_new, kv.v_new))
            _paging.append_in_place(kc, vc, kn, vn, seqlens, table, kv.page_size, np.asarray)
        else:
            xp, dev = _namespace(k_cache)
            _paging.append_in_place(k_cache, v_cache, kv.k_new, kv.v_new, seqlens, table,
                                    kv.page_size, lambda a: xp.asarray(a, device=dev))
    q64, kc64, vc64 = (_host64(x, case) for x in (q, k_cache, v_cache))
    B, Nq = case.batch, case.seqlen_q
    o = np.zeros_like(q64)
    lse = np.full((B, case.heads_q, Nq), -math.inf)
    for b in range(B):
        n = int(seqlens[b]) + kv.n_new
        kb, vb = (_paging.sequence_keys(c, b, n, table, kv.page_size) for c in (kc64, vc64))
        sub = _sequence_case(case, b, Nq, n)
        ob, lb = forward(q64[b:b + 1], kb[None], vb[None], sub)
        o[b], lse[b] = ob[0], lb[0]
    xp, _ = _namespace(q)
    return _give_back(o, q), _give_back(lse, q, _lse_dtype(xp, case))
