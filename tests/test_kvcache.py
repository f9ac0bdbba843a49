"""attention_with_kvcache: numba_cpu (with and without split-KV) and the reference against
a per-sequence float64 oracle over a plain loop's gather of the cache
(tests/packed_helpers.py), on contiguous and paged caches with shuffled page tables, with
and without in-place appends (checked element by element), GQA, causal and window, rows
that see no key; every bad input, with the caches untouched after each rejected call;
torch's mutating op and JAX's returned caches.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import TOL_FWD, rel_err
from packed_helpers import oracle_kvcache

import flashcore
from flashcore._interop import np_dtype

B, HQ, HKV, D = 3, 4, 2, 16
PAGE = 8
PAGES_PER_SEQ = 12  # capacity 96 per sequence
#: Cached lengths: an empty cache (with Nq > Nnew, causal rows that see nothing), a
#: short one, one across several pages and key tiles.
SEQLENS = np.array([0, 5, 83], np.int32)


def make_cache(rng, paged, dtype="float64"):
    """(k_cache, v_cache, block_table): a paged pool with the sequences' pages shuffled
    through it (and spare pages), or a contiguous cache; positions past each sequence's
    length hold garbage that must never be read."""
    if paged:
        n_pages = B * PAGES_PER_SEQ + 5
        table = rng.permutation(n_pages)[:B * PAGES_PER_SEQ].reshape(B, PAGES_PER_SEQ)
        shape = (n_pages, PAGE, HKV, D)
        table = table.astype(np.int32)
    else:
        table, shape = None, (B, PAGE * PAGES_PER_SEQ, HKV, D)
    kc = rng.standard_normal(shape).astype(np_dtype(dtype))
    vc = rng.standard_normal(shape).astype(np_dtype(dtype))
    return kc, vc, table


def expected_append(kc, vc, k, v, table):
    """The caches after writing k, v at positions SEQLENS[b] + t, by a plain loop."""
    kc, vc = kc.copy(), vc.copy()
    for b in range(B):
        for t in range(k.shape[1]):
            p = int(SEQLENS[b]) + t
            at = (b, p) if table is None else (table[b, p // PAGE], p % PAGE)
            kc[at], vc[at] = k[b, t], v[b, t]
    return kc, vc


def inputs(seed, paged, nq=2, n_new=2, dtype="float64"):
    """A cache, queries and new keys, and the caches the append must leave."""
    rng = np.random.default_rng(seed)
    kc, vc, table = make_cache(rng, paged, dtype)
    q = rng.standard_normal((B, nq, HQ, D)).astype(kc.dtype)
    k, v = (rng.standard_normal((B, n_new, HKV, D)).astype(kc.dtype) for _ in range(2))
    return (kc, vc, table, q, k, v, *expected_append(kc, vc, k, v, table))


@pytest.mark.parametrize("backend, num_splits", [("numba_cpu", 1), ("numba_cpu", 3),
                                                 ("numba_cpu", 0), ("reference", 0)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_append_and_attend(backend, num_splits, paged, causal):
    n_new = 2
    kc, vc, table, q, k, v, want_k, want_v = inputs(0, paged, nq=3, n_new=n_new)
    o, lse = flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=SEQLENS, k=k, v=v, block_table=table, causal=causal,
        num_splits=num_splits, return_lse=True, backend=backend)
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)  # in place, nothing else
    ref_o, ref_lse = oracle_kvcache(q, want_k, want_v, SEQLENS + n_new, table, PAGE,
                                    causal=causal)
    assert rel_err(o, ref_o) < TOL_FWD["float64"]
    assert lse.dtype == np.float64 and rel_err(lse, ref_lse) < TOL_FWD["float64"]
    if causal:  # sequence 0: 2 keys, 3 queries: the first row sees none
        assert np.all(o[0, 0] == 0) and np.all(lse[0, :, 0] == -np.inf)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_loop(paged):
    """Token by token, as a server decodes: each step appends one key and attends."""
    rng = np.random.default_rng(1)
    kc, vc, table = make_cache(rng, paged)
    lengths = SEQLENS.copy()
    for _ in range(3):
        q = rng.standard_normal((B, 1, HQ, D))
        k, v = (rng.standard_normal((B, 1, HKV, D)) for _ in range(2))
        o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                             block_table=table, window=(40, 0), softcap=5.0)
        lengths = lengths + 1
        for b in range(B):
            p = lengths[b] - 1
            at = (b, p) if table is None else (table[b, p // PAGE], p % PAGE)
            assert np.array_equal(kc[at], k[b, 0]) and np.array_equal(vc[at], v[b, 0])
        ref, _ = oracle_kvcache(q, kc, vc, lengths, table, PAGE, window=(40, 0), softcap=5.0)
        assert rel_err(o, ref) < TOL_FWD["float64"]


def test_no_new_keys_and_alibi():
    rng = np.random.default_rng(2)
    kc, vc, table = make_cache(rng, True)
    q = rng.standard_normal((B, 2, HQ, D))
    slopes = rng.uniform(0.1, 0.5, (B, HQ)).astype(np.float32)
    before = kc.copy()
    o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=SEQLENS, block_table=table,
                                         causal=True, alibi_slopes=slopes)
    assert np.array_equal(kc, before)
    ref, _ = oracle_kvcache(q, kc, vc, SEQLENS, table, PAGE, causal=True, alibi_slopes=slopes)
    assert rel_err(o, ref) < TOL_FWD["float64"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(dtype):
    kc, vc, table, q, k, v, want_k, want_v = inputs(3, True, dtype=dtype)
    o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=SEQLENS, k=k, v=v,
                                         block_table=table, causal=True, num_splits=2)
    assert o.dtype == q.dtype
    assert np.array_equal(kc.view(np.uint8), want_k.view(np.uint8))
    ref, _ = oracle_kvcache(q, want_k, want_v, SEQLENS + 2, table, PAGE, causal=True)
    assert rel_err(o, ref) < TOL_FWD[dtype]


def _bad_cases():
    return [
        ({"k": "k", "v": None}, ValueError, "k and v must be given together"),
        ({"cache_seqlens": np.array([0, 5, 95], np.int32)}, ValueError,
         r"cache_seqlens\[2\] \+ Nnew = 95 \+ 2 = 97 keys exceed"),
        ({"cache_seqlens": np.array([0, -1, 3], np.int32)}, ValueError,
         r"cache_seqlens must be >= 0; got cache_seqlens\[1\]=-1"),
        ({"cache_seqlens": np.array([0, 5, 3], np.float32)}, TypeError,
         "cache_seqlens must be an integer"),
        ({"cache_seqlens": np.array([0, 5], np.int32)}, ValueError, r"cache_seqlens must have shape"),
        ({"block_table": "outside"}, ValueError, r"block_table\[2, 3\]=1000 points outside"),
        # (sequence 1 appends into its page 0, which sequence 2 reads as its page 0)
        ({"block_table": "shared"}, ValueError,
         r"block_table\[1, 0\]=\d+ is a page the append writes k and v into, and "
         r"block_table\[2, 0\] uses it too"),
        ({"block_table": "float"}, TypeError, "block_table must be an integer"),
        ({"block_table": "short"}, ValueError, r"exceed the pages of the block table"),
        ({"k": "wrong_shape"}, ValueError, r"k must have shape \(B, Nnew, Hkv, D\)"),
        ({"k": "float32"}, TypeError, "share one dtype"),
        ({"num_splits": -1}, ValueError, "num_splits must be >= 0"),
        ({"num_splits": 1.5}, TypeError, "num_splits must be an int"),
        ({"q": "3d"}, ValueError, r"q must have 4 dimensions"),
        ({"backend": "torch"}, flashcore.BackendUnavailableError, "torch"),
        # (an int past the kernels' index arithmetic used to fail after the append)
        ({"window": (10**30, 0)}, ValueError, r"window's left bound must be from 0 to 2\*\*31"),
    ]


def _case_id(change):
    return "-".join(f"{a}={b}" if isinstance(b, (str, int)) else a for a, b in change.items())


@pytest.mark.parametrize("change, error, match", [
    pytest.param(*c, id=f"{n}-{_case_id(c[0])}") for n, c in enumerate(_bad_cases())])
def test_bad_inputs_leave_the_cache_untouched(change, error, match):
    kc, vc, table, q, k, v, _, _ = inputs(4, True)
    args = {"cache_seqlens": SEQLENS, "k": k, "v": v, "block_table": table, "q": q}
    for name, what in change.items():
        if not isinstance(what, str):
            args[name] = what
        elif what == "k":
            args[name] = k
        elif what == "outside":
            table = table.copy()
            table[2, 3] = 1000  # a page sequence 2 uses (83 + 2 keys span pages 0..10)
            args["block_table"] = table
        elif what == "shared":
            table = table.copy()
            table[1, 0] = table[2, 0]
            args["block_table"] = table
        elif what == "float":
            args["block_table"] = table.astype(np.float64)
        elif what == "short":
            args["block_table"] = table[:, :4]
        elif what == "wrong_shape":
            args["k"] = k[:, :, :1]
        elif what == "float32":
            args["k"] = k.astype(np.float32)
        elif what == "3d":
            args["q"] = q[0]
        else:
            args[name] = what
    before = kc.copy(), vc.copy()
    with pytest.raises(error, match=match):
        flashcore.attention_with_kvcache(args.pop("q"), kc, vc, **args)
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])


@pytest.mark.parametrize("backend", ["numba_cpu", "reference"])
def test_pages_only_read_may_be_shared(backend):
    """Two sequences with one prefix share its pages (vLLM's prefix caching): allowed while
    no append writes into a shared page; both see the prefix, each its own appended keys.
    Without an append any sharing is allowed."""
    rng = np.random.default_rng(11)
    pool = rng.standard_normal((6, PAGE, HKV, D)), rng.standard_normal((6, PAGE, HKV, D))
    table = np.array([[4, 1, 0], [4, 1, 3]], np.int32)  # pages 4, 1: a 16-key prefix
    lens = np.array([16, 16], np.int32)
    q = rng.standard_normal((2, 2, HQ, D))
    k, v = (rng.standard_normal((2, 2, HKV, D)) for _ in range(2))
    kc, vc = (x.copy() for x in pool)
    o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v,
                                         block_table=table, causal=True, backend=backend)
    for b, page in enumerate((0, 3)):
        assert np.array_equal(kc[page, :2], k[b]) and np.array_equal(vc[page, :2], v[b])
    ref, _ = oracle_kvcache(q, kc, vc, lens + 2, table, PAGE, causal=True)
    assert rel_err(o, ref) < TOL_FWD["float64"]
    # each written page also in the other row's column past its keys (18 keys use 3
    # columns of 8): unused there, so not shared
    spare = np.array([[4, 1, 0, 3], [4, 1, 3, 0]], np.int32)
    kc2, vc2 = (x.copy() for x in pool)
    o2 = flashcore.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens, k=k, v=v,
                                          block_table=spare, causal=True, backend=backend)
    assert np.array_equal(o2, o) and np.array_equal(kc2, kc) and np.array_equal(vc2, vc)
    both = np.array([[4, 1, 0], [4, 1, 0]], np.int32)  # (page 0 read by both, no append)
    o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens + 2, block_table=both,
                                         backend=backend)
    ref, _ = oracle_kvcache(q, kc, vc, lens + 2, both, PAGE)
    assert rel_err(o, ref) < TOL_FWD["float64"]
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match=r"block_table\[0, 2\]=0 is a page the append"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v,
                                         block_table=both, backend=backend)
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])


def test_pages_of_no_keys_take_no_append():
    """A pool of pages of 0 keys has no room: an append is refused by name (it was a
    ZeroDivisionError while the message was written)."""
    kc = np.zeros((4, 0, HKV, D))
    q, k = np.zeros((1, 1, HQ, D)), np.zeros((1, 1, HKV, D))
    with pytest.raises(ValueError, match=r"exceed the pages of the block table \(pages of "
                                         r"0 keys\): 0"):
        flashcore.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=np.zeros(1, np.int32),
                                         k=k, v=k, block_table=np.zeros((1, 2), np.int32))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_one_array_for_both_caches_is_refused(paged):
    """k_cache and v_cache the same array: the values would overwrite the keys."""
    kc, _, table, q, k, v, _, _ = inputs(5, paged)
    before = kc.copy()
    with pytest.raises(ValueError, match="k_cache and v_cache must be two arrays"):
        flashcore.attention_with_kvcache(q, kc, kc, cache_seqlens=SEQLENS, k=k, v=v,
                                         block_table=table)
    assert np.array_equal(kc, before)


def test_a_kind_of_call_is_checked_once_and_its_values_every_call(monkeypatch):
    """The shape checks and the backend's selection run once per kind of call
    (``_packed_checks.kvcache_plan``); every call still checks its own lengths and pages
    (a bad length after good calls of the same kind is refused, the cache untouched), and
    the memo keeps none of a call's arrays (the new keys die with the call)."""
    import gc
    import weakref

    from flashcore import _packed_checks as pc

    kinds = []
    real = pc._kvcache_kind
    monkeypatch.setattr(pc, "_kvcache_kind", lambda *a, **kw: kinds.append(1) or real(*a, **kw))
    pc._KVCACHE_PLANS.clear()
    kc, vc, table, q, k, v, want_k, want_v = inputs(11, True)
    kc0, vc0 = kc.copy(), vc.copy()
    step = lambda lens, k, v: flashcore.attention_with_kvcache(  # noqa: E731
        q, kc, vc, cache_seqlens=lens, k=k, v=v, block_table=table, backend="numba_cpu")
    o = step(SEQLENS, k, v)
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)
    kc[...], vc[...] = kc0, vc0
    o2 = step(SEQLENS.copy(), k, v)
    assert len(kinds) == 1 and np.array_equal(o, o2)
    bad = SEQLENS.copy()
    bad[2] = PAGE * PAGES_PER_SEQ - 1  # + Nnew = 2: one key past the block table's pages
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] \+ Nnew"):
        step(bad, np.zeros_like(k), np.zeros_like(v))
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)
    k2, v2 = k.copy(), v.copy()
    gone = weakref.ref(k2)
    step(SEQLENS, k2, v2)
    del k2, v2
    gc.collect()
    assert gone() is None and len(kinds) == 1


