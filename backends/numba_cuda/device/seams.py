"""The two seams every kernel family calls (SIMT, tensor-core; the CPU kernels have the
same two in ``numba_cpu/seams.py``).

1. **Which tiles a tile visits, and which of them need a per-element mask.**
   :func:`key_range` gives the keys a block of query rows visits and the keys every one of
   those rows sees whole; :func:`query_range` is its transpose for the dK/dV pass (which
   query rows a block of keys is seen by). Tiles outside the range are never loaded or
   computed; tiles inside the full range take no per-element mask.
2. **What a raw score becomes.** :func:`score` takes the score of query ``i`` and key
   ``j`` as the kernel holds it (SIMT kernels fold the scale and log2 e into Q when it is
   loaded; tensor-core kernels scale in the softmax) and returns what the softmax sees,
   ``-inf`` where ``j`` is masked; :func:`visible` is the mask with the key bound, as the
   backward passes use it (P = 0 where not visible), :func:`hides` the mask alone;
   :func:`row_keys` the same for a row's run of keys at once (two bounds).

The variant's mask options arrive as compile-time arguments (``CAUSAL``; the window's
``LEFT``/``RIGHT``, -1 for an unbounded side or no window), so after inlining each kernel
keeps only the arithmetic its variant needs. A kernel of a windowed variant takes its
ranges from :func:`window_key_range`/:func:`window_query_range` (which also give a first
tile and a last row), the others from :func:`key_range`/:func:`query_range` as before; a
variant with a mask_mod narrows them to the tiles its classes leave
(:func:`class_key_range`/:func:`class_query_range`). Masks and score modifiers (window,
softcap, ALiBi, user functions), varlen bounds and paged caches extend these functions and
the variant that parametrizes them, not the kernels.
"""
from __future__ import annotations

import math

from numba import float32, int32, int64

from .constants import CACHE, CLASS_BLOCK, EMPTY, FULL, NEG_INF, PARTIAL, VARLEN
from .convert import device_function
from .intrinsics import tanh_approx, warp_first, warp_inclusive_sum, warp_lane_value


@device_function
def key_range(q0, rows, Nk, causal_offset, CAUSAL):
    """``(n_end, n_full)`` for query rows ``q0 .. q0 + rows - 1``: they visit keys
    ``[0, n_end)``, and every one of them sees each key before ``n_full``, so a key tile
    that ends at or before ``n_full`` needs no mask (the tail past ``Nk`` always does)."""
    n_end = Nk
    n_full = Nk
    if CAUSAL:
        n_end = max(0, min(Nk, q0 + rows + causal_offset))
        n_full = min(Nk, q0 + 1 + causal_offset)
    return n_end, n_full


@device_function
def query_range(k0, cols, step, causal_offset, CAUSAL):
    """``(m_begin, m_full)`` for keys ``k0 .. k0 + cols - 1`` in the dK/dV pass: query rows
    before ``m_begin`` (a multiple of ``step``) see none of them, and a query tile that
    starts at or after ``m_full`` sees all of them (no mask). Queries run to the end."""
    m_begin = 0
    if CAUSAL:
        m_begin = max(0, k0 - causal_offset) // step * step
    m_full = k0 + cols - 1 - causal_offset
    return m_begin, m_full


@device_function
def sequence_tiles(cu, s, rows):
    """The number of ``rows``-row tiles of packed sequence ``s`` (``cu`` its offsets)."""
    return (int64(cu[s + 1]) - int64(cu[s]) + (rows - 1)) // rows


