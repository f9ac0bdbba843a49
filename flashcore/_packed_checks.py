"""Argument checks of the packed calls (varlen and KV cache): shapes, dtypes, and the values
of the offsets, lengths and page table, read on the host. Errors name the argument and its
value; everything is checked before a backend is called, so a rejected call writes nothing.
"""
from __future__ import annotations

import numbers
import weakref

import numpy as np

from . import _dispatch, _interop
from ._case import Case, KVCache, Varlen, evolve
from ._checks import _arrays, _dtype, check_backward_inputs, check_heads, check_options
from ._memo import Memo, typed
from ._mods import check_mods, options_key, with_arrays

#: Integer dtypes accepted for offsets, lengths and page tables (int32 is FA2's; int64 is
#: what torch.arange and NumPy give by default).
INDEX_DTYPES = ("int32", "int64")


def _shape(name, x, ndim, dims):
    shape = tuple(int(n) for n in x.shape)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}; got {name}.shape={shape}")
    return shape


def _index_array(name, x, ndim, dims):
    dt = _interop.dtype_name(x)
    if dt not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an integer array (int32); got {name}.dtype={dt}")
    return _shape(name, x, ndim, dims)


def host_ints(x, library) -> np.ndarray:
    """The values of an index array, as int64 on the host (a copy from a GPU). A torch
    GPU tensor read before and not written since (same object, storage and version
    counter, which every in-place write bumps) gives the values read then, without a
    copy and the synchronization it costs: the backward of a varlen call, or a decode
    loop's block table, reads them once."""
    if isinstance(x, np.ndarray):  # (host lengths of a call on a GPU: see _on_host)
        return np.asarray(x, dtype=np.int64)
    if library == "torch" and getattr(x, "is_cuda", False):
        key = (id(x), x.data_ptr(), x._version, tuple(x.shape), str(x.dtype))
        hit = _READ.get(key)
        if hit is not None and hit[0]() is x:
            return hit[1]
        vals = np.asarray(_interop.copy_to_host(x, library), dtype=np.int64)
        vals.flags.writeable = False
        if len(_READ) >= _READ.max_size:
            _READ.clear()
        _READ[key] = (weakref.ref(x), vals)
        return vals
    return np.asarray(_interop.copy_to_host(x, library), dtype=np.int64)


#: (id, address, version, shape, dtype) of a torch GPU tensor -> (weak reference, values)
_READ = Memo(64, plans=False)


def sequence_lengths(varlen, library) -> tuple:
    """``(rows, keys)``: each sequence's query rows and keys of a varlen call, int64 on the
    host, from its offsets as :func:`host_ints` reads them (a torch GPU tensor the call's
    checks read is not copied again)."""
    return tuple(np.diff(host_ints(cu, library))
                 for cu in (varlen.cu_seqlens_q, varlen.cu_seqlens_k))


# --- varlen -------------------------------------------------------------------------------


def check_cu_seqlens(name, cu, total):
    """Offsets of length batch + 1: from 0, non-decreasing, ending at ``total``."""
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have length batch + 1 >= 1; got an empty array")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0]={int(cu[0])}")
    steps = np.diff(cu)
    if np.any(steps < 0):
        s = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing; got {name}[{s}]={int(cu[s])} > "
                         f"{name}[{s + 1}]={int(cu[s + 1])}")
    if cu[-1] != total:
        side = "q" if name.endswith("_q") else "k"
        raise ValueError(f"{name} must end at the total number of rows of {side} ({total}); "
                         f"got {name}[-1]={int(cu[-1])}")
    return int(steps.max()) if steps.size else 0


def check_max_seqlen(name, given, longest):
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):
        raise TypeError(f"{name} must be an int or None; got {name}={given!r}")
    if given < longest:
        raise ValueError(f"{name}={int(given)} is less than the longest sequence ({longest})")
    return int(given)