def test_table_facts_per_row_and_repeated_pages():
    """``_table_facts``: per row the first page outside the pool (the width where none
    is), and the slots of every in-pool page held more than once, against plain loops; a
    table of no columns."""
    from flashcore._packed_checks import _table_facts

    rng = np.random.default_rng(12)
    table = rng.integers(-3, 40, (6, 9)).astype(np.int64)
    table[2] = 5  # a row with no bad page
    first, repeated = _table_facts(table, 32, table)
    assert first == [next((p for p, t in enumerate(row) if not 0 <= t < 32), 9)
                     for row in table]
    inside = [int(t) for t in table.ravel() if 0 <= t < 32]
    want = [[0 <= t < 32 and inside.count(t) > 1 for t in row] for row in table]
    assert repeated.tolist() == want
    assert _table_facts(np.zeros((3, 0), np.int64), 32, None) == ([0, 0, 0], None)
    assert _table_facts(np.arange(12).reshape(3, 4), 12, None)[1] is None
    # (pages outside the pool held twice are not repeats: the pool check reports them)
    assert _table_facts(np.array([[0, 40, 40, -1, -1]]), 12, None)[1] is None
    # a pool far larger than the table: its pages sorted instead of counted per page
    big = np.array([[5, 7, 5, 2**40], [2**40, 9, 7, -1]])
    first, repeated = _table_facts(big, 2**30, None)
    assert first == [3, 0]
    assert repeated.tolist() == [[True, True, True, False], [False, False, True, False]]