@device_function
def packed_tile(b, tile, cu, nseq, rows, lane, WARPS, PACKED):
    """``(b, tile)``: the batch entry and the tile of ``rows`` rows a block computes.
    Dense rows and KV caches keep the grid's. Varlen (``PACKED``, compile-time): the
    grid's tile axis counts the tiles of every sequence in turn (``cu`` the offsets of
    ``nseq`` sequences), so no block falls past its sequence's end; ``tile`` is found in
    its sequence by a warp-wide prefix sum of the sequences' tile counts, 32 sequences at
    a time (``lane`` the thread's lane; all 32 lanes take part), or (``WARPS`` False,
    compile-time: a block of part of a warp, as the simulator's tiny tilings) by each
    thread on its own. The launch rounds the axis up to ``total // rows + nseq`` tiles: a
    tile number past the last tile gives the last sequence and a tile past its end (the
    kernel returns at once)."""
    if PACKED != VARLEN:
        return b, tile
    t = int64(tile)  # (64-bit throughout: the tile moves addresses)
    before = int64(0)  # tiles of the sequences already scanned
    if not WARPS:
        for s in range(nseq):
            n = sequence_tiles(cu, s, rows)
            if t < before + n:
                return int64(s), t - before
            before += n
        return int64(nseq - 1), int64(1 << 30)
    c0 = int64(0)
    while c0 < nseq:
        s = c0 + lane
        n = int64(0)
        if s < nseq:
            n = sequence_tiles(cu, s, rows)
        incl = warp_inclusive_sum(n)
        first = warp_first(t < before + incl)
        if first < 32:
            return c0 + first, t - before - warp_lane_value(incl - n, first)
        before += warp_lane_value(incl, 31)
        c0 += 32
    return int64(nseq - 1), int64(1 << 30)


@device_function
def sequence(b, Nq, Nk, causal_offset, cu_q, cu_k, seqk, PACKED):
    """``(q_row0, k_row0, Nq, Nk, causal_offset)`` of batch entry ``b``: where its query and
    key rows start and how many there are. ``PACKED`` (compile-time) is the variant's
    :attr:`~..variant.Variant.packed`: dense ("") keeps the launch's sizes (rows start at
    0; batch strides move the bases); "varlen" reads sequence ``b``'s rows from the offsets
    ``cu_q``, ``cu_k`` (packed arrays, batch strides 0); a KV cache ("cache", "paged")
    keeps the query rows and reads the sequence's key count from ``seqk`` (its cached keys
    plus the new ones). Packed sequences are aligned bottom-right each on its own."""
    if PACKED == VARLEN:
        q_row0 = int64(cu_q[b])
        k_row0 = int64(cu_k[b])
        nq = int64(cu_q[b + 1]) - q_row0
        nk = int64(cu_k[b + 1]) - k_row0
        return q_row0, k_row0, nq, nk, nk - nq
    if PACKED >= CACHE:
        nk = int64(seqk[b])
        return int64(0), int64(0), Nq, nk, nk - Nq
    return int64(0), int64(0), Nq, Nk, causal_offset


@device_function
def sequence_rows(b, h, Hq, Nq, Nk, causal_offset, cu_q, cu_k, seqk, TQ, PACKED):
    """A block's rows of batch entry ``b``: :func:`sequence`'s ``(q_row0, k_row0, Nq, Nk,
    causal_offset)`` followed by :func:`stat_rows`'s ``(first, per_head)`` for head ``h``
    (``Nq`` the launch's, padded query length there)."""
    q_row0, k_row0, nq, nk, co = sequence(b, Nq, Nk, causal_offset, cu_q, cu_k, seqk, PACKED)
    first, step = stat_rows(b, h, Hq, Nq, q_row0, TQ, PACKED)
    return q_row0, k_row0, nq, nk, co, first, step


@device_function
def stat_rows(b, h, Hq, Nq, q_row0, TQ, PACKED):
    """``(first, per_head)``: the index in a float32 lse or delta buffer of query row 0 of
    batch entry ``b`` and head ``h`` (launch sizes: ``Nq`` the padded query length), and
    the step to the next head. Dense: ``(B, Hq, Nq)``; varlen: ``(Hq, TQ)`` with ``TQ``
    the packed query rows (FlashAttention 2's lse layout), the sequence's rows at
    ``q_row0``."""
    if PACKED == VARLEN:
        return h * TQ + q_row0, TQ
    return (b * Hq + h) * Nq, Nq