def make_varlen_case(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                     causal, scale, direction="forward", need_lse=False, explicit=False,
                     extra=None, options=None, values=True) -> Case:
    """Check a varlen call (``extra`` = {"do", "o", "lse"} for the backward) and describe
    it. ``values=False`` checks shapes and dtypes only (traced arrays have no values; the
    host side of the call checks them when it runs)."""
    named = {"q": q, "k": k, "v": v}
    library, device = _arrays({**named, "cu_seqlens_q": cu_seqlens_q,
                               "cu_seqlens_k": cu_seqlens_k, **(extra or {})})
    dtype = _dtype(named)
    qs = _shape("q", q, 3, "(total_q, Hq, D)")
    ks = _shape("k", k, 3, "(total_k, Hkv, D)")
    vs = _shape("v", v, 3, "(total_k, Hkv, D)")
    if ks != vs:
        raise ValueError(f"k and v must have one shape; got k.shape={ks}, v.shape={vs}")
    Hq, Hkv, D = check_heads(qs, ks, 1, 1)
    (cq,) = _index_array("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    (ck,) = _index_array("cu_seqlens_k", cu_seqlens_k, 1, "(batch + 1,)")
    if cq != ck:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1); got "
                         f"{cq} and {ck}")
    if cq < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1; got an empty array")
    scale = check_options(causal=causal, scale=scale, layout="bnhd", head_dim=D)
    if values:
        lq = check_cu_seqlens("cu_seqlens_q", host_ints(cu_seqlens_q, library), qs[0])
        lk = check_cu_seqlens("cu_seqlens_k", host_ints(cu_seqlens_k, library), ks[0])
    else:
        lq, lk = qs[0], ks[0]
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    batch = cq - 1
    if extra:
        check_backward_inputs(extra, qs, dtype, (Hq, qs[0]), "(Hq, total_q)")
    mods, arrays = _mods_of(options, library, device, batch, Hq, max_q, max_k)
    return Case(library=library, device=device, dtype=dtype, batch=batch, heads_q=Hq,
                heads_kv=Hkv, seqlen_q=max_q, seqlen_k=max_k, head_dim=D, causal=bool(causal),
                scale=scale, layout="bnhd", direction=direction, need_lse=need_lse,
                explicit=explicit, mods=mods, **arrays,
                varlen=Varlen(total_q=qs[0], total_k=ks[0], cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k))


#: Checked varlen calls: key (see _varlen_key) -> (case, backend module)
_VARLEN_PLANS = Memo(64)


def varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, backend, **kw):
    """``(case, backend module)`` of a varlen call (``kw``: :func:`make_varlen_case`'s
    keywords): checked and selected once per kind of call and pair of offsets arrays, then
    looked up; the checks and the selection cost more host time than the kernel of a
    small call. Kept only where a write to the offsets changes the key: torch GPU tensors,
    keyed as :func:`host_ints` keys them (object, address, version counter); the kept case
    holds those tensors, so no other object takes their ids while it is kept. Other calls
    are checked every time. The option arrays (ALiBi slopes, mod_args) join the case per
    call."""
    key = _varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, backend, kw)
    case, impl = _VARLEN_PLANS.get_or_build(key, _varlen_build, q, k, v, cu_seqlens_q,
                                            cu_seqlens_k, backend, kw)
    options = kw.get("options")
    return (case if options is None else with_arrays(case, options)), impl