def test_a_read_only_view_of_a_table_is_read_every_call():
    """A block table the caller holds may change under the same object (a read-only view
    of memory written elsewhere): each call checks its pages again."""
    kc, vc, table, q, k, v, _, _ = inputs(13, True)
    base = table.astype(np.int64)
    view = base.view()
    view.flags.writeable = False
    flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=SEQLENS, k=k, v=v,
                                     block_table=view, backend="numba_cpu")
    base[0, 0] = -1
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]=-1 points outside"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=SEQLENS, k=k, v=v,
                                         block_table=view, backend="numba_cpu")
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])


@pytest.mark.parametrize("bad, error, match", [
    ({"causal": 1}, TypeError, "causal must be True or False"),
    ({"num_splits": 1.0}, TypeError, "num_splits must be an int"),
    ({"scale": True}, TypeError, "scale must be a real number"),
    ({"softcap": True}, TypeError, "softcap"),
    ({"num_splits": -1, "cache_seqlens": np.array([0, -1, 3], np.int32)}, ValueError,
     r"cache_seqlens must be >= 0"),
])
def test_a_known_kind_does_not_let_bad_options_through(bad, error, match):
    """A call whose options equal a checked one's (``1 == True == 1.0``) but are of a type
    the checks refuse is refused, also after good calls; a call with bad lengths and bad
    options reports the lengths first (as on its first call)."""
    kc, vc, table, q, k, v, _, _ = inputs(14, True)
    good = {"causal": True, "num_splits": 1, "scale": 1.0, "softcap": 1.0,
            "cache_seqlens": SEQLENS, "k": k, "v": v}
    call = lambda **kw: flashcore.attention_with_kvcache(  # noqa: E731
        q, kc, vc, block_table=table, backend="numba_cpu", **{**good, **kw})
    call()
    call()
    before = kc.copy(), vc.copy()
    with pytest.raises(error, match=match):
        call(k=np.zeros_like(k), v=np.zeros_like(v), **bad)
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])


