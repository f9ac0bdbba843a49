"""Host side of the packed calls on a GPU: varlen forward and backward, and the KV-cache
forward (append in place, then split-KV attention and the merge).

The kernels are the dense ones compiled for a row layout (``Variant.packed``; the seam
``device/seams.sequence`` gives each batch entry its rows):

- varlen: q ``(total_q, Hq, D)`` is seen as one batch entry whose rows the offsets cut
  into sequences: strides ``(0, head, row, col)``; the grid's tile axis counts every
  sequence's tiles in turn (``device/seams.packed_tile`` finds a block's sequence), so no
  block falls past its sequence's end but for the at most ``batch`` that round the axis
  up. lse and delta are ``(Hq, total_q)``.
- KV cache: the cache is the key/value array, a sequence's key count
  ``cache_seqlens[b] + Nnew`` is read per block; a paged cache is read through its block
  table. With one query row and grouped heads (decoding), the group's query heads become
  the rows of one block (q ``(B, 1, Hq, D)`` viewed as ``(B, Hkv, group, D)``, no copy), so
  each key/value tile is read once per key/value head, not once per query head. Split-KV
  cuts each sequence's keys into ranges computed by separate blocks (grid z) into float32
  partials, merged by their lse (``simt/cache.py``). Where the adapter lends partials of
  a fixed size (JAX under ``jit``: ``max_splits``), the plan keeps to it.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from flashcore._memo import Memo

from . import launch, tensor_maps, tilings
from .device.convert import SIMULATOR
from .driver import sm_count, synchronize


def _rows(ad, x, keep):
    """A packed ``(total, H, D)`` array as the kernels' (handle, (B, H, N, D) strides) with
    batch stride 0 (every sequence's rows are found from the offsets)."""
    handle, (sn, sh, sd) = ad.raw(x, keep)
    return handle, (0, sh, sn, sd)


def forward(ad, q, k, v, case):
    if case.varlen is not None:
        return _varlen_forward(ad, q, k, v, case)
    return _kvcache_forward(ad, q, k, v, case)


def _inputs(ad, case, like, keep):
    margs = ad.mod_args(case, keep)
    return {"slopes": ad.slopes(case, keep), "margs": margs,
            "classes": ad.tile_classes(case, like, keep, margs)}


def _varlen_forward(ad, q, k, v, case):
    dev = ad.device_index(case)
    vl = case.varlen
    o = ad.empty(q, None, None, dev)
    lse = ad.empty(q, (case.heads_q, vl.total_q), "float32", dev)
    if vl.total_q == 0 or case.heads_q == 0:
        return o, lse
    keep = []
    at = ad.address(lse, keep)
    pk = launch.packed_args(cu_q=ad.int32(vl.cu_seqlens_q, keep),
                            cu_k=ad.int32(vl.cu_seqlens_k, keep), total_q=vl.total_q,
                            nseq=case.batch, buffer=at)
    stream = ad.stream(q, dev)
    launch.run_forward(case, dev, stream, _rows(ad, q, keep), _rows(ad, k, keep),
                       _rows(ad, v, keep), _rows(ad, o, keep), at, packed=pk,
                       **_inputs(ad, case, q, keep))
    if ad.synchronous:
        synchronize(stream, dev)
    return o, lse


def backward(ad, do, q, k, v, o, lse, case):
    """dq, dk, dv of a varlen call (the KV cache has no backward)."""
    dev = ad.device_index(case)
    vl = case.varlen
    dq = ad.empty(q, None, None, dev)
    dk = ad.empty(k, None, None, dev)
    dv = ad.empty(v, None, None, dev)
    if case.heads_q == 0 or (vl.total_q == 0 and vl.total_k == 0):
        return dq, dk, dv
    keep = []
    delta = ad.empty(q, (case.heads_q, max(1, vl.total_q)), "float32", dev, poison=False)
    dat = ad.address(delta, keep)
    lse = ad.as_float32(lse)
    keep.append(lse)
    lh, (l0, l1) = ad.raw(lse, keep)
    pk = launch.packed_args(cu_q=ad.int32(vl.cu_seqlens_q, keep),
                            cu_k=ad.int32(vl.cu_seqlens_k, keep), total_q=vl.total_q,
                            nseq=case.batch, buffer=dat)
    stream = ad.stream(q, dev)
    launch.run_backward(case, dev, stream, _rows(ad, do, keep), _rows(ad, q, keep),
                        _rows(ad, k, keep), _rows(ad, v, keep), _rows(ad, o, keep),
                        (lh, (0, l0, l1)), dat, _rows(ad, dq, keep), _rows(ad, dk, keep),
                        _rows(ad, dv, keep), packed=pk, **_inputs(ad, case, q, keep))
    if ad.synchronous:
        synchronize(stream, dev)
    return dq, dk, dv


def _bhnd(ad, x, keep):
    """A ``(B, N, H, D)`` array as (handle, (B, H, N, D) strides)."""
    handle, (sb, sn, sh, sd) = ad.raw(x, keep)
    return handle, (sb, sh, sn, sd)


def packs_heads(case) -> bool:
    """Whether a KV-cache call's query heads of one group become rows of one block: one
    query row (every head's row then sits at the same position, after every key), grouped
    heads, and nothing that tells the heads or positions apart (a window, ALiBi, a
    score_mod or mask_mod)."""
    m = case.mods
    plain = m is None or (m.window is None and m.alibi is None and m.score_mod is None
                          and m.mask_mod is None)
    return case.seqlen_q == 1 and case.group > 1 and plain


def _lengths(ad, kc, like, keep, dev, stream, capturing):
    """``(seqlens, seqk, slot)``: handles of int32 device arrays of ``cache_seqlens`` (where
    the append writes) and of ``cache_seqlens + n_new`` (the keys attended; None where the
    append kernel is to write it, into a buffer of :func:`_workspace`), and a slot of
    ``tensor_maps``' values ring holding them (None: not there; else
    :func:`tensor_maps.used` after the last launch that reads them). Lengths given on the host (a NumPy array: the
    front end's copy) are copied to the GPU on the call's stream, so nothing waits for it:
    through the ring where the adapter ``stages_lengths`` (one small copy from a pinned
    slot, no allocation), else by the adapter's :meth:`host_lengths`; refused while the
    stream is captured into a graph. Lengths on the device are used there."""
    lens = kc.cache_seqlens
    if isinstance(lens, np.ndarray):
        if capturing:
            raise ValueError(
                "cache_seqlens given on the host cannot be captured into a CUDA graph (the "
                "graph would replay the lengths of its capture, from a host buffer freed "
                "since): give the graph's step its lengths on the GPU")
        B = lens.shape[0]
        if ad.stages_lengths and not SIMULATOR and 8 * B <= tensor_maps.VALUES_BYTES:
            data = np.concatenate((lens, lens + kc.n_new)).astype(np.int32).tobytes()
            at, slot = tensor_maps.put_values(dev, stream, data)
            return at, at + 4 * B, slot
        return (*ad.host_lengths(lens, kc.n_new, like, keep), None)
    seqlens = ad.int32(lens, keep)
    if not kc.n_new:
        return seqlens, seqlens, None
    return (seqlens, None if ad.allocates else ad.int32(lens, keep, plus=kc.n_new), None)


#: Per kind of KV-cache call (what the case says but its arrays and lengths, its views'
#: strides and alignment, the switches): ``(packs, lcase, shape)`` of :func:`_plan_now`.
#: In a decode loop every step is one kind, so each step looks its plan up.
_PLANS = Memo(64)


def _plan(case, dev, qv, kv, vv, tc_ok):
    """:func:`_plan_now`, kept per kind of call. The key names the case's fields rather
    than holding the case, which carries the call's arrays (the new keys, the lengths)."""
    if SIMULATOR:  # (a view's handle is an array there: no key)
        return _plan_now(case, dev, qv, kv, vv, tc_ok)
    kc = case.kvcache
    key = (case.library, case.device, case.dtype, case.batch, case.heads_q, case.heads_kv,
           case.seqlen_q, case.seqlen_k, case.head_dim, case.causal, case.scale,
           case.need_lse, case.explicit, case.mods, kc.paged, kc.page_size, kc.num_pages,
           kc.pages_per_seq, kc.n_new, kc.num_splits, dev, qv[1], kv[1], vv[1], qv[0] & 15,
           kv[0] & 15, vv[0] & 15, tc_ok, os.environ.get(launch.TC_ENV),
           os.environ.get(launch.HOPPER_ENV), os.environ.get(tilings.DECODE_ENV))
    return _PLANS.get_or_build(key, _plan_now, case, dev, qv, kv, vv, tc_ok)


def _plan_now(case, dev, qv, kv, vv, tc_ok):
    """``(packs, lcase, shape)``: whether a group's query heads become the rows of one
    block (:func:`packs_heads`); the case the kernels then see (``Hkv`` heads of ``group``
    rows, not causal, without the call's arrays: only its kind is read), else None (they
    see the call's case); and the forward kernel's shape (:func:`launch.forward_shape`)."""
    packs = packs_heads(case)
    lcase = None
    if packs:
        kc = case.kvcache
        lcase = replace(case, heads_q=case.heads_kv, seqlen_q=case.group, causal=False,
                        alibi_slopes=None, mod_args=(),
                        kvcache=replace(kc, cache_seqlens=None, block_table=None,
                                        k_new=None, v_new=None, max_seqlen_k=0))
        qv = _grouped(qv, case.group)
    return packs, lcase, launch.forward_shape(lcase or case, dev, qv, kv, vv, tc_ok)


def _grouped(view, g):
    """q's or o's view as ``Hkv`` heads of ``g`` rows each (the group's query heads): no
    copy."""
    h, (sb, sh, _, sd) = view
    return h, (sb, g * sh, sh, sd)


def _workspace(ad, like, dev, splits, rows, D, ends, keep):
    """Handles ``(opart, lpart, ends)``: the split-KV partials ``(splits, rows, D)`` and
    ``(splits, rows)``, float32, where ``splits > 1`` (else None), and an int32 ``(B,)``
    buffer for the key counts the append writes where ``ends`` is that B (else None). One
    allocation where handles are addresses; an adapter that lends its buffers lends the
    partials as two (and never needs ``ends``), and the simulator's handles are arrays of
    their own dtype."""
    part = splits * rows * (D + 1) if splits > 1 else 0
    if SIMULATOR or not ad.allocates:
        bufs = [ad.empty(like, (splits, rows, D), "float32", dev),
                ad.empty(like, (splits, rows), "float32", dev)] if part else [None, None]
        bufs.append(ad.empty(like, (ends,), "int32", dev, poison=False) if ends else None)
        return tuple(None if b is None else ad.address(b, keep) for b in bufs)
    words = part + (ends or 0)
    if not words:
        return None, None, None
    buf = ad.empty(like, (words,), "float32", dev)
    keep.append(buf)  # (until the kernels that use it are queued)
    at = ad.address(buf, keep)
    ph = at if part else None
    lph = at + 4 * splits * rows * D if part else None
    return ph, lph, at + 4 * part if ends else None


def _kvcache_forward(ad, q, k_cache, v_cache, case):
    dev = ad.device_index(case)
    kc = case.kvcache
    B, Nq, Hq = case.batch, case.seqlen_q, case.heads_q
    rows = B * Hq * Nq
    keep = []
    stream = ad.stream(q, dev)
    o = ad.empty(q, None, None, dev)
    # lse that nobody asked for goes to the adapter's scratch buffer where it keeps one
    lse = None
    at = None if case.need_lse else ad.scratch(q, rows, dev)
    if at is None:
        lse = ad.empty(q, (B, Hq, Nq), "float32", dev)
    capturing = ad.capturing(stream, dev)
    seqlens, seqk, slot = (_lengths(ad, kc, q, keep, dev, stream, capturing) if B else
                           (None, None, None))
    try:
        return _attend(ad, q, k_cache, v_cache, case, dev, stream, o, lse, at, seqlens, seqk,
                       keep, capturing)
    finally:  # (the slot holding host lengths is read by the launches queued above)
        tensor_maps.used(dev, stream, slot, values=True)


def _attend(ad, q, k_cache, v_cache, case, dev, stream, o, lse, at, seqlens, seqk, keep,
            capturing):
    """The append (where there are new keys) and the attention of a KV-cache call whose
    outputs and lengths :func:`_kvcache_forward` made; returns ``(o, lse)``. A call captured
    into a CUDA graph splits the keys for the cache's capacity, not for the lengths it
    was checked with: its replays read the lengths then (the graph's queries see every
    key up to the capacity, however far the lengths have grown)."""
    kc = case.kvcache
    B, Nq, Hq, D = case.batch, case.seqlen_q, case.heads_q, case.head_dim
    rows = B * Hq * Nq
    table, tsb = 0, 0
    if kc.paged and B:
        table, tsb = ad.int32(kc.block_table, keep), kc.pages_per_seq
    if rows == 0:  # (no query rows: the append alone)
        if kc.n_new and B:
            _append(ad, case, dev, stream, k_cache, v_cache, seqlens, (table, tsb), None,
                    keep)
        if ad.synchronous:
            synchronize(stream, dev)
        return o, lse
    if at is None:
        at = ad.address(lse, keep)
    inputs = _inputs(ad, case, q, keep)  # (before anything is written: its errors too)
    qv, ov = _bhnd(ad, q, keep), _bhnd(ad, o, keep)
    kv, vv = _bhnd(ad, k_cache, keep), _bhnd(ad, v_cache, keep)
    caches = None  # (the caller's caches, where the attention reads copies)
    if kc.paged and kv[1][0] != vv[1][0]:
        # The kernels read both pools with one page stride: the attention reads C-contiguous
        # copies (a rare layout, paid for by a copy), and the new keys go into both the
        # caller's caches and the copies, once every buffer is allocated (below).
        caches = (k_cache, v_cache)
        k_cache, v_cache = ad.contiguous(k_cache), ad.contiguous(v_cache)
        keep.extend((k_cache, v_cache))
        kv, vv = _bhnd(ad, k_cache, keep), _bhnd(ad, v_cache, keep)
    psp = 0
    tc_ok = True
    if kc.paged:  # pages through the table: batch strides 0, the page stride apart
        psp = kv[1][0]
        elems = 4 if case.dtype == "float32" else 8  # 16 bytes
        tc_ok = psp % elems == 0 and vv[1][0] == psp
        kv = (kv[0], (0, *kv[1][1:]))
        vv = (vv[0], (0, *vv[1][1:]))
    packs, lcase, shape = _plan(case, dev, qv, kv, vv, tc_ok)
    if packs:
        qv, ov = _grouped(qv, case.group), _grouped(ov, case.group)
    lcase = lcase or case
    sms = sm_count(dev)
    longest = case.seqlen_k if capturing else kc.max_seqlen_k
    splits, chunk = launch.split_plan(lcase, shape, kc.num_splits, sms, longest)
    most = ad.max_splits()  # (lent partials, sized before the lengths were known)
    if most is not None and splits > most:
        splits, chunk = launch.split_plan(lcase, shape, most, sms, longest)
    ph, lph, ends = _workspace(ad, q, dev, splits, rows, D,
                               B if kc.n_new and seqk is None else 0, keep)
    if kc.n_new:  # 1. the new keys and values, in place (and where asked, their ends)
        if caches is not None:  # (the caller's, then the copies the attention reads)
            _append(ad, case, dev, stream, *caches, seqlens, (table, tsb), None, keep)
        _append(ad, case, dev, stream, k_cache, v_cache, seqlens, (table, tsb), ends, keep)
        seqk = ends if seqk is None else seqk
    base = {"seqk": seqk, "table": table if kc.paged else None, "tsb": tsb,
            "page": kc.page_size if kc.paged else 1, "psp": psp, "buffer": at}
    if splits == 1:
        launch.run_forward(lcase, dev, stream, qv, kv, vv, ov, at,
                           packed=launch.packed_args(**base), tc_ok=tc_ok, **inputs)
    else:  # 2. split-KV: float32 partials, then the merge
        hq, nq = lcase.heads_q, lcase.seqlen_q
        pview = (ph, (hq * nq * D, nq * D, D, 1))
        pk = launch.packed_args(**base, chunk=chunk, oss=rows * D, lss=rows)
        launch.run_forward(lcase, dev, stream, qv, kv, vv, pview, lph, packed=pk,
                           split=(splits, chunk), tc_ok=tc_ok, **inputs)
        launch.run_merge(lcase, dev, stream, ph, lph, ov, at, splits)
    if ad.synchronous:
        synchronize(stream, dev)
    return o, lse


def _append(ad, case, dev, stream, k_cache, v_cache, seqlens, table, ends, keep):
    """The call's new keys and values into the caches, in one launch (``ends``: where it
    writes ``cache_seqlens + n_new`` too, or None)."""
    kc = case.kvcache
    launch.run_append(case, dev, stream, ad.raw(kc.k_new, keep), ad.raw(k_cache, keep),
                      ad.raw(kc.v_new, keep), ad.raw(v_cache, keep), seqlens, table,
                      kc.page_size if kc.paged else 1, ends)