def _varlen_build(q, k, v, cu_seqlens_q, cu_seqlens_k, backend, kw):
    case = make_varlen_case(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
    return case, _dispatch.select(case, backend)


def _offsets_key(x):
    """What keys a torch GPU index tensor (offsets, a block table: its values were read
    for the checks; any in-place write bumps the version); TypeError for any other array."""
    if not getattr(x, "is_cuda", False) or not hasattr(x, "_version"):
        raise TypeError("offsets without a version counter")
    return (id(x), x.data_ptr(), x._version, tuple(x.shape), x.dtype)


def _varlen_key(q, k, v, cu_q, cu_k, backend, kw):
    """The memo key of a varlen call, or None where one part cannot key it (an unhashable
    part makes the memo build every time too)."""
    try:
        extra = kw.get("extra") or {}
        arrays = tuple((n, type(x), tuple(x.shape), x.dtype, x.device) for n, x in
                       (("q", q), ("k", k), ("v", v), *sorted(extra.items())))
        rest = tuple((n, typed(kw[n])) for n in sorted(kw) if n not in ("extra", "options"))
        options = kw.get("options")
        return (arrays, _offsets_key(cu_q), _offsets_key(cu_k), backend, rest,
                options_key(options))
    except (AttributeError, TypeError):
        return None


def _mods_of(options, library, device, B, Hq, Nq, Nk):
    if not options:
        return None, {}
    if options.get("block_mask") is not None:
        raise ValueError("block_mask is not taken by packed calls (their tiles are per "
                         "sequence); pass mask_mod alone")
    mods = check_mods(**options, library=library, device=device, B=B, Hq=Hq, Nq=Nq, Nk=Nk)
    if mods is None:
        return None, {}
    return mods, {"alibi_slopes": options.get("alibi_slopes"),
                  "mod_args": tuple(options.get("mod_args") or ())}


# --- KV cache -----------------------------------------------------------------------------


def check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 0; got num_splits={num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: chosen by flashcore); got "
                         f"num_splits={int(num_splits)}")
    return int(num_splits)


def make_kvcache_case(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, *,
                      causal, scale, num_splits, need_lse=False, explicit=False, options=None,
                      values=True, in_place=True) -> Case:
    """Check a KV-cache call and describe it (``values=False``: shapes and dtypes only;
    ``in_place=False``: the caller appends the new keys itself, as the JAX glue does)."""
    kind, on_host, lengths, max_k = _kvcache_kind(
        q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal=causal, scale=scale,
        num_splits=num_splits, need_lse=need_lse, explicit=explicit, options=options,
        in_place=in_place, values=values)
    case = _attach(kind, lengths, k, v, block_table, max_k)
    return case if options is None else with_arrays(case, options)


#: Checked KV-cache calls: key (see _kvcache_key) -> (the call's kind, lengths on the
#: host, backend module)
_KVCACHE_PLANS = Memo(64)


def kvcache_plan(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend, **kw):
    """``(case, backend module)`` of a KV-cache call (``kw``: :func:`make_kvcache_case`'s
    keywords but ``values``): its shapes, dtypes, devices and options checked and its
    backend selected once per kind of call, then looked up (in a decode loop every step is
    one kind: on a GPU they were a third of a step's host time); the values (lengths
    within the capacity, pages inside the pool) checked on every call, since they change
    from step to step. The arrays join the case per call. The first call of a kind is
    checked in :func:`make_kvcache_case`'s order (its errors are the same)."""
    key = _kvcache_key(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend, kw)
    built = []  # (the first call of a kind: its case, checked by the build)
    kind, on_host, impl = _KVCACHE_PLANS.get_or_build(
        key, _kvcache_build, q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend,
        kw, built)
    if built:
        return built[0], impl
    case = kvcache_values(kind, on_host, cache_seqlens, k, v, block_table)
    options = kw.get("options")
    return (case if options is None else with_arrays(case, options)), impl


def _kvcache_build(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend, kw,
                   built):
    kind, on_host, lengths, max_k = _kvcache_kind(q, k_cache, v_cache, cache_seqlens, k, v,
                                                  block_table, **kw)
    case = _attach(kind, lengths, k, v, block_table, max_k)
    options = kw.get("options")
    case = case if options is None else with_arrays(case, options)
    built.append(case)
    return kind, on_host, _dispatch.select(case, backend)  # (it reads the option arrays)


def _kvcache_key(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend, kw):
    """The memo key of a KV-cache call (what :func:`_kvcache_kind` reads: the arrays'
    types, shapes, dtypes and devices, whether NumPy caches are writable, the keywords and
    their types), or None where one part cannot key it."""
    try:
        arrays = tuple(None if x is None else (type(x), x.shape, x.dtype, x.device)
                       for x in (q, k_cache, v_cache, cache_seqlens, k, v, block_table))
        writable = tuple(x.flags.writeable for x in (k_cache, v_cache)
                         if isinstance(x, np.ndarray))
        options = kw.get("options")
        return (arrays, writable, backend, typed(kw["causal"]), typed(kw["scale"]),
                typed(kw["num_splits"]), kw.get("need_lse", False), kw.get("explicit", False),
                kw.get("in_place", True), options_key(options))
    except (AttributeError, TypeError):
        return None


