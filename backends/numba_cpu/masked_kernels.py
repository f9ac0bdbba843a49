"""The CPU kernels with masks and score modifiers (window, softcap, ALiBi, the user's
``score_mod`` and ``mask_mod``): the same tiles and steps as forward_kernels.py and
backward_kernels.py, with the general seams.

:func:`kernels` makes the kernels for one (score_mod, mask_mod) pair (forward, the fused
backward of :func:`run_backward`, decode): the user's
functions are compiled into them (closures over Numba-compiled functions), so no call goes
back to Python. Built-in options arrive as values (``opts``), so window, softcap and ALiBi
share one compiled set. These kernels are not disk-cached (Numba cannot cache closures over
user functions), which is why plain attention keeps its own cached kernels.

Per tile: :func:`seams.tile_class` says EMPTY (skipped: no product is computed), FULL (no
per-element mask) or PARTIAL; the score step applies softcap, ALiBi and score_mod to every
element, then the masks on PARTIAL tiles, and in the backward pass the derivative of the
final score in the scaled one (the chain factor ``g`` that multiplies dS). The forward
computes Sᵀ and its softmax down the columns, the backward S, both as the dense kernels.

These kernels also serve packed calls (varlen, KV cache): each job first asks
``seams.query_rows``/``key_rows`` which rows its sequence owns, and the forward reads keys
through ``pages.py`` (a page table, or dense rows) and may cover one split of the keys
(split-KV). A dense batch passes empty offsets and is one sequence per batch entry.
"""
import functools
import math
import types

import numpy as np
from numba import njit, prange

from flashcore._derive import value_and_slope
from flashcore._memo import Memo

from .backward_kernels import dscores_tile, load_rows, prepare_lse2, probabilities_tile, zero_tail
from .decode_kernels import make_decode
from .forward_kernels import FASTMATH, load_padded_t, load_tile, load_tile_t, online_softmax_t
from .pages import load_cache_rows
from .products import product, product_into
from .scalar import LOG2E, store, tanh, tanh_any
from .seams import (
    EMPTY,
    PARTIAL,
    key_bounds,
    key_rows,
    query_bounds,
    query_rows,
    split_keys,
    tile_class,
)
from .simd import width_of

#: Relative finite-difference step (flashcore._mods.FD_STEP, restated to keep the backend
#: free of front-end imports inside kernels).
FD_STEP = 1e-3


def _no_score_mod(s, b, h, i, j, *args):
    return s


def _no_mask_mod(b, h, i, j, *args):
    return True


@njit
def padded(like, D, block_k):
    """``(d_pad, bkp)``: the head dim and the key tile rounded up to the column block of
    products.py for ``like``'s dtype. The kernels' tiles take these sizes, zero where the
    data ends (the products read whole tiles); query tiles are a multiple of its row block
    (tiles.PRODUCT_ROWS) as chosen."""
    cb = 2 * width_of(like)
    return (D + cb - 1) // cb * cb, (block_k + cb - 1) // cb * cb


@njit
def backward_tiles(work_dtype, D, block_q, block_k):
    """``(d_pad, bkp, qt, dot, kt_t, vt_t, s, g, dp, lse2, dlt)``: the padded sizes and the
    tiles both backward kernels use (Q and dO, K and V transposed, scores, score-mod
    factors, dP, the rows' lse and delta), zero where the products read padding."""
    lse2 = np.empty(block_q, work_dtype)
    d_pad, bkp = padded(lse2, D, block_k)
    return (d_pad, bkp, np.zeros((block_q, d_pad), work_dtype),
            np.zeros((block_q, d_pad), work_dtype), np.zeros((d_pad, bkp), work_dtype),
            np.zeros((d_pad, bkp), work_dtype), np.empty((block_q, bkp), work_dtype),
            np.ones((block_q, bkp), work_dtype), np.empty((block_q, bkp), work_dtype), lse2,
            np.empty(block_q, work_dtype))