def test_read_only_cache_is_refused():
    rng = np.random.default_rng(5)
    kc, vc, _ = make_cache(rng, False)
    kc.flags.writeable = False
    k = rng.standard_normal((B, 1, HKV, D))
    with pytest.raises(ValueError, match="k_cache is read-only"):
        flashcore.attention_with_kvcache(rng.standard_normal((B, 1, HQ, D)), kc, vc,
                                         cache_seqlens=SEQLENS, k=k, v=k)


# --- frameworks ------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_writes_the_cache_in_place():
    torch = pytest.importorskip("torch")
    kc, vc, table, q, k, v, want_k, want_v = inputs(6, True)
    tkc, tvc = torch.tensor(kc), torch.tensor(vc)
    o = flashcore.attention_with_kvcache(torch.tensor(q), tkc, tvc,
                                         cache_seqlens=torch.tensor(SEQLENS), k=torch.tensor(k),
                                         v=torch.tensor(v), block_table=torch.tensor(table),
                                         causal=True)
    assert np.array_equal(tkc.numpy(), want_k) and np.array_equal(tvc.numpy(), want_v)
    ref, _ = oracle_kvcache(q, want_k, want_v, SEQLENS + 2, table, PAGE, causal=True)
    assert rel_err(o.numpy(), ref) < TOL_FWD["float64"]


