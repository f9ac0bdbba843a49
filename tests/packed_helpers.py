"""Helpers of the varlen and KV-cache tests: packed inputs and a per-sequence float64
oracle built from slices and the dense reference (``flashcore.attention_forward`` /
``attention_backward`` with ``backend="reference"`` on one sequence at a time), so it shares
no code with the packed paths it checks."""
from __future__ import annotations

import numpy as np
from helpers import to64

import flashcore
from flashcore._interop import np_dtype


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lens_q, lens_k, Hq=4, Hkv=2, D=16, dtype="float64"):
    """q, k, v packed and their offsets."""
    tq, tk = int(sum(lens_q)), int(sum(lens_k))
    mk = lambda n, h: rng.standard_normal((n, h, D)).astype(np_dtype(dtype))  # noqa: E731
    return mk(tq, Hq), mk(tk, Hkv), mk(tk, Hkv), offsets(lens_q), offsets(lens_k)


def at_sequence(fn, s, score):
    """A mod of a batch-1 call that sees sequence ``s`` as its ``b``."""
    if fn is None:
        return None
    if score:
        return lambda x, b, h, i, j, *a: fn(x, s, h, i, j, *a)
    return lambda b, h, i, j, *a: fn(s, h, i, j, *a)


def sequence_options(opts, s):
    """The options of sequence ``s`` as one dense batch-1 call takes them."""
    out = dict(opts)
    if out.get("alibi_slopes") is not None:
        a = np.asarray(out["alibi_slopes"])
        out["alibi_slopes"] = a[s] if a.ndim == 2 else a
    out["score_mod"] = at_sequence(out.get("score_mod"), s, True)
    out["mask_mod"] = at_sequence(out.get("mask_mod"), s, False)
    return out


def oracle_varlen(q, k, v, cq, ck, do=None, **opts):
    """float64 (o, lse (Hq, total_q)[, dq, dk, dv]) by one dense reference call per sequence."""
    q, k, v = to64(q), to64(k), to64(v)
    o, lse = np.zeros_like(q), np.full((q.shape[1], q.shape[0]), -np.inf)
    grads = [np.zeros_like(x) for x in (q, k, v)]
    for s in range(len(cq) - 1):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        kw = {**sequence_options(opts, s), "layout": "bnhd", "backend": "reference"}
        qs, ks, vs = q[None, rq], k[None, rk], v[None, rk]
        os_, ls = flashcore.attention_forward(qs, ks, vs, **kw)
        o[rq], lse[:, rq] = os_[0], ls[0]
        if do is not None:
            # lse in float64 here: the oracle's own, not the contract's float32
            g = flashcore.attention_backward(to64(do)[None, rq], qs, ks, vs, os_, ls, **kw)
            for acc, x, r in zip(grads, g, (rq, rk, rk)):
                acc[r] = x[0]
    return (o, lse) if do is None else (o, lse, *grads)


def gather_cache(cache, b, n, table, page_size):
    """The first n keys of sequence b, by a plain loop over positions."""
    rows = []
    for p in range(n):
        rows.append(cache[b, p] if table is None else cache[table[b, p // page_size],
                                                              p % page_size])
    return np.stack(rows) if rows else np.zeros((0, *cache.shape[2:]), cache.dtype)


def oracle_kvcache(q, k_cache, v_cache, lengths, table, page_size, **opts):
    """float64 (o, lse (B, Hq, Nq)) of q against the first lengths[b] cached keys."""
    q = to64(q)
    B, Nq, Hq, _ = q.shape
    o, lse = np.zeros_like(q), np.full((B, Hq, Nq), -np.inf)
    for b in range(B):
        kb, vb = (to64(gather_cache(c, b, int(lengths[b]), table, page_size))
                  for c in (k_cache, v_cache))
        kw = {**sequence_options(opts, b), "layout": "bnhd", "backend": "reference"}
        ob, lb = flashcore.attention_forward(q[b:b + 1], kb[None], vb[None], **kw)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse
