"""The elementwise part of a wgmma backward step (``backward.py``): from the recomputed
scores ``Sᵀ`` / ``S`` and ``dPᵀ`` / ``dP`` in wgmma's accumulator layout to ``Pᵀ`` / ``P``
and ``dSᵀ`` / ``dS``, per query column (the dK/dV kernel, keys as rows: ``probs_t``,
``grads_t``, or both in one pass, ``probs_grads_t``) or per query row (the dQ kernel:
``probs_row``, ``grads_row``): the second seam (softcap, ALiBi: ``prob``), the masks
(``seams.hides`` / ``seams.visible``) and the statistics the forward stored (lse, and
delta from the preprocess). The user's score_mod and mask_mod (``SMOD``, ``MMOD``,
compile-time; ``VS``, ``KEEPS``: ``device/user_mods``' ``value_slope`` and ``keeps``) take
``user = (b, h, Nq, Nk, mod_args)``: the batch entry, the query head, the ends their
indices are clamped to (``seams.user_score``) and the arrays they read."""
from __future__ import annotations

import math

from numba import float32

from ..device.constants import NEG_INF
from ..device.convert import device_function
from ..device.intrinsics import cp_async4
from ..device.pipeline import ld_shared_f32, st_shared_f32
from ..device.prologue import lse_log2
from ..device.seams import (
    alibi,
    distance,
    hides,
    slope_of,
    softcap,
    user_keeps,
    user_score_slope,
    visible,
)
from ..tensor_core.fragments import pack


@device_function
def stage_stats(smem, e0, lse, delta, lbase, lsn, dbase, m, Nq, BN, tid):
    """The lse and delta of a step's ``BN`` query columns from ``m`` on, copied into shared
    memory by ``cp.async`` with the step's Q and dO tiles (one 4-byte copy by each of the
    first ``2 BN`` threads: lse of column ``c`` at element ``e0 + 2 c``, delta at ``e0 + 2
    (BN + c)``; lse at ``lbase + i * lsn``, delta at ``dbase + i``); columns past ``Nq``
    get lse -inf (P = 0) and delta 0. Read back by :func:`read_stats`: one copy a thread
    instead of every thread reading its 8-16 columns with 64-bit address arithmetic each
    step (~120 of the D=128 step's 577 instructions, ncu on an H100)."""
    if tid < 2 * BN:
        c = tid if tid < BN else tid - BN
        i = m + c
        at = e0 + 2 * c if tid < BN else e0 + 2 * (BN + c)
        if i >= Nq:  # (a plain store: the barrier that publishes the copies shows it too)
            st_shared_f32(smem, at, NEG_INF if tid < BN else float32(0.0))
        elif tid < BN:
            cp_async4(smem, at, lse, lbase + i * lsn, 4)
        else:
            cp_async4(smem, at, delta, dbase + i, 4)


@device_function
def read_stats(ls, dl, smem, e0, BN, NTILES, tq):
    """This thread's query columns' statistics from what :func:`stage_stats` copied:
    ``ls[2 jn + e]`` the lse of column ``8 jn + 2 tq + e`` in the log2 domain (+inf where
    it is -inf: a row that sees no key, P = 0), ``dl`` its delta."""
    for jn in range(NTILES):
        for e in range(2):
            c = 8 * jn + 2 * tq + e
            ls[2 * jn + e] = lse_log2(ld_shared_f32(smem, e0 + 2 * c))
            dl[2 * jn + e] = ld_shared_f32(smem, e0 + 2 * (BN + c))


@device_function
def prob(x, d, li, sl2, mods, CAP, ALIBI, SMOD, VS, user, i, j):
    """``(P, d score / d raw score)`` of raw score ``x`` of query ``i`` and key ``j``: the
    score through the softcap, ALiBi at distance ``d`` (``seams.distance``) and the user's
    score_mod (``SMOD``; ``VS`` its value and derivative, ``user`` as the module says), in
    the forward's order (``mods``: ``(cap, 1 / cap, slope, 1 / scale, scale)`` in
    raw-score units, :func:`score_mods`; each compile-time flag off leaves its step out),
    then ``P = exp2(score sl2 - li)`` (``li``: the row's lse in the log2 domain). The
    derivative is the softcap's times the score_mod's, 1 without them."""
    g = float32(1.0)
    if CAP:
        x, g = softcap(x, mods[0], mods[1], True)
    if ALIBI:
        x = alibi(x, d, mods[2])
    if SMOD:
        b, h, Nq, Nk, margs = user
        x, gu = user_score_slope(x, b, h, i, j, Nq, Nk, mods[3], mods[4], VS, margs)
        g = g * gu
    return math.exp2(x * sl2 - li), g