@pytest.mark.torch
@pytest.mark.parametrize("given", ["numpy", "cpu_tensor"])
def test_torch_host_lengths_match_tensor_lengths(given):
    """cache_seqlens as a NumPy array beside torch tensors (or a CPU tensor: on a GPU
    both are "host lengths", read with no synchronization) gives what a tensor of the
    caches' device gives."""
    torch = pytest.importorskip("torch")
    kc, vc, table, q, k, v, want_k, want_v = inputs(6, True)
    outs = []
    host = SEQLENS.astype(np.int64) if given == "numpy" else torch.tensor(SEQLENS)
    for lengths in (torch.tensor(SEQLENS), host):
        tkc, tvc = torch.tensor(kc), torch.tensor(vc)
        o, lse = flashcore.attention_with_kvcache(
            torch.tensor(q), tkc, tvc, cache_seqlens=lengths, k=torch.tensor(k),
            v=torch.tensor(v), block_table=torch.tensor(table), causal=True, return_lse=True)
        assert np.array_equal(tkc.numpy(), want_k) and np.array_equal(tvc.numpy(), want_v)
        outs.append((o, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.torch
@pytest.mark.parametrize("lengths, error, match", [
    (np.array([0, 5, 95], np.int32), ValueError, r"cache_seqlens\[2\] \+ Nnew = 95 \+ 2"),
    (np.array([0, -1, 3], np.int64), ValueError, r"cache_seqlens\[1\]=-1"),
    (np.array([0, 5, 3], np.float32), TypeError, "cache_seqlens must be an integer"),
    (np.array([0, 5], np.int32), ValueError, r"cache_seqlens must have shape"),
    ([0, 5, 3], TypeError, "cache_seqlens must be an array"),
], ids=["over_capacity", "negative", "float", "short", "list"])
def test_bad_host_lengths_leave_the_torch_cache_untouched(lengths, error, match):
    torch = pytest.importorskip("torch")
    kc, vc, table, q, k, v, _, _ = inputs(4, True)
    tkc, tvc = torch.tensor(kc), torch.tensor(vc)
    with pytest.raises(error, match=match):
        flashcore.attention_with_kvcache(torch.tensor(q), tkc, tvc, cache_seqlens=lengths,
                                         k=torch.tensor(k), v=torch.tensor(v),
                                         block_table=torch.tensor(table))
    assert np.array_equal(tkc.numpy(), kc) and np.array_equal(tvc.numpy(), vc)


@pytest.mark.torch
@pytest.mark.parametrize("given", ["numpy", "cpu_tensor"])
def test_host_lengths_beside_device_tensors_are_checked_on_the_host(given):
    """Beside tensors on another device (meta here; a GPU in use) host lengths are read
    where they are: the case keeps a read-only int64 copy (what a GPU backend uploads),
    the longest key range comes from it, and a bad value is refused."""
    torch = pytest.importorskip("torch")
    from flashcore._packed_checks import make_kvcache_case

    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    q, kn = meta(B, 1, HQ, D), meta(B, 2, HKV, D)
    kc, vc = meta(B, 96, HKV, D), meta(B, 96, HKV, D)
    wrap = (lambda x: x) if given == "numpy" else torch.from_numpy
    lengths = SEQLENS.copy()
    case = make_kvcache_case(q, kc, vc, wrap(lengths), kn, kn, causal=False, scale=None,
                             num_splits=0)
    host = case.kvcache.cache_seqlens
    assert isinstance(host, np.ndarray) and host.dtype == np.int64
    assert list(host) == list(SEQLENS) and not host.flags.writeable
    lengths[0] = 50  # the caller's array is not the case's
    assert host[0] == 0 and case.kvcache.max_seqlen_k == 83 + 2
    assert case.device == "meta:0"
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] \+ Nnew = 95 \+ 2"):
        make_kvcache_case(q, kc, vc, wrap(np.array([0, 5, 95], np.int32)), kn, kn,
                          causal=False, scale=None, num_splits=0)
    with pytest.raises(TypeError, match="one library"):  # a CPU tensor beside NumPy arrays
        make_kvcache_case(*(np.zeros(x.shape) for x in (q, kc, vc)), torch.tensor(SEQLENS),
                          causal=False, scale=None, num_splits=0)


@pytest.mark.torch
def test_torch_op_fake_takes_host_lengths_beside_gpu_tensors():
    """The custom op's fake (what torch.compile traces) takes a CPU lengths tensor beside
    CUDA tensors and gives outputs on q's device (no GPU needed: fake tensors)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashcore import _torch_varlen

    with FakeTensorMode():
        q = torch.empty(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        kc = torch.empty(B, 96, HKV, D, device="cuda", dtype=torch.bfloat16)
        lengths = torch.empty(B, dtype=torch.int32)
        o, lse = _torch_varlen.kvcache_op(q, kc, torch.empty_like(kc), lengths, None, None,
                                          None, False, 0.25, 0, "auto", 0, [])
    assert o.device == q.device and o.shape == q.shape
    assert lse.device == q.device and tuple(lse.shape) == (B, HQ, 1)


def test_readme_decode_loop():
    """The README's decode loop (lengths kept on the host, as a NumPy array) runs."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Packed sequences (varlen) and KV-cache decoding"):]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    loop = next(b for b in blocks if "attention_with_kvcache" in b)
    ns = {"np": np, "flashcore": flashcore, "rng": np.random.default_rng(0)}
    exec(loop.replace("range(100)", "range(3)"), ns)
    assert list(ns["lengths"]) == [3] * 4 and np.isfinite(ns["o"]).all()


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("given", ["tensor", "numpy"])
def test_torch_compile_sees_the_mutation(given):
    torch = pytest.importorskip("torch")
    kc, vc, table, q, k, v, want_k, want_v = inputs(7, False, nq=1, n_new=1)
    tkc, tvc = torch.tensor(kc), torch.tensor(vc)
    lengths = torch.tensor(SEQLENS) if given == "tensor" else SEQLENS.copy()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v):
        return flashcore.attention_with_kvcache(q, tkc, tvc, cache_seqlens=lengths, k=k, v=v)

    o = step(torch.tensor(q), torch.tensor(k), torch.tensor(v))
    assert np.array_equal(tkc.numpy(), want_k) and np.array_equal(tvc.numpy(), want_v)
    ref, _ = oracle_kvcache(q, want_k, want_v, SEQLENS + 1, None, PAGE * PAGES_PER_SEQ)
    assert rel_err(o.numpy(), ref) < TOL_FWD["float64"]