@device_function
def key_row(base, j, sn, table, tb, page, psp, PAGED):
    """The element offset of key row ``j`` of a tile's source: ``base + j * sn``, or
    (``PAGED``, compile-time) slot ``j % page`` of page ``table[tb + j // page]`` (a page
    ``psp`` elements long; ``base`` then holds the head's offset only)."""
    if PAGED:
        p = j // page
        return base + int64(table[tb + p]) * psp + (j - p * page) * sn
    return base + j * sn


@device_function
def split_range(n_begin, n_end, split, chunk, SPLIT):
    """``[n_begin, n_end)`` cut to split ``split``'s keys ``[split * chunk, (split + 1) *
    chunk)`` (split-KV; ``chunk`` a multiple of the key tile, so the start stays on the
    tile grid); unchanged unless ``SPLIT`` (compile-time)."""
    if SPLIT:
        return max(n_begin, split * chunk), min(n_end, (split + 1) * chunk)
    return n_begin, n_end


@device_function
def softcap(x, cap, inv_cap, APPROX):
    """``(cap tanh(x / cap), 1 - tanh^2)``: a score through the softcap (``cap`` in the
    score's own units, ``inv_cap`` its reciprocal) and its derivative, the factor dS takes.
    ``APPROX`` (compile-time; the fp16/bf16 variants): tanh is one ``tanh.approx.f32``
    (relative error ~2^-11, below those dtypes' rounding), since libdevice's tanhf made the
    tensor-core dK/dV kernel spill and a tanh from ex2 and a reciprocal costs two MUFU
    operations per score where the softmax spends one (the forward ran 2.9x slower with it
    on an H100); fp32 variants keep libdevice's tanhf for their accuracy."""
    if APPROX:
        t = tanh_approx(x * inv_cap)
    else:
        t = math.tanh(x * inv_cap)
    return cap * t, float32(1.0) - t * t


@device_function
def slope_of(slopes, b, h, ssb, ssh, unit, ALIBI):
    """The ALiBi slope of batch ``b``, query head ``h`` times ``unit`` (the factor that
    takes a natural-units score to the kernel's units), or 0 without ALiBi (``ALIBI``
    compile-time: the slopes are then never read)."""
    if ALIBI:
        return float32(slopes[b * ssb + h * ssh]) * unit
    return float32(0.0)


@device_function
def distance(i, j, causal_offset):
    """The signed distance ``i + causal_offset - j`` of query ``i`` from key ``j`` (bottom-
    right aligned, as the causal mask) as a float32 (exact below 2^24 positions), computed
    in 32-bit integers: 64-bit ones cost the register-bound tensor-core kernels spills.
    A kernel that walks a fragment takes one distance per lane and subtracts the
    fragment's constant offsets from it."""
    return float32(int32(i) + int32(causal_offset) - int32(j))


@device_function
def alibi(s, d, slope):
    """``s`` with the ALiBi bias at distance ``d`` (:func:`distance`): ``s - slope |d|``,
    ``slope`` in the score's units (:func:`slope_of`). After the softcap, before the
    masks."""
    return s - slope * abs(d)


@device_function
def reach(CAUSAL, RIGHT):
    """How far right of the diagonal a query sees: -1 unbounded, else the window's right
    bound, capped at 0 by causal."""
    if CAUSAL:
        return 0 if RIGHT < 0 else min(RIGHT, 0)
    return RIGHT


@device_function
def window_key_range(q0, rows, step, Nk, causal_offset, CAUSAL, LEFT, RIGHT):
    """:func:`key_range` with a window (``LEFT``/``RIGHT``: compile-time bounds, -1 for an
    unbounded side): ``(n_begin, n_end, n_lo, n_full)``. Rows ``q0 .. q0 + rows - 1`` visit
    keys ``[n_begin, n_end)`` (``n_begin`` a multiple of ``step``); a key tile inside
    ``[n_lo, n_full)`` is seen whole by every row (no mask)."""
    r = reach(CAUSAL, RIGHT)
    last = q0 + rows - 1
    n_end = Nk
    n_full = Nk
    if r >= 0:
        n_end = max(0, min(Nk, last + causal_offset + r + 1))
        n_full = min(Nk, q0 + causal_offset + r + 1)
    n_begin = 0
    n_lo = 0
    if LEFT >= 0:
        n_begin = max(0, q0 + causal_offset - LEFT) // step * step
        n_lo = last + causal_offset - LEFT
    return n_begin, n_end, n_lo, n_full