@device_function
def user_hides(i, j, MMOD, KEEPS, user):
    """Whether the user's mask_mod (``MMOD``, compile-time; False without one) hides key
    ``j`` from query ``i``."""
    if MMOD:
        b, h, Nq, Nk, margs = user
        return not user_keeps(b, h, i, j, Nq, Nk, KEEPS, margs)
    return False


@device_function
def grad(p, dpx, di, g, GRAD):
    """``dS = P (dP - delta)`` of one score, times the score's derivative ``g`` (the
    softcap's and the score_mod's) where ``GRAD`` (compile-time)."""
    ds = p * (dpx - di)
    if GRAD:
        ds = ds * g
    return ds


@device_function
def score_mods(mods, scale, slopes, b, h, ssb, ssh, CAP_C, ALIBI):
    """``mods`` of :func:`prob` for query head ``h`` of batch entry ``b``: the cap and
    its reciprocal, the ALiBi slope (read only where ``ALIBI``), in raw-score units, and
    the factors from natural scores to raw ones and back (a score_mod's)."""
    mods[0] = CAP_C / float32(scale)
    mods[1] = float32(scale) / CAP_C
    mods[2] = slope_of(slopes, b, h, ssb, ssh, float32(1.0) / float32(scale), ALIBI)
    mods[3] = float32(1.0) / float32(scale)
    mods[4] = float32(scale)


@device_function
def probs_t(s, gc, ls, m, j0, causal_offset, sl2, MASK, CAUSAL, LEFT, RIGHT, NTILES, tq, mods,
            CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user):
    """``Sᵀ`` (``s``, wgmma's accumulator order: ``s[4 jn + 2 r + e]`` is key ``j0 + 8 r``,
    query ``m + 8 jn + 2 tq + e``) becomes ``Pᵀ``; with ``MASK`` (a step across the
    diagonal, a window's edge, or partial under a mask_mod) keys the mask or the mask_mod
    hides from a query get P = 0. The columns' lse come from ``ls`` (:func:`read_stats`).
    Scores go through the softcap, ALiBi and the score_mod first (:func:`prob`); with
    ``CAP`` or ``SMOD``, ``gc`` keeps their derivative for :func:`grads_t` (0 where
    hidden: a mod need not be finite there)."""
    d0 = distance(m + 2 * tq, j0, causal_offset)  # (ALIBI) this lane's first distance
    for jn in range(NTILES):
        for e in range(2):
            i = m + 8 * jn + 2 * tq + e
            li = ls[2 * jn + e]
            for r in range(2):
                x = 4 * jn + 2 * r + e
                p, gx = prob(s[x], d0 + float32(8 * jn + e - 8 * r), li, sl2, mods, CAP,
                             ALIBI, SMOD, VS, user, i, j0 + 8 * r)
                if CAP or SMOD:  # (compile-time)
                    gc[x] = gx
                if MASK:
                    if (hides(i, j0 + 8 * r, causal_offset, CAUSAL, LEFT, RIGHT)
                            or user_hides(i, j0 + 8 * r, MMOD, KEEPS, user)):
                        p = float32(0.0)
                        if SMOD:  # (compile-time)
                            gc[x] = float32(0.0)
                s[x] = p


@device_function
def grads_t(s, gc, dp, dl, NTILES, GRAD):
    """``dSᵀ = Pᵀ ∘ (dPᵀ − delta)`` into ``dp`` (delta per query column, from ``dl``), times
    the scores' derivative ``gc`` (``GRAD``: a softcap or a score_mod)."""
    for jn in range(NTILES):
        for e in range(2):
            di = dl[2 * jn + e]
            for r in range(2):
                x = 4 * jn + 2 * r + e
                dp[x] = grad(s[x], dp[x], di, gc[x], GRAD)