@pytest.mark.torch
def test_torch_op_declares_the_mutation():
    pytest.importorskip("torch")
    from flashcore import _torch_varlen

    schema = str(_torch_varlen.kvcache_op._opoverload._schema)
    assert "Tensor(a1!) k_cache" in schema and "Tensor(a2!) v_cache" in schema


@pytest.mark.jax
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_returns_the_updated_caches(jit):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    kc, vc, table, q, k, v, want_k, want_v = inputs(8, True)
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)

    def step(q, kc, vc, lengths, k, v, table):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=table, causal=True)

    f = jax.jit(step) if jit else step
    o, new_k, new_v = f(jnp.asarray(q), jkc, jvc, jnp.asarray(SEQLENS), jnp.asarray(k),
                        jnp.asarray(v), jnp.asarray(table))
    assert np.array_equal(np.asarray(new_k), want_k) and np.array_equal(np.asarray(new_v), want_v)
    assert np.array_equal(np.asarray(jkc), kc)  # the caches given are unchanged
    ref, _ = oracle_kvcache(q, want_k, want_v, SEQLENS + 2, table, PAGE, causal=True)
    assert rel_err(np.asarray(o), ref) < TOL_FWD["float64"]


@pytest.mark.jax
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", ["shared", "negative"])
def test_jax_checks_the_append_s_values(jit, bad):
    """The append's value checks hold in JAX as in NumPy, also under jit where the traced
    lengths and table are read only by the host callback (which gets the lengths from
    before the append): a page two sequences write into, a negative length."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    kc, vc, table, q, k, v, _, _ = inputs(8, True)
    lengths = SEQLENS.copy()
    if bad == "shared":
        table = table.copy()
        table[1, 0] = table[2, 0]  # (sequence 1 appends into page 0, sequence 2 reads it)
        match = r"block_table\[1, 0\]=\d+ is a page the append writes k and v into"
    else:
        lengths[1] = -1  # (-1 + Nnew = 1: the lengths after the append look valid)
        match = r"cache_seqlens must be >= 0; got cache_seqlens\[1\]=-1"

    def step(q, kc, vc, lengths, k, v, table):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=table, causal=True)

    f = jax.jit(step) if jit else step
    # (under jit the ValueError reaches the caller inside XLA's runtime error)
    with pytest.raises(ValueError if not jit else Exception, match=match):
        jax.block_until_ready(f(*(jnp.asarray(x) for x in (q, kc, vc, lengths, k, v, table))))


@pytest.mark.jax
def test_jax_refuses_python_lists_by_name():
    """A Python list for the lengths, the table or the offsets is refused by name in JAX
    calls, as in NumPy and torch ones (JAX turned it into an array before)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    kc, vc, table, q, k, v, _, _ = inputs(8, True)
    jq, jkc, jvc = (jnp.asarray(x) for x in (q, kc, vc))
    with pytest.raises(TypeError, match="cache_seqlens must be an array"):
        flashcore.attention_with_kvcache(jq, jkc, jvc, cache_seqlens=SEQLENS.tolist(),
                                         block_table=jnp.asarray(table))
    with pytest.raises(TypeError, match="block_table must be an array"):
        flashcore.attention_with_kvcache(jq, jkc, jvc, cache_seqlens=jnp.asarray(SEQLENS),
                                         block_table=table.tolist())
    x = jnp.zeros((10, 2, 16), jnp.float32)
    for name, a, b in (("cu_seqlens_q", [0, 4, 10], jnp.asarray([0, 4, 10], jnp.int32)),
                       ("cu_seqlens_k", jnp.asarray([0, 4, 10], jnp.int32), [0, 4, 10])):
        with pytest.raises(TypeError, match=f"{name} must be an array"):
            flashcore.attention_varlen(x, x, x, a, b)