@device_function
def window_query_range(k0, cols, step, Nq, causal_offset, CAUSAL, LEFT, RIGHT):
    """:func:`query_range` with a window: ``(m_begin, m_end, m_full, m_last)``. Query rows
    ``[m_begin, m_end)`` see some key of ``k0 .. k0 + cols - 1`` (``m_begin`` a multiple of
    ``step``); rows in ``[m_full, m_last]`` see all of them (a query tile inside needs no
    mask)."""
    r = reach(CAUSAL, RIGHT)
    k_last = k0 + cols - 1
    m_begin = 0
    m_full = 0
    if r >= 0:
        m_begin = max(0, k0 - causal_offset - r) // step * step
        m_full = k_last - causal_offset - r
    m_end = Nq
    m_last = Nq
    if LEFT >= 0:
        m_end = max(0, min(Nq, k_last - causal_offset + LEFT + 1))
        m_last = k0 - causal_offset + LEFT
    return m_begin, m_end, m_full, m_last


@device_function
def hides(i, j, causal_offset, CAUSAL, LEFT, RIGHT):
    """Whether the mask hides key ``j`` from query ``i`` (causal: ``j`` after the diagonal
    of ``i`` aligned to the bottom right; a window: ``j`` more than ``RIGHT`` after it or
    ``LEFT`` before it), bounds aside. The dK/dV pass uses it alone: a key past ``Nk`` only
    feeds a dK/dV row that is never stored."""
    return ((CAUSAL and j > i + causal_offset) or (RIGHT >= 0 and j > i + causal_offset + RIGHT)
            or (LEFT >= 0 and j < i + causal_offset - LEFT))


@device_function
def visible(i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT):
    """Whether query ``i`` sees key ``j``: ``j`` is a key, and the mask does not hide it."""
    return j < Nk and not hides(i, j, causal_offset, CAUSAL, LEFT, RIGHT)


@device_function
def row_keys(i, j0, Nk, causal_offset, CAUSAL, LEFT, RIGHT, SPAN):
    """``(lo, hi)``, int32: the keys query ``i`` sees, as offsets ``c`` from key ``j0``
    (``j0 + c`` is :func:`visible` exactly where ``lo <= c <= hi``), clamped to ``[-1,
    SPAN]`` for offsets ``0 <= c < SPAN``. A tile's mask then compares each score's offset, a
    constant after unrolling, with two 32-bit bounds of its row, where :func:`score` adds
    and compares 64-bit indices per score."""
    d = i + causal_offset - j0  # (the diagonal's offset)
    hi = Nk - 1 - j0
    if CAUSAL:
        hi = min(hi, d)
    if RIGHT >= 0:
        hi = min(hi, d + RIGHT)
    lo = d - LEFT if LEFT >= 0 else -1
    return int32(max(min(lo, SPAN), -1)), int32(max(min(hi, SPAN), -1))


@device_function
def score(s, i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT):
    """The score the softmax sees for query ``i`` and key ``j``: ``s``, or ``-inf`` where
    ``j`` is masked."""
    if visible(i, j, Nk, causal_offset, CAUSAL, LEFT, RIGHT):
        return s
    return NEG_INF


@device_function
def user_score(x, b, h, i, j, Nq, Nk, unit, inv, value, args):
    """``x`` (a score in the kernel's units: the natural score times ``unit``; ``inv`` is
    ``1 / unit``) through the
    user's ``score_mod`` (``value``, :mod:`.user_mods`) for batch ``b``, query head ``h``,
    query ``i``, key ``j``. Rows and keys past the ends (a tile's padding, whose scores are
    masked or never stored) ask for the last row or key instead, so that the user's
    function never indexes its arrays out of bounds."""
    ii = min(i, Nq - 1)
    jj = min(j, Nk - 1)
    return value(x * inv, b, h, ii, jj, args) * unit