def _builtin_step(T):
    """:func:`builtin_scores` for a tile stored as (query rows, keys), or (``T``,
    compile-time) transposed, (keys, query rows): each loop walks the tile in memory
    order."""

    @njit(fastmath=FASTMATH, error_model="numpy")  # (no ZeroDivisionError branch: vectorizes)
    def builtin_scores(s, g, want_g, n_rows, n_cols, d0, softcap, has_alibi, slope):
        """The built-in modifiers without a score_mod, on a tile of log2-domain scores: the
        softcap, then ALiBi (``d0 = i' - j`` of the tile's first element); with
        ``want_g``, g <- d final / d scaled score. Loops LLVM vectorizes (``scalar.tanh``:
        a rational function in the float32 kernels, libm's in float64 ones), where the
        per-element step of the general form took ~5 ns a score in libm's tanh."""
        ln2 = 1.0 / LOG2E
        cap = softcap if softcap > 0 else 1.0
        like = s[0, 0]
        n_a, n_e = (n_cols, n_rows) if T else (n_rows, n_cols)
        for a in range(n_a):
            for e in range(n_e):
                x = np.float64(s[a, e]) * ln2
                if softcap > 0:
                    t = tanh(x / cap, like)
                    x = cap * t
                    if want_g:
                        g[a, e] = 1.0 - t * t
                if has_alibi:
                    x -= slope * abs(d0 + e - a if T else d0 + a - e)
                s[a, e] = x * LOG2E

    return builtin_scores


#: builtin_scores per layout: (query rows, keys), and transposed (the forward's Sᵀ).
BUILTIN_SCORES = {False: _builtin_step(False), True: _builtin_step(True)}


@njit(fastmath=FASTMATH)
def add_rows(dst, r0, tile, n):
    """dst[r0:r0 + n] += tile[:n] (the tile as wide as dst)."""
    for r in range(n):
        for d in range(tile.shape[1]):
            dst[r0 + r, d] += tile[r, d]


#: kernels(): the kernels of each (score_mod, mask_mod) pair, bounded like _mods._COMPILED.
_MADE = Memo(64, plans=False)


def kernels(score_mod, mask_mod, fast_tanh=False):
    """``(forward, backward, decode)`` with ``score_mod`` and ``mask_mod`` (Numba CPU
    dispatchers, or None) compiled in; made once per pair. ``fast_tanh`` (the float32
    kernels): a score_mod's ``math.tanh`` / ``np.tanh`` is :func:`scalar.tanh_f32` (of a
    number; of an array NumPy's: :func:`scalar.tanh_any`)."""
    fast_tanh = bool(fast_tanh and score_mod is not None)  # (only a score_mod calls tanh)
    return _MADE.get_or_build((score_mod, mask_mod, fast_tanh), _make_pair, score_mod,
                              mask_mod, fast_tanh)


def _make_pair(score_mod, mask_mod, fast_tanh):
    twin = None if score_mod is None else value_and_slope(score_mod)
    if fast_tanh and score_mod is not None:
        py = getattr(score_mod, "py_func", score_mod)
        fast = with_tanh(py, tanh_any)
        score_mod = score_mod if fast is py else njit(fast)
        twin = None if twin is None else with_tanh(twin, tanh_any)
    return _make(njit(_no_score_mod) if score_mod is None else score_mod,
                 njit(_no_mask_mod) if mask_mod is None else mask_mod, score_mod is not None,
                 None if twin is None else njit(twin))