def test_split_counts():
    """num_splits=0 keeps a short or already parallel decode in one split and splits a
    long one; an explicit count shortens the key tiles until it has that many."""
    from flashcore.backends.numba_cpu.simd import lanes
    from flashcore.backends.numba_cpu.tiles import (
        PRODUCT_ROWS,
        choose_splits,
        choose_tiles,
        decode_tiles,
    )

    base = choose_tiles(64, "float32", False)
    assert choose_splits(0, jobs=8, longest=300, threads=2, block_k=128) == 1
    assert choose_splits(0, jobs=1, longest=32768, threads=2, block_k=512) == 8
    assert choose_splits(0, jobs=1, longest=1 << 20, threads=64, block_k=512) == 64
    assert choose_splits(5, jobs=1, longest=100, threads=2, block_k=512) == 1
    # query tiles: a power of two >= Nq, at least the products' row block (4 rows, 8 on
    # AVX-512 hosts) and a whole number of their column blocks (two vectors of the
    # compute dtype: the masked forward's S^T has the queries across)
    cols = {dt: 2 * lanes(4 if dt == "float32" else 8) for dt in ("float32", "float64")}
    for dt in ("float32", "float64"):
        bq, bk = decode_tiles(1, 64, base, 32768, 0, dtype=dt)
        assert bq == max(PRODUCT_ROWS, cols[dt]) and bk >= 128
        bq, bk = decode_tiles(3, 16, base, 85, 3, dtype=dt)
        assert bq % cols[dt] == 0 and bq % PRODUCT_ROWS == 0 and -(-85 // bk) >= 3
        assert decode_tiles(40, 64, base, 300, 0, dtype=dt)[0] % cols[dt] == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("nq, hq", [(3, 32), (5, 16), (12, 8)])
def test_few_rows_of_a_large_group_take_whole_column_blocks(dtype, nq, hq):
    """More query rows than the decode kernel takes (group * Nq > MAX_DECODE_ROWS) but
    fewer than a column block of the products: the masked forward's query tiles are
    whole column blocks (shorter ones had its S^T products write past the score tile and
    corrupt the heap: 'free(): invalid pointer'), against the oracle."""
    rng = np.random.default_rng(12)
    lengths = np.array([200, 57], np.int32)
    kc, vc = (rng.standard_normal((2, 256, 1, 64)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((2, nq, hq, 64)).astype(dtype)
    o, lse = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                              return_lse=True, backend="numba_cpu")
    ref_o, ref_lse = oracle_kvcache(q, kc, vc, lengths, None, 0, causal=True)
    assert rel_err(o, ref_o) < TOL_FWD[dtype], rel_err(o, ref_o)
    assert np.abs(lse - ref_lse).max() < (1e-10 if dtype == "float64" else 1e-5)


def kpos_bias(s, b, h, i, j, bias):
    """A score_mod reading a per-key bias of each sequence."""
    return s + bias[b, j]


def every_third_hidden(b, h, i, j, bias):
    """A mask_mod hiding every third key, shifted per query head."""
    return (j + h) % 3 != 0


@pytest.mark.parametrize("nq, num_splits", [
    (3, 3), pytest.param(3, 1, marks=pytest.mark.slow),
    pytest.param(40, 1, marks=pytest.mark.slow), pytest.param(40, 3, marks=pytest.mark.slow)])
def test_mods_in_both_kernels(nq, num_splits):
    """Few query rows (group * Nq <= decode_kernels.MAX_DECODE_ROWS) take the decode
    kernel, one job per KV head; more take the general forward: both with a score_mod and a
    mask_mod reading mod_args, paged, GQA, split or not, against the oracle."""
    from flashcore.backends.numba_cpu.decode_kernels import MAX_DECODE_ROWS

    assert (nq * HQ // HKV <= MAX_DECODE_ROWS) == (nq == 3)
    rng = np.random.default_rng(11)
    kc, vc, table = make_cache(rng, True)
    q = rng.standard_normal((B, nq, HQ, D))
    bias = rng.standard_normal((B, PAGE * PAGES_PER_SEQ))
    mods = dict(score_mod=kpos_bias, mask_mod=every_third_hidden, mod_args=(bias,))
    o, lse = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=SEQLENS,
                                              block_table=table, num_splits=num_splits,
                                              return_lse=True, backend="numba_cpu", **mods)
    ref_o, ref_lse = oracle_kvcache(q, kc, vc, SEQLENS, table, PAGE, **mods)
    assert rel_err(o, ref_o) < TOL_FWD["float64"]
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-10