@device_function
def user_score_slope(x, b, h, i, j, Nq, Nk, unit, inv, value_slope, args):
    """``(score, d score / d x)``: :func:`user_score` and the derivative the backward's dS
    takes (in natural units, the same in the kernel's), from one call of ``value_slope``
    (:mod:`.user_mods`). Past the ends (a tile's padding: rows whose lse is -inf, keys
    masked) ``(x, 0)``: what the user's function gives at the last row or key for a score
    of 0 (the padding's zero rows) may be infinite or NaN (``sqrt(abs(s))``'s slope), and
    P = 0 times it would carry NaN into dK and dV, or dQ."""
    v, d = value_slope(x * inv, b, h, min(i, Nq - 1), min(j, Nk - 1), args)
    if i >= Nq or j >= Nk:
        return x, float32(0.0)
    return v * unit, d


@device_function
def user_keeps(b, h, i, j, Nq, Nk, keeps, args):
    """The user's ``mask_mod`` (``keeps``) for query ``i`` and key ``j``; indices past the
    ends are asked as the last row or key, as in :func:`user_score` (bounds are the other
    seams' part)."""
    return keeps(b, h, min(i, Nq - 1), min(j, Nk - 1), args)


@device_function
def column_seen(cls, at, heads, csh, lo_fixed, hi_fixed, fixed_stride):
    """Whether one class column (blocks ``at + f * fixed_stride`` for ``f`` in ``lo_fixed ..
    hi_fixed``, for each of ``heads`` heads ``csh`` apart) holds a block that is not
    EMPTY."""
    for g in range(heads):
        for f in range(lo_fixed, hi_fixed + 1):
            if int32(cls[at + g * csh + f * fixed_stride]) != EMPTY:
                return True
    return False