@device_function
def probs_grads_t(BF16, s, dp, pf, dsf, ls, dl, m, j0, causal_offset, sl2, MASK, CAUSAL, LEFT,
                  RIGHT, NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user):
    """:func:`probs_t` and :func:`grads_t` in one pass, each k-step's Pᵀ and dSᵀ packed
    (``pf``, ``dsf``: the A fragments, as :func:`..forward.pack_p`) as soon as they are
    done, so that the fp32 tiles die early (the schedule without overlap)."""
    d0 = distance(m + 2 * tq, j0, causal_offset)  # (ALIBI) this lane's first distance
    for kk in range(NTILES // 2):
        for jn in range(2 * kk, 2 * kk + 2):
            for e in range(2):
                i = m + 8 * jn + 2 * tq + e
                li = ls[2 * jn + e]
                di = dl[2 * jn + e]
                for r in range(2):
                    x = 4 * jn + 2 * r + e
                    p, gx = prob(s[x], d0 + float32(8 * jn + e - 8 * r), li, sl2, mods, CAP,
                                 ALIBI, SMOD, VS, user, i, j0 + 8 * r)
                    if MASK:
                        if (hides(i, j0 + 8 * r, causal_offset, CAUSAL, LEFT, RIGHT)
                                or user_hides(i, j0 + 8 * r, MMOD, KEEPS, user)):
                            p = float32(0.0)
                            if SMOD:  # (compile-time)
                                gx = float32(0.0)
                    s[x] = p
                    dp[x] = grad(p, dp[x], di, gx, CAP or SMOD)
        for r in range(4):
            x = 8 * kk + 2 * r
            pf[4 * kk + r] = pack(BF16, s[x], s[x + 1])
            dsf[4 * kk + r] = pack(BF16, dp[x], dp[x + 1])


@device_function
def probs_row(s, gc, base, ls, n0, i, Nk, causal_offset, sl2, MASK, CAUSAL, LEFT, RIGHT,
              NTILES, tq, mods, CAP, ALIBI, SMOD, MMOD, VS, KEEPS, user):
    """One of this thread's rows (``s[base + 4 jn + e]``, key ``n0 + 8 jn + 2 tq + e``;
    ``base`` 0 for row ``i``, 2 for row ``i + 8``) of ``S`` becomes ``P``; with ``MASK`` (a
    diagonal, edge or tail tile, or one partial under a mask_mod) keys past ``Nk`` or hidden
    from row ``i`` get P = 0. Scores go through the softcap, ALiBi and the score_mod first
    (:func:`prob`; ``gc``: their derivative, with ``CAP`` or ``SMOD``, 0 where hidden)."""
    d0 = distance(i, n0 + 2 * tq, causal_offset)  # (ALIBI) this row's first distance
    for jn in range(NTILES):
        for e in range(2):
            x = base + 4 * jn + e
            j = n0 + 8 * jn + 2 * tq + e
            p, gx = prob(s[x], d0 - float32(8 * jn + e), ls, sl2, mods, CAP, ALIBI, SMOD, VS,
                         user, i, j)
            if CAP or SMOD:  # (compile-time)
                gc[x] = gx
            if MASK:
                if (not visible(i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT)
                        or user_hides(i, j, MMOD, KEEPS, user)):
                    p = float32(0.0)
                    if SMOD:  # (compile-time)
                        gc[x] = float32(0.0)
            s[x] = p


@device_function
def grads_row(s, gc, dp, base, dl, NTILES, GRAD):
    """``dS = P ∘ (dP − delta)`` into ``dp`` for one of this thread's rows (times the
    scores' derivative ``gc`` with ``GRAD``: a softcap or a score_mod)."""
    for jn in range(NTILES):
        for e in range(2):
            x = base + 4 * jn + e
            dp[x] = grad(s[x], dp[x], dl, gc[x], GRAD)