def _kvcache_kind(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, *,
                  causal, scale, num_splits, need_lse=False, explicit=False, options=None,
                  in_place=True, values=True) -> tuple:
    """``(case, on_host, lengths, max_k)``: the call's case without its arrays and values;
    whether ``cache_seqlens`` is read on the host (:func:`_on_host`); the lengths the
    case is to carry (:func:`_host_copy` of host lengths, else ``cache_seqlens``); and
    where ``values``, their longest key range, checked after the shapes and before the
    options (0 without)."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together; got k={_what(k)}, v={_what(v)}")
    # (written in place, the values would overwrite the keys; JAX's functional append,
    # in_place False, may take one array for both)
    if k is not None and in_place and k_cache is v_cache:
        raise ValueError("k_cache and v_cache must be two arrays to append k and v into; "
                         f"got one array for both ({_what(k_cache)})")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        named.update(k=k, v=v)
    everything = dict(named)
    if block_table is not None:
        everything["block_table"] = block_table
    on_host = _on_host(cache_seqlens, everything)
    if not on_host:
        everything["cache_seqlens"] = cache_seqlens
    library, device = _arrays(everything)
    dtype = _dtype(named)
    qs = _shape("q", q, 4, "(B, Nq, Hq, D)")
    cs = _shape("k_cache", k_cache, 4, "(B, capacity, Hkv, D) or (num_pages, page_size, Hkv, D)")
    vcs = _shape("v_cache", v_cache, 4, "like k_cache")
    if cs != vcs:
        raise ValueError(f"k_cache and v_cache must have one shape; got k_cache.shape={cs}, "
                         f"v_cache.shape={vcs}")
    B, Nq = qs[0], qs[1]
    Hq, Hkv, D = check_heads(qs, cs, 2, 2, "k_cache")
    (nb,) = _index_array("cache_seqlens", cache_seqlens, 1, "(B,)")
    if nb != B:
        raise ValueError(f"cache_seqlens must have shape (B,) = {(B,)}; got "
                         f"cache_seqlens.shape={(nb,)}")
    n_new = 0
    if k is not None:
        want = (B, int(k.shape[1]) if len(k.shape) == 4 else -1, Hkv, D)
        for name, x in (("k", k), ("v", v)):
            s = _shape(name, x, 4, "(B, Nnew, Hkv, D)")
            if s != want:
                raise ValueError(f"{name} must have shape (B, Nnew, Hkv, D) = {want}; got "
                                 f"{name}.shape={s}")
        n_new = want[1]
        if in_place and library == "numpy":
            for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not x.flags.writeable:
                    raise ValueError(f"{name} is read-only; the new keys are written into it "
                                     "in place")
    if block_table is None:
        if cs[0] != B:
            raise ValueError(f"a contiguous k_cache must have shape (B, capacity, Hkv, D) with "
                             f"B={B} (q's); got k_cache.shape={cs}")
        paged, page_size, num_pages, pages_per_seq = False, cs[1], B, 1
    else:
        bs = _index_array("block_table", block_table, 2, "(B, max_pages_per_seq)")
        if bs[0] != B:
            raise ValueError(f"block_table must have shape (B, max_pages_per_seq) with B={B}; "
                             f"got block_table.shape={bs}")
        paged, page_size, num_pages, pages_per_seq = True, cs[1], cs[0], bs[1]
    lengths, max_k = _checked_lengths(cache_seqlens, on_host, library, n_new,
                                      page_size * pages_per_seq, paged, page_size, num_pages,
                                      block_table, values)
    scale = check_options(causal=causal, scale=scale, layout="bnhd", head_dim=D)
    num_splits = check_num_splits(num_splits)
    mods, _ = _mods_of(options, library, device, B, Hq, Nq, page_size * pages_per_seq)
    kv = KVCache(paged=paged, page_size=page_size, num_pages=num_pages,
                 pages_per_seq=pages_per_seq, n_new=n_new, num_splits=num_splits)
    return Case(library=library, device=device, dtype=dtype, batch=B, heads_q=Hq,
                heads_kv=Hkv, seqlen_q=Nq, seqlen_k=page_size * pages_per_seq, head_dim=D,
                causal=bool(causal), scale=scale, layout="bnhd", need_lse=need_lse,
                explicit=explicit, mods=mods, kvcache=kv), on_host, lengths, max_k


def kvcache_values(kind, on_host, cache_seqlens, k, v, block_table) -> Case:
    """The case of one call of ``kind`` (:func:`_kvcache_kind`): its lengths and pages
    checked, its arrays attached (lengths on the host as :func:`_host_copy`)."""
    kc = kind.kvcache
    lengths, max_k = _checked_lengths(cache_seqlens, on_host, kind.library, kc.n_new,
                                      kind.seqlen_k, kc.paged, kc.page_size, kc.num_pages,
                                      block_table)
    return _attach(kind, lengths, k, v, block_table, max_k)


def _checked_lengths(cache_seqlens, on_host, library, n_new, capacity, paged, page_size,
                     num_pages, block_table, values=True) -> tuple:
    """``(lengths, max_k)``: the lengths a case carries (:func:`_host_copy` of host ones,
    else ``cache_seqlens``) and, where ``values``, their longest key range after the
    checks of :func:`_check_cache_values` (0 without)."""
    lengths = _host_copy(cache_seqlens) if on_host else cache_seqlens
    if not values:
        return lengths, 0
    return lengths, _check_cache_values(lengths if on_host else host_ints(lengths, library),
                                        n_new, capacity, paged, page_size, num_pages,
                                        block_table, library)


def _attach(kind, lengths, k, v, block_table, max_k) -> Case:
    return evolve(kind, kvcache=evolve(kind.kvcache, cache_seqlens=lengths,
                                       block_table=block_table, k_new=k, v_new=v,
                                       max_seqlen_k=max_k))


def _host_copy(x) -> np.ndarray:
    """Host lengths (a NumPy array or a CPU torch tensor) as a read-only int64 copy."""
    out = np.array(x if isinstance(x, np.ndarray) else x.detach().numpy(), dtype=np.int64)
    out.flags.writeable = False
    return out


def _on_host(x, named) -> bool:
    """Whether ``cache_seqlens`` is given on the host for arrays elsewhere (a NumPy array
    beside any library's arrays, or a CPU torch tensor beside torch GPU tensors): its
    values are then read with no synchronization (a GPU backend uploads them on the call's
    stream); False where it is checked like the other arrays (same library and device)."""
    lib = _interop.library_of(x)
    library = _interop.library_of(named["q"])
    if lib == "numpy":
        if library in ("numpy", None):
            return False
    elif lib != "torch" or library != "torch" or x.device.type != "cpu" or \
            named["q"].device.type == "cpu":
        return False
    _index_array("cache_seqlens", x, 1, "(B,)")
    return True


def _what(x):
    return "None" if x is None else f"an array of shape {tuple(int(n) for n in x.shape)}"


def _check_cache_values(seqlens, n_new, capacity, paged, page_size, num_pages, block_table,
                        library) -> int:
    """Lengths within the capacity and used pages inside the pool; the longest key range.
    (In Python over the lengths' list: a decode step has a few of them, for which NumPy's
    per-operation cost is most of the checks' time; the page table's check per row is
    kept per read-only table, :func:`_table_facts`.)"""
    lens = seqlens.tolist()
    if not lens:
        return 0
    if min(lens) < 0:
        b = next(b for b, n in enumerate(lens) if n < 0)
        raise ValueError(f"cache_seqlens must be >= 0; got cache_seqlens[{b}]={lens[b]}")
    longest = max(lens) + n_new
    if longest > capacity:
        b = next(b for b, n in enumerate(lens) if n + n_new > capacity)
        where = ("the cache's capacity" if not paged else
                 f"the pages of the block table ({capacity // page_size} pages of "
                 f"{page_size})" if page_size else "the pages of the block table (pages "
                 "of 0 keys)")
        raise ValueError(f"cache_seqlens[{b}] + Nnew = {lens[b]} + {n_new} = "
                         f"{lens[b] + n_new} keys exceed {where}: {capacity}")
    if paged and page_size:  # (pages of 0 keys: a capacity of 0, no page used)
        table = host_ints(block_table, library)
        first, repeated = _table_facts(table, num_pages, block_table)
        used = [-(-(n + n_new) // page_size) for n in lens]  # (pages each row uses)
        for b, (u, p) in enumerate(zip(used, first)):
            if u > p:  # (row b uses page p, outside the pool)
                raise ValueError(f"block_table[{b}, {p}]={int(table[b, p])} points outside "
                                 f"the page pool of k_cache (pages 0..{num_pages - 1})")
        if n_new and repeated is not None:
            _check_written_pages(table, repeated, lens, used, page_size)
    return longest


def _check_written_pages(table, repeated, lens, used, page_size):
    """A page the append writes into is used by no other slot of the table (``repeated``:
    whether each slot's page is held by another slot too, :func:`_table_facts`; ``used``:
    the pages each row uses after the append): two sequences, or two columns of one, that
    append into one page would overwrite each other's keys. Pages only read may be shared
    (a common prefix's pages), and so may pages in columns past a sequence's keys."""
    written = [(b, p) for b, n in enumerate(lens) for p in range(n // page_size, used[b])
               if repeated[b, p]]
    if not written:
        return
    in_use = np.arange(table.shape[1])[None, :] < np.asarray(used)[:, None]
    for b, p in written:
        page = int(table[b, p])
        same = in_use & (table == page)
        same[b, p] = False
        if same.any():
            c, d = (int(t) for t in np.argwhere(same)[0])
            raise ValueError(f"block_table[{b}, {p}]={page} is a page the append writes "
                             f"k and v into, and block_table[{c}, {d}] uses it too; a page "
                             "written into must belong to one slot of the table")


#: (a torch GPU block table's id, address and version counter, the pool's pages) ->
#: (host_ints' copy of it, :func:`_table_facts` of it)
_TABLE_FACTS = Memo(16)


def _table_facts(table, num_pages, source) -> tuple:
    """``(first, repeated)`` of ``table`` (the host values of the block table ``source``):
    per row, the first column whose page lies outside ``0..num_pages-1`` (the row's width
    where none does: a row is valid for a sequence using fewer pages); and a boolean array
    like ``table``, true where a slot's page (inside the pool) is held by another slot
    too, or None for a table without repeats. Work in the table's size, not the pool's.
    Kept where ``source`` is a torch GPU tensor, by the key
    host_ints reads it by (any in-place write bumps its version), for host_ints' own copy
    of it; an array the caller holds may change under the same object, so it is read
    every call."""
    try:
        key = (_offsets_key(source), num_pages)
    except TypeError:  # (not a torch GPU tensor)
        key = None
    hit = None if key is None else _TABLE_FACTS.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    bad = (table < 0) | (table >= num_pages)
    first = [table.shape[1]] * table.shape[0]
    repeated = None
    if table.size:
        first = np.where(bad.any(axis=1), bad.argmax(axis=1), table.shape[1]).tolist()
        pages = table[~bad]
        if pages.size and num_pages <= 8 * table.size:  # (a count per page of the pool)
            count = np.bincount(pages)
            if count.max() > 1:
                repeated = (count[np.where(bad, 0, table)] > 1) & ~bad
        else:  # (a pool much larger than the table: its pages sorted)
            pages = np.sort(pages)
            twice = pages[1:][pages[1:] == pages[:-1]]
            if twice.size:
                repeated = np.isin(table, twice) & ~bad
    if key is not None:
        if len(_TABLE_FACTS) >= _TABLE_FACTS.max_size:
            _TABLE_FACTS.clear()
        _TABLE_FACTS[key] = (table, (first, repeated))
    return first, repeated