@device_function
def class_span(cls, base, heads, csh, n_span, span_stride, lo_fixed, hi_fixed, fixed_stride,
               step, begin, end):
    """``[begin, end)`` (rows or keys) cut to the span of the class blocks along one axis
    (``n_span`` of them, ``span_stride`` apart) that are not EMPTY somewhere in blocks
    ``lo_fixed .. hi_fixed`` of the other axis (``fixed_stride`` apart), for any of ``heads``
    heads (``csh`` apart; 0: they share their classes, one scan), the start kept on its grid
    of ``step`` from ``begin``. The columns inside ``[begin, end)`` are scanned from each
    end to the first one seen (a document's span costs the columns outside it; a scan of
    every column took a single thread ~10 µs a row, notes/mask_mod_persistent_2026-11-28.md).
    Empty everywhere: an empty range."""
    if csh == 0:
        heads = 1
    lo = begin // CLASS_BLOCK
    hi = min(n_span, (end + CLASS_BLOCK - 1) // CLASS_BLOCK)
    while lo < hi and not column_seen(cls, base + lo * span_stride, heads, csh, lo_fixed,
                                      hi_fixed, fixed_stride):
        lo += 1
    while hi > lo and not column_seen(cls, base + (hi - 1) * span_stride, heads, csh,
                                      lo_fixed, hi_fixed, fixed_stride):
        hi -= 1
    if lo >= hi:
        return begin, begin
    first = lo * CLASS_BLOCK
    if first > begin:
        begin += (first - begin) // step * step
    return begin, min(end, hi * CLASS_BLOCK)


@device_function
def class_key_range(cls, base, csq, q0, rows, Nq, Nk, step, n_begin, n_end):
    """:func:`key_range` narrowed by a mask_mod's tile classes (as :func:`tile_class` reads
    them): rows ``q0 .. q0 + rows - 1`` visit keys ``[n_begin, n_end)`` cut to the span of
    the blocks of their block rows that are not EMPTY, the start kept on its grid of
    ``step`` from ``n_begin`` (:func:`class_span`). A document or prefix mask so never loads
    the key tiles outside a query tile's document (the tiles inside the span that are empty
    are still skipped one by one)."""
    return class_span(cls, base, 1, 0, (Nk + CLASS_BLOCK - 1) // CLASS_BLOCK, 1,
                      q0 // CLASS_BLOCK, (min(q0 + rows, Nq) - 1) // CLASS_BLOCK, csq, step,
                      n_begin, n_end)


@device_function
def visited_keys(q0, rows, step, Nq, Nk, causal_offset, CAUSAL, LEFT, RIGHT, WINDOW, MMOD, cls,
                 base, csq):
    """The first seam for a block of query rows ``q0 .. q0 + rows - 1`` streaming key tiles
    of ``step``: ``(n_begin, n_end, n_lo, n_full)``, the keys ``[n_begin, n_end)`` it visits
    (``n_begin`` a multiple of ``step``) and the tiles inside ``[n_lo, n_full)`` that every
    row sees whole. :func:`key_range` for plain variants (``n_begin = n_lo = 0``), with the
    window's range (``WINDOW``, compile-time) and cut to the span a mask_mod's classes at
    ``base`` leave (``MMOD``, compile-time: :func:`class_key_range`)."""
    n_end, n_full = key_range(q0, rows, Nk, causal_offset, CAUSAL)
    n_begin = 0
    n_lo = 0
    if WINDOW:  # (compile-time) the window's first tile and left edge too
        n_begin, n_end, n_lo, n_full = window_key_range(q0, rows, step, Nk, causal_offset,
                                                        CAUSAL, LEFT, RIGHT)
    if MMOD:  # (compile-time) only the key tiles the mask_mod's classes leave
        n_begin, n_end = class_key_range(cls, base, csq, q0, rows, Nq, Nk, step, n_begin,
                                         n_end)
    return n_begin, n_end, n_lo, n_full


@device_function
def class_query_range(cls, base, csh, heads, csq, k0, cols, Nq, Nk, step, m_begin, m_end):
    """:func:`query_range` narrowed by a mask_mod's tile classes, the transpose of
    :func:`class_key_range` for the dK/dV pass: keys ``k0 .. k0 + cols - 1`` are seen by
    query rows ``[m_begin, m_end)`` cut to the span of the block rows whose blocks in the
    keys' block columns are not EMPTY for some of ``heads`` query heads (classes at
    ``base``, ``base + csh``, ...: a dK/dV block sums over its GQA group, whose heads'
    classes may differ; ``csh`` 0 where they share one), the start kept on its grid of
    ``step`` from ``m_begin``. The steps inside the span that are empty for a head are
    still skipped one by one."""
    return class_span(cls, base, heads, csh, (Nq + CLASS_BLOCK - 1) // CLASS_BLOCK, csq,
                      k0 // CLASS_BLOCK, (min(k0 + cols, Nk) - 1) // CLASS_BLOCK, 1, step,
                      m_begin, m_end)


@device_function
def tile_class(cls, base, csq, q0, rows, Nq, k0, cols, Nk):
    """The class of the tile of queries ``q0 .. q0 + rows - 1`` and keys ``k0 .. k0 + cols -
    1`` (clipped to ``Nq``, ``Nk``) under a mask_mod, from its BlockMask's classes
    (``cls[base + qt * csq + kt]`` per CLASS_BLOCK x CLASS_BLOCK block): EMPTY where every
    block it touches is empty (the tile is skipped), FULL where every one is full (no
    per-element mask_mod), else PARTIAL. A kernel tile lies in one block when its sides
    divide CLASS_BLOCK; larger tiles combine the blocks they cover."""
    qa = q0 // CLASS_BLOCK
    qb = (min(q0 + rows, Nq) - 1) // CLASS_BLOCK
    ka = k0 // CLASS_BLOCK
    kb = (min(k0 + cols, Nk) - 1) // CLASS_BLOCK
    lo = FULL
    hi = EMPTY
    for x in range(qa, qb + 1):
        for y in range(ka, kb + 1):
            c = int32(cls[base + x * csq + y])
            lo = min(lo, c)
            hi = max(hi, c)
    if hi == EMPTY:
        return EMPTY
    if lo == FULL:
        return FULL
    return PARTIAL