def with_tanh(fn, tanh):
    """``fn`` (a Python function) with ``tanh`` where its globals give ``math.tanh`` or
    ``np.tanh``: the modules ``math`` and ``numpy`` by stand-ins whose ``tanh`` it is, the
    names bound to either function by it; ``fn`` itself where it reads neither. libm's
    tanh is a call per score that LLVM cannot vectorize (a softcap written as a score_mod
    took 3.5x the built-in softcap's forward); the float32 kernels need no more than
    ``tanh_f32``'s 2.1e-8."""
    g = fn.__globals__
    swap = {}
    for name in fn.__code__.co_names:
        val = g.get(name)
        if val is math or val is np:
            swap[name] = _module_with_tanh(val, tanh)
        elif val is math.tanh or val is np.tanh:
            swap[name] = tanh
    if not swap:
        return fn
    made = types.FunctionType(fn.__code__, {**g, **swap}, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    made.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    return made


@functools.cache
def _module_with_tanh(module, tanh):
    """A stand-in for ``module`` (``math`` or ``numpy``) whose ``tanh`` is ``tanh``: made
    once, shared by every user function that reads the module."""
    shim = types.ModuleType(module.__name__)
    shim.__dict__.update({n: getattr(module, n) for n in dir(module) if not n.startswith("__")})
    shim.tanh = tanh
    return shim


def _make(score_mod, mask_mod, has_score_mod, twin):
    ln2 = 1.0 / LOG2E

    @njit
    def modded(x, b, h, i, j, mod_args):
        return np.float64(score_mod(x, b, h, i, j, *mod_args))

    if twin is not None:
        @njit
        def value_slope(x, b, h, i, j, mod_args):
            """(score_mod, d score_mod / d s) from its forward-mode twin (flashcore._derive):
            exact but for float64 rounding, one pass."""
            v, d = twin(x, b, h, i, j, *mod_args)
            d = np.float64(d)
            return np.float64(v), d if math.isfinite(d) else 0.0
    else:
        @njit
        def value_slope(x, b, h, i, j, mod_args):
            """(score_mod, d score_mod / d s), the latter by the 4th-order central
            difference (flashcore._mods), where the twin cannot be written."""
            st = FD_STEP * max(1.0, abs(x))
            d = (8.0 * (modded(x + st, b, h, i, j, mod_args)
                        - modded(x - st, b, h, i, j, mod_args))
                 - (modded(x + 2 * st, b, h, i, j, mod_args)
                    - modded(x - 2 * st, b, h, i, j, mod_args))) / (12.0 * st)
            return modded(x, b, h, i, j, mod_args), d if math.isfinite(d) else 0.0

    def score_step(T):
        """The score step for a tile stored as (query rows, keys), or (``T``,
        compile-time) transposed: each loop walks the tile in memory order."""
        builtin_scores = BUILTIN_SCORES[T]

        @njit(fastmath=FASTMATH, error_model="numpy")
        def modded_scores(s, g, want_g, n_rows, n_cols, i0, j0, b, h, d0, softcap,
                          has_alibi, slope, mod_args):
            """The modifiers with a score_mod, on every element of a tile (as the GPU
            kernels and FlexAttention: the masks come after): softcap, ALiBi (``d0 = i' -
            j`` of the tile's first element), the score_mod; with ``want_g``, g <- d final
            / d scaled score. A loop without the masks' branches (LLVM vectorizes a
            score_mod that reads a table: 0.06 against 0.9 ns a score inside the masks'
            loop)."""
            like = s[0, 0]
            n_a, n_e = (n_cols, n_rows) if T else (n_rows, n_cols)
            for a in range(n_a):
                for e in range(n_e):
                    r, c = (e, a) if T else (a, e)
                    x = np.float64(s[a, e]) * ln2
                    dx = 1.0
                    if softcap > 0:
                        t = tanh(x / softcap, like)
                        x = softcap * t
                        dx = 1.0 - t * t
                    if has_alibi:
                        x -= slope * abs(d0 + r - c)
                    if want_g:
                        x, slope_x = value_slope(x, b, h, i0 + r, j0 + c, mod_args)
                        dx *= slope_x
                        g[a, e] = dx
                    else:  # (score_mod itself: through modded, 2.5x slower)
                        x = np.float64(score_mod(x, b, h, i0 + r, j0 + c, *mod_args))
                    s[a, e] = x * LOG2E

        @njit
        def mask_scores(s, g, want_g, n_rows, n_cols, i0, j0, b, h, offset, causal, left,
                        right, mod_args):
            """A PARTIAL tile's masks: -inf (and g 0) where causal, the window or the
            mask_mod hide the element."""
            n_a, n_e = (n_cols, n_rows) if T else (n_rows, n_cols)
            for a in range(n_a):
                for e in range(n_e):
                    r, c = (e, a) if T else (a, e)
                    i = i0 + r
                    j = j0 + c
                    d = j - i - offset
                    if ((causal and d > 0) or (right >= 0 and d > right)
                            or (left >= 0 and d < -left)
                            or not mask_mod(b, h, i, j, *mod_args)):
                        s[a, e] = -np.inf
                        if want_g:
                            g[a, e] = 0.0

        @njit
        def scores(s, g, want_g, n_rows, n_cols, i0, j0, b, h, offset, opts, partial, alibi,
                   mod_args):
            """The score step on a tile of log2-domain scores: the modifiers on every
            element (the built-in ones alone: :func:`builtin_scores`), then the masks on
            a PARTIAL tile; with ``want_g``, g <- d final / d scaled score."""
            causal, left, right, softcap, has_alibi = opts
            slope = alibi[b if alibi.shape[0] > 1 else 0, h] if has_alibi else 0.0
            if has_score_mod:
                modded_scores(s, g, want_g, n_rows, n_cols, i0, j0, b, h, i0 + offset - j0,
                              softcap, has_alibi, slope, mod_args)
            elif softcap > 0 or has_alibi:
                builtin_scores(s, g, want_g, n_rows, n_cols, i0 + offset - j0, softcap,
                               has_alibi, slope)
            if partial:
                mask_scores(s, g, want_g, n_rows, n_cols, i0, j0, b, h, offset, causal, left,
                            right, mod_args)

        return scores

    scores = score_step(False)  # (the backward's tiles and decode's)
    scores_t = score_step(True)  # (the forward's Sᵀ)

    @njit
    def forward_rows(q, k, v, o, lse, ob, qb, q_base, kb, k_base, b, h, hk, row0, rows, nk_b,
                     offset, split, n_splits, block_q, block_k, q_mult, work_dtype, opts,
                     alibi, classes, block, mod_args, table, page_size):
        """One job: query rows ``row0 .. row0 + rows - 1`` of sequence ``b`` (array rows from
        ``q_base``), head ``h``, against that sequence's keys of split ``split``; writes o
        and lse at batch index ``ob``. As forward_kernels.attn_forward, scores are computed
        transposed (Sᵀ = K Qᵀ: keys down, query rows across) and the online softmax runs
        down the columns, a vector of query rows at a time (softmax.online_softmax_t)."""
        causal, left, right = opts[0], opts[1], opts[2]
        D = q.shape[3]
        rows_per_job = (rows + block_q - 1) // block_q * block_q
        one = work_dtype.type(1.0)
        g = np.empty((1, 1), work_dtype)
        d_pad, _ = padded(g, D, block_k)
        n_t = rows_per_job // block_q
        qt_t = np.zeros((n_t, d_pad, block_q), work_dtype)
        kt = np.zeros((block_k, d_pad), work_dtype)
        vt = np.zeros((block_k, d_pad), work_dtype)
        st = np.empty((block_k, block_q), work_dtype)
        alpha = np.empty(block_q, work_dtype)
        acc = np.zeros((rows_per_job, d_pad), work_dtype)
        m_i = np.full(rows_per_job, -np.inf, work_dtype)
        l_i = np.zeros(rows_per_job, work_dtype)
        cls = np.empty(n_t, np.int8)
        for t in range(n_t):
            load_padded_t(q, qb, h, q_base + row0 + t * block_q,
                          min(block_q, rows - t * block_q), qt_t[t], q_mult)
        lo, hi = key_bounds(row0, rows, nk_b, offset, causal, left, right)
        lo, hi = split_keys(lo, hi, split, n_splits, nk_b, block_k)
        for j0 in range(lo // block_k * block_k, hi, block_k):
            nk = min(block_k, hi - j0)
            seen = False
            for t in range(n_t):
                nq = min(block_q, rows - t * block_q)
                cls[t] = tile_class(classes, block, b, h, row0 + t * block_q, nq, j0, nk,
                                    offset, causal, left, right)
                seen = seen or cls[t] != EMPTY
            if not seen:
                continue
            load_cache_rows(k, table, page_size, kb, hk, k_base + j0, nk, kt, one)
            load_cache_rows(v, table, page_size, kb, hk, k_base + j0, nk, vt, one)
            if nk < block_k:
                kt[nk:, :] = 0.0
                vt[nk:, :] = 0.0
            for t in range(n_t):
                if cls[t] == EMPTY:
                    continue
                t0 = t * block_q
                nq = min(block_q, rows - t0)
                product(kt, 0, d_pad, 1, qt_t[t], st, block_k, block_q, d_pad, False)
                scores_t(st, g, False, nq, nk, row0 + t0, j0, b, h, offset, opts,
                         cls[t] == PARTIAL, alibi, mod_args)
                online_softmax_t(st, nk, m_i, l_i, acc, t0, alpha)
                product_into(st, 0, 1, block_q, vt, acc, t0, block_q, d_pad, block_k)
        for r in range(rows):
            empty = l_i[r] == 0.0
            inv = 0.0 if empty else 1.0 / l_i[r]
            for d in range(D):
                o[ob, h, q_base + row0 + r, d] = store(acc[r, d] * inv, o[0, 0, 0, 0])
            lse[ob, h, q_base + row0 + r] = (-np.inf if empty
                                             else (m_i[r] + math.log2(l_i[r])) / LOG2E)

    @njit(parallel=True)
    def forward(q, k, v, o, lse, scale, block_q, block_k, q_tiles_per_job, work_dtype, opts,
                alibi, classes, block, mod_args, seqs, sizes, pages, n_splits):
        """Jobs over (sequence, query head, query rows, key split). ``seqs`` = (cu_q, cu_k,
        len_k) and ``sizes`` = (B, Nq, Nk) say which rows each sequence owns
        (seams.query_rows / key_rows; Nq, Nk the longest), ``pages`` = (table, page_size)
        how keys are addressed (pages.py). With ``n_splits`` > 1, o and lse are the split
        partials, (n_splits * B, Hq, Nq, ...), merged afterwards (split_kernels.py)."""
        cu_q, cu_k, len_k = seqs
        B, Nq, Nk = sizes
        table, page_size = pages
        Hq = q.shape[1]
        group = Hq // k.shape[1]
        rows_per_job = block_q * q_tiles_per_job
        n_jobs = (Nq + rows_per_job - 1) // rows_per_job
        q_mult = work_dtype.type(scale * LOG2E)
        n_out = o.shape[0] // n_splits
        for job in prange(B * Hq * n_jobs * n_splits):
            split = job % n_splits
            rest = job // n_splits
            b = rest // (Hq * n_jobs)
            h = (rest // n_jobs) % Hq
            qb, q_base, nq_b = query_rows(b, cu_q, Nq)
            kb, k_base, nk_b = key_rows(b, cu_k, len_k, Nk)
            row0 = (rest % n_jobs) * rows_per_job
            if row0 < nq_b:
                forward_rows(q, k, v, o, lse, split * n_out + qb, qb, q_base, kb, k_base, b, h,
                             h // group, row0, min(rows_per_job, nq_b - row0), nk_b,
                             nk_b - nq_b, split, n_splits, block_q, block_k, q_mult,
                             work_dtype, opts, alibi, classes, block, mod_args, table,
                             page_size)

    @njit(fastmath=FASTMATH)
    def chain(dp, g, n_rows, n_cols):
        """dS through the score modifiers: dS <- dS * g."""
        for r in range(n_rows):
            for c in range(n_cols):
                dp[r, c] *= g[r, c]

    @njit(parallel=True)
    def backward(do, q, k, v, lse, delta, dk, dv, dq_part, scale, block_q, block_k,
                 work_dtype, opts, alibi, classes, block, mod_args, seqs, sizes, p_lo, p_hi,
                 dkv_acc, first, last):
        """dK and dV, and dQ in parts (as backward_kernels.attn_backward_kv: S, P, dP and dS
        once a tile pair for all three, five products): a job owns (sequence, key/value
        head, split) and the key tiles ``split, split + splits, ...``; dQ goes into the
        job's part ``dq_part[split, qb, h]`` (``q_base + i`` rows, d_pad columns, not yet
        scaled), summed in split order afterwards (:func:`run_backward`): no atomics. Each
        tile's dQ rows are added through a tile, only its own rows: a packed batch's
        sequences share ``qb``, and a whole-tile product into the part would touch the next
        sequence's first rows, which another job adds to.
        ``seqs``, ``sizes`` as forward's. One phase (backward_kernels.phase_bounds): the
        query tiles that start in packed rows ``p_lo:p_hi`` (part row ``r - p_lo``); dK
        and dV start from zero (``first``) or from ``dkv_acc`` and end in dk, dv (``last``)
        or in ``dkv_acc``."""
        cu_q, cu_k, len_k = seqs
        B, Nq, Nk = sizes
        Hq, D = q.shape[1], q.shape[3]
        Hkv = k.shape[1]
        group = Hq // Hkv
        splits = dq_part.shape[0]
        causal, left, right, softcap, has_alibi = opts
        want_g = softcap > 0 or has_score_mod
        n_kt = (Nk + block_k - 1) // block_k
        one = work_dtype.type(1.0)
        q_mult = work_dtype.type(scale * LOG2E)
        dk_mult = work_dtype.type(1.0 / LOG2E)
        for job in prange(B * Hkv * splits):
            b = job // (Hkv * splits)
            hk = (job // splits) % Hkv
            split = job % splits
            qb, q_base, nq_b = query_rows(b, cu_q, Nq)
            kb, k_base, nk_b = key_rows(b, cu_k, len_k, Nk)
            offset = nk_b - nq_b
            d_pad, bkp, qt, dot, kt_t, vt_t, s, g, dp, lse2, dlt = backward_tiles(
                work_dtype, D, block_q, block_k)
            kt = np.zeros((bkp, d_pad), work_dtype)
            dq_t = np.empty((block_q, d_pad), work_dtype)
            dk_acc = np.empty((bkp, d_pad), work_dtype)
            dv_acc = np.empty((bkp, d_pad), work_dtype)
            for kt_i in range(split, n_kt, splits):
                j0 = kt_i * block_k
                if j0 >= nk_b:
                    break
                nk = min(block_k, nk_b - j0)
                if first:
                    dk_acc[:] = 0.0
                    dv_acc[:] = 0.0
                else:  # (the tile's own nk rows: in a packed batch the rows after them
                    # are the next sequence's keys, which another job carries)
                    dk_acc[:nk] = dkv_acc[0, kb, hk, k_base + j0:k_base + j0 + nk]
                    dv_acc[:nk] = dkv_acc[1, kb, hk, k_base + j0:k_base + j0 + nk]
                    dk_acc[nk:] = 0.0
                    dv_acc[nk:] = 0.0
                lo, hi = query_bounds(j0, nk, nq_b, offset, causal, left, right)
                # this phase's tiles: those that start in packed rows p_lo:p_hi
                i_lo = lo // block_q * block_q
                if p_lo > q_base:
                    i_lo = max(i_lo, -(-(p_lo - q_base) // block_q) * block_q)
                i_hi = min(hi, p_hi - q_base)
                if i_lo < i_hi:
                    load_tile(k, kb, hk, k_base + j0, nk, kt, one)
                    load_tile_t(k, kb, hk, k_base + j0, nk, kt_t, one)
                    load_tile_t(v, kb, hk, k_base + j0, nk, vt_t, one)
                    if nk < bkp:
                        kt[nk:, :] = 0.0
                        kt_t[:, nk:] = 0.0
                        vt_t[:, nk:] = 0.0
                # (query tiles outer, heads inner: phases split the same sequence of
                # additions into dK and dV as one pass makes)
                for i0 in range(i_lo, i_hi, block_q):
                    nq = min(block_q, nq_b - i0)
                    for h in range(hk * group, (hk + 1) * group):
                        c = tile_class(classes, block, b, h, i0, nq, j0, nk, offset, causal,
                                       left, right)
                        if c == EMPTY:
                            continue
                        load_tile(q, qb, h, q_base + i0, nq, qt, q_mult)
                        load_tile(do, qb, h, q_base + i0, nq, dot, one)
                        if nq < block_q:
                            qt[nq:, :] = 0.0
                            dot[nq:, :] = 0.0
                        prepare_lse2(lse, qb, h, q_base + i0, nq, lse2)
                        load_rows(delta, qb, h, q_base + i0, nq, dlt)
                        product(qt, 0, d_pad, 1, kt_t, s, block_q, bkp, d_pad, False)
                        scores(s, g, want_g, nq, nk, i0, j0, b, h, offset, opts,
                               c == PARTIAL, alibi, mod_args)
                        probabilities_tile(s, nq, nk, lse2)
                        zero_tail(s, nq, nk)
                        # dV += P^T dO (P read transposed through its strides)
                        product(s, 0, 1, bkp, dot, dv_acc, bkp, d_pad, block_q, True)
                        product(dot, 0, d_pad, 1, vt_t, dp, block_q, bkp, d_pad, False)  # dP
                        dscores_tile(s, dp, nq, nk, dlt)
                        if want_g:
                            chain(dp, g, nq, nk)
                        zero_tail(dp, nq, nk)
                        # dK += dS^T Q (qt carries scale*log2e)
                        product(dp, 0, 1, bkp, qt, dk_acc, bkp, d_pad, block_q, True)
                        # dQ += dS K, through a tile: only the nq rows are added (a packed
                        # batch's next sequence owns the rows after them, in another job)
                        product(dp, 0, bkp, 1, kt, dq_t, block_q, d_pad, bkp, False)
                        add_rows(dq_part[split, qb, h], q_base + i0 - p_lo, dq_t, nq)
                if last:
                    for r in range(nk):
                        for d in range(D):
                            dk[kb, hk, k_base + j0 + r, d] = store(dk_acc[r, d] * dk_mult,
                                                                   dk[0, 0, 0, 0])
                            dv[kb, hk, k_base + j0 + r, d] = store(dv_acc[r, d],
                                                                   dv[0, 0, 0, 0])
                else:
                    dkv_acc[0, kb, hk, k_base + j0:k_base + j0 + nk] = dk_acc[:nk]
                    dkv_acc[1, kb, hk, k_base + j0:k_base + j0 + nk] = dv_acc[:nk]

    return forward, backward, make_decode(scores)


def run_backward(made, do, q, k, v, lse, delta, dq, dk, dv, scale, block_q, block_k, work,
                 opts, alibi, classes, block, args, seqs, sizes):
    """The masked backward (kernel views, ``made`` from :func:`kernels`): the fused pass
    into dQ parts, then their sum in split order (as backward_kernels.attn_backward; the
    split count depends on the thread count, so results agree from run to run on a host),
    over the query rows in backward_kernels.phase_bounds' phases (cut at the sequences'
    query tile starts)."""
    import numba

    from .backward_kernels import backward_splits, phase_bounds, run_phases

    B, Nq, Nk = sizes
    splits = backward_splits(B, k.shape[1], -(-Nk // block_k), numba.get_num_threads())
    d_pad = padded(np.empty(1, work), q.shape[3], block_k)[0]
    rows = q.shape[2]  # (packed rows: every sequence's, for varlen)
    cu_q = seqs[0]
    starts = (np.arange(0, rows, block_q) if cu_q.shape[0] == 0 else
              np.unique(np.concatenate([np.arange(a, b_, block_q)
                                        for a, b_ in zip(cu_q[:-1], cu_q[1:])] + [[0]])))
    bounds = phase_bounds(starts, rows, splits,
                          q.shape[0] * q.shape[1] * d_pad * work.itemsize)

    def kv_pass(p_lo, p_hi, dq_part, dkv_acc, first, last):
        made[1](do, q, k, v, lse, delta, dk, dv, dq_part, scale, block_q, block_k, work,
                opts, alibi, classes, block, args, seqs, sizes, p_lo, p_hi, dkv_acc, first,
                last)

    run_phases(bounds, splits, q.shape[:2], k.shape[:3], d_pad, work, dq, scale,
               kv_pass if Nk and (dk.size or dq.size) else None)
