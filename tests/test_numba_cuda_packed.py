"""Varlen and KV-cache calls in the CUDA kernels (SIMT and tensor-core): under numba's CUDA
simulator on small shapes (a subprocess per family, as the other simulator tests) and on a
GPU with torch tensors, against the per-sequence float64 oracle of tests/packed_helpers.py.

Cases cover empty sequences and sequences with more queries than keys (rows that see no
key under causal), GQA, a window, ALiBi and a score_mod through the sequence seam, paged
caches with shuffled page tables (pages smaller than a key tile, so one tile spans pages),
in-place appends checked element by element, split-KV (the merge is counted), and the
decode step whose grouped query heads share one block.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, rel_err, run_under_simulator
from packed_helpers import oracle_kvcache, oracle_varlen, packed

import flashcore

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
pytestmark = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")


def rel_bias(s, b, h, i, j):
    """A score_mod that reads positions within the sequence and the sequence index."""
    return s + 0.05 * (i - j) - 0.1 * b


#: (lengths of queries and keys per sequence, heads, head dim, options); sequence 0 has no
#: queries, sequence 1 more queries than keys.
VARLEN_SIMT = [
    dict(lq=[0, 9, 23, 17], lk=[7, 4, 23, 30], Hq=4, Hkv=2, D=8, dtype="float32",
         opts=dict(causal=True)),
    dict(lq=[6, 11, 0], lk=[14, 5, 3], Hq=2, Hkv=1, D=16, dtype="float32",
         opts=dict(causal=False, window=(4, 3), alibi="h", score_mod=rel_bias)),
]
VARLEN_TC = [
    dict(lq=[0, 30, 41, 17], lk=[9, 12, 41, 50], Hq=4, Hkv=2, D=32, dtype="bfloat16",
         opts=dict(causal=True)),
]


def _varlen_opts(c):
    opts = dict(c["opts"])
    if opts.get("alibi"):
        opts["alibi_slopes"] = (2.0 ** -np.arange(1, c["Hq"] + 1)).astype(np.float32)
    opts.pop("alibi", None)
    return opts


def _run_varlen(c, monkeypatch, family):
    from flashcore.backends.numba_cuda import launch

    served = []
    real = launch._serves  # (what each call takes, kept per kind of call or not)
    monkeypatch.setattr(launch, "_serves", lambda *a: served.append(real(*a)[0]) or real(*a))
    rng = np.random.default_rng(len(c["lq"]) + c["D"])
    q, k, v, cq, ck = packed(rng, c["lq"], c["lk"], Hq=c["Hq"], Hkv=c["Hkv"], D=c["D"],
                             dtype=c["dtype"])
    do = rng.standard_normal(q.shape).astype(q.dtype)
    opts = _varlen_opts(c)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, backend="numba_cuda", **opts)
    grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck,
                                                backend="numba_cuda", **opts)
    ro, rl, *rg = oracle_varlen(q, k, v, cq, ck, do=do, **opts)
    _check(c["dtype"], o, lse, ro, rl)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        assert rel_err(g, r) < TOL_BWD[c["dtype"]], f"{name}: {rel_err(g, r)}"
    assert served and all(served) == (family == "tensor_core")


def _check(dtype, o, lse, ro, rl):
    assert rel_err(o, ro) < TOL_FWD[dtype], rel_err(o, ro)
    fin = np.isfinite(rl)
    lse = np.asarray(lse)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - rl[fin]).max() < 1e-4


#: KV-cache cases: paged or not, causal, query rows, split count asked (0: heuristic), and
#: the splits the merge must have combined (1: no merge); ``page``: keys per page (8 else).
CACHE_SIMT = [
    dict(paged=True, causal=True, nq=3, splits=3, D=16, dtype="float32", merged=3),
    dict(paged=False, causal=False, nq=1, splits=0, D=16, dtype="float32", merged=None),
]
CACHE_TC = [
    dict(paged=True, causal=True, nq=3, splits=2, D=32, dtype="bfloat16", merged=2, page=32),
    dict(paged=False, causal=False, nq=1, splits=1, D=32, dtype="bfloat16", merged=1),
]


def _run_cache(c, monkeypatch, family):
    import test_kvcache as T
    from flashcore.backends.numba_cuda import launch

    merged, served = [], []
    real_merge, real_tc = launch.run_merge, launch._serves
    monkeypatch.setattr(launch, "run_merge",
                        lambda *a: merged.append(a[-1]) or real_merge(*a))
    monkeypatch.setattr(launch, "_serves",
                        lambda *a: served.append(real_tc(*a)[0]) or real_tc(*a))
    monkeypatch.setattr(T, "D", c["D"])
    if "page" in c:  # pages of whole key tiles (same capacity)
        monkeypatch.setattr(T, "PAGE", c["page"])
        monkeypatch.setattr(T, "PAGES_PER_SEQ", T.PAGE * T.PAGES_PER_SEQ // c["page"])
    n_new = 2
    kc, vc, table, q, k, v, want_k, want_v = T.inputs(1, c["paged"], nq=c["nq"], n_new=n_new,
                                                      dtype=c["dtype"])
    o, lse = flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=T.SEQLENS, k=k, v=v, block_table=table, causal=c["causal"],
        num_splits=c["splits"], return_lse=True, backend="numba_cuda")
    bits = lambda x: np.ascontiguousarray(x).view(np.uint8)  # noqa: E731
    assert np.array_equal(bits(kc), bits(want_k)) and np.array_equal(bits(vc), bits(want_v))
    ro, rl = oracle_kvcache(q, want_k, want_v, T.SEQLENS + n_new, table, T.PAGE,
                            causal=c["causal"])
    _check(c["dtype"], o, lse, ro, rl)
    if c["merged"] is not None:
        assert merged == ([] if c["merged"] == 1 else [c["merged"]])
    else:
        assert merged, "the heuristic chose no split on the simulator's 4 multiprocessors"
    assert served and all(served) == (family == "tensor_core")


def _run_cache_lengths_paths():
    """The lengths given on the host (the front end's NumPy copy, uploaded by the adapter's
    ``host_lengths``) and as a device array (read through ``int32``; a list stands for one
    under the simulator) give the same appends and results, bit for bit."""
    import test_kvcache as T
    from flashcore.backends import numba_cuda
    from flashcore.backends.numba_cuda import adapters

    from flashcore._packed_checks import make_kvcache_case

    kc, vc, table, q, k, v, want_k, want_v = T.inputs(3, True, nq=1, n_new=1,
                                                      dtype="float32")
    case = make_kvcache_case(q, kc, vc, T.SEQLENS, k, v, table, causal=True, scale=None,
                             num_splits=2, need_lse=True, explicit=True)
    assert isinstance(case.kvcache.cache_seqlens, np.ndarray)
    ad = adapters.ADAPTERS["numpy"]
    called = []
    runs = []
    for lengths in (case.kvcache.cache_seqlens, [int(n) for n in T.SEQLENS]):
        kc2, vc2 = kc.copy(), vc.copy()
        c = replace(case, kvcache=replace(case.kvcache, cache_seqlens=lengths))
        real = ad.host_lengths
        ad.host_lengths = lambda *a: called.append(len(runs)) or real(*a)
        try:
            o, lse = numba_cuda.forward(q, kc2, vc2, c)
        finally:
            del ad.host_lengths
        assert np.array_equal(kc2, want_k) and np.array_equal(vc2, want_v)
        runs.append((o, lse))
    assert called == [0]  # the host path uploads; the device path does not
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    ro, rl = oracle_kvcache(q, want_k, want_v, T.SEQLENS + 1, table, T.PAGE, causal=True)
    _check("float32", runs[0][0], runs[0][1], ro, rl)


def _run_cache_other_page_strides():
    """A v_cache whose page stride differs from k_cache's (a view of a wider pool): the
    append writes both in place (nothing past the view), and the attention, which reads
    both pools with one page stride, is right (it reads copies), with the lengths on the
    host and (a list, the device path under the simulator) with the append writing them."""
    import test_kvcache as T
    from flashcore.backends import numba_cuda

    from flashcore._packed_checks import make_kvcache_case

    for paged in (True, False):
        for lengths in ("host", "device"):
            kc, vc, table, q, k, v, want_k, want_v = T.inputs(4, paged, nq=1, n_new=2,
                                                              dtype="float32")
            wide = np.full((vc.shape[0], vc.shape[1] + 3, *vc.shape[2:]), 7.0, np.float32)
            wide[:, :vc.shape[1]] = vc
            vc2 = wide[:, :vc.shape[1]]
            case = make_kvcache_case(q, kc, vc2, T.SEQLENS, k, v, table, causal=True,
                                     scale=None, num_splits=2, need_lse=True, explicit=True)
            if lengths == "device":
                case = replace(case, kvcache=replace(case.kvcache, cache_seqlens=[
                    int(n) for n in T.SEQLENS]))
            o, lse = numba_cuda.forward(q, kc, vc2, case)
            assert np.array_equal(kc, want_k) and np.array_equal(vc2, want_v)
            assert np.all(wide[:, vc.shape[1]:] == 7)
            ro, rl = oracle_kvcache(q, want_k, want_v, T.SEQLENS + 2, table, T.PAGE,
                                    causal=True)
            _check("float32", o, lse, ro, rl)
    # every buffer (the copies, the partials) is allocated before the append writes: a
    # call that runs out of memory leaves the caches as they were
    from flashcore.backends.numba_cuda import packed

    kc, vc, table, q, k, v, _, _ = T.inputs(4, True, nq=1, n_new=2, dtype="float32")
    wide = np.zeros((vc.shape[0], vc.shape[1] + 3, *vc.shape[2:]), np.float32)
    wide[:, :vc.shape[1]] = vc
    vc2 = wide[:, :vc.shape[1]]
    before = kc.copy(), vc2.copy()
    case = make_kvcache_case(q, kc, vc2, T.SEQLENS, k, v, table, causal=True, scale=None,
                             num_splits=2, need_lse=True, explicit=True)

    def no_memory(*a, **kw):
        raise MemoryError("out of memory (test)")

    real, packed._workspace = packed._workspace, no_memory
    try:
        with pytest.raises(MemoryError):
            numba_cuda.forward(q, kc, vc2, case)
    finally:
        packed._workspace = real
    assert np.array_equal(kc, before[0]) and np.array_equal(vc2, before[1])


if not SIM:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("family", ["simt", "tensor_core"])
    def test_packed_under_simulator(family, request):
        """Runs the cases below in a subprocess with the simulator on."""
        run_under_simulator(request, __file__, f"sim_{family}",
                            tensor_cores=family != "simt")

else:
    from numba import cuda  # (a module global: the simulator gives kernels its own)

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", VARLEN_SIMT, ids=lambda c: str(c["lq"]))
    def test_sim_simt_varlen(c, monkeypatch):
        _run_varlen(c, monkeypatch, "simt")

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", VARLEN_TC, ids=lambda c: str(c["lq"]))
    def test_sim_tensor_core_varlen(c, monkeypatch):
        _run_varlen(c, monkeypatch, "tensor_core")

    def packed_doc(b, h, i, j, ids, cu):
        """Documents by packed per-token ids, read through the offsets: only rows and keys
        inside sequence ``b`` are in bounds for the last sequence."""
        return ids[cu[b] + i] == ids[cu[b] + j]

    def row_doc(b, h, i, j, doc):
        return doc[b, i] == doc[b, j]

    @pytest.mark.cudasim
    @pytest.mark.parametrize("kept", [False, True])
    def test_sim_simt_varlen_mask_asked_inside_each_sequence(kept, monkeypatch):
        """A varlen call's tile classes ask the mask only inside each sequence, as the
        attention kernels do: a mask reading packed ids through the offsets, and a table
        of (sequences, longest) rows with max_seqlen given above the longest, stay in
        bounds (the simulator raises past an array's end). ``kept``: the classes kept by
        the mod_args' contents and the offsets (other offsets, the same ids: evaluated
        again, not reused)."""
        from flashcore.backends.numba_cuda import classes
        from flashcore.backends.numba_cuda.device import seams

        from flashcore import _mods

        monkeypatch.setattr(seams, "CLASS_BLOCK", 8)
        monkeypatch.setattr(_mods, "BLOCK", 8)
        if kept:
            monkeypatch.setattr(classes, "DEVICE_EVALS", 0)
            monkeypatch.setattr(_mods, "_CLASSES", {})
        rng = np.random.default_rng(0)
        for lens in ([11, 19, 3], [19, 3, 11]):
            q, k, v, cq, ck = packed(rng, lens, lens, Hq=2, Hkv=1, D=8, dtype="float32")
            ids = (np.arange(int(cq[-1])) // 4).astype(np.int32)
            args = (ids, cq.astype(np.int32))
            ref = oracle_varlen(q, k, v, cq, ck, mask_mod=packed_doc, mod_args=args)[0]
            o = flashcore.attention_varlen(q, k, v, cq, ck, mask_mod=packed_doc, mod_args=args,
                                           backend="numba_cuda")
            assert rel_err(o, ref) < TOL_FWD["float32"], lens
        doc = (np.arange(19)[None, :] // 5 + np.arange(3)[:, None]) % 2
        for lens in ([11, 19, 3], [19, 3, 11]):  # (the same doc: only the offsets differ)
            q, k, v, cq, ck = packed(rng, lens, lens, Hq=2, Hkv=1, D=8, dtype="float32")
            ref = oracle_varlen(q, k, v, cq, ck, mask_mod=row_doc, mod_args=(doc,))[0]
            o = flashcore.attention_varlen(q, k, v, cq, ck, max_seqlen_q=24, max_seqlen_k=24,
                                           mask_mod=row_doc, mod_args=(doc,),
                                           backend="numba_cuda")
            assert rel_err(o, ref) < TOL_FWD["float32"], lens

    @pytest.mark.cudasim
    @pytest.mark.parametrize("warps", [True, False])
    def test_sim_simt_packed_tile(warps, rows=16):
        """``seams.packed_tile`` over 70 sequences (three warp-wide chunks; empty ones, one
        longer than 32 tiles), by the warp-wide scan and by each thread alone: every tile
        number of the launch's axis maps to the sequence and tile a plain enumeration
        gives, in both warps of a block, and the numbers past the last tile to a tile
        past the last sequence's end."""
        from flashcore.backends.numba_cuda.device.constants import VARLEN
        from flashcore.backends.numba_cuda.device.seams import packed_tile

        rng = np.random.default_rng(rows)
        lens = rng.integers(0, 3 * rows, 70)
        lens[[0, 31, 32, 69]] = 0
        lens[40] = 33 * rows + 5
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        want = [(s, t) for s, n in enumerate(lens) for t in range(-(-int(n) // rows))]
        grid = int(cu[-1]) // rows + len(lens)  # (launch._grid)
        assert len(want) <= grid

        @cuda.jit
        def tiles(cu, nseq, out):  # (one block: the simulator's blocks are slow to start)
            tid = cuda.threadIdx.x
            for x in range(out.shape[0]):
                b, t = packed_tile(0, x, cu, nseq, rows, tid & 31, warps, VARLEN)
                if tid & 31 == 0:
                    out[x, tid >> 5, 0] = b
                    out[x, tid >> 5, 1] = t

        out = np.full((grid, 2, 2), -7, np.int64)
        tiles[1, 64](cu, len(lens), out)
        assert np.array_equal(out[:, 0], out[:, 1])
        assert [tuple(x) for x in out[:len(want), 0]] == want
        for b, t in out[len(want):, 0]:
            assert b == len(lens) - 1 and t * rows >= lens[-1]

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", CACHE_SIMT, ids=lambda c: f"paged{c['paged']}-nq{c['nq']}")
    def test_sim_simt_cache(c, monkeypatch):
        _run_cache(c, monkeypatch, "simt")

    @pytest.mark.cudasim
    def test_sim_simt_cache_lengths_on_host_or_device():
        _run_cache_lengths_paths()

    @pytest.mark.cudasim
    def test_sim_simt_cache_other_page_strides():
        _run_cache_other_page_strides()

    @pytest.mark.cudasim
    def test_sim_cache_with_too_many_mod_args_is_declined_untouched():
        """numba_cuda declines a score_mod of 5 mod_args (its kernels take 4) when the
        call is planned, with the call's arrays: before the append writes anything."""
        import test_kvcache as T

        kc, vc, table, q, k, v, _, _ = T.inputs(1, True, nq=1, n_new=2, dtype="float32")
        before = kc.copy(), vc.copy()

        def sm(s, b, h, i, j, a0, a1, a2, a3, a4):
            return s + a0[0]

        with pytest.raises(flashcore.BackendUnavailableError, match="at most 4 mod_args"):
            flashcore.attention_with_kvcache(
                q, kc, vc, cache_seqlens=T.SEQLENS, k=k, v=v, block_table=table, score_mod=sm,
                mod_args=tuple(np.zeros(1, np.float32) for _ in range(5)),
                backend="numba_cuda")
        assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", CACHE_TC, ids=lambda c: f"paged{c['paged']}-nq{c['nq']}")
    def test_sim_tensor_core_cache(c, monkeypatch):
        _run_cache(c, monkeypatch, "tensor_core")


# --- on a GPU ----------------------------------------------------------------------------


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch


def _varlen_on_gpu(torch, rng, lq, lk, Hq, Hkv, D, dtype, causal):
    """Forward and backward of packed sequences on torch CUDA tensors against the oracle."""
    q, k, v, cq, ck = packed(rng, lq, lk, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    do = rng.standard_normal(q.shape).astype(q.dtype)
    t = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to("cuda", getattr(torch, dtype))  # noqa: E731
    tq, tk, tv, tdo = (t(x) for x in (q, k, v, do))
    tcq, tck = (torch.from_numpy(x).cuda() for x in (cq, ck))
    o, lse = flashcore.attention_varlen_forward(tq, tk, tv, tcq, tck, causal=causal,
                                                backend="numba_cuda")
    grads = flashcore.attention_varlen_backward(tdo, tq, tk, tv, o, lse, tcq, tck,
                                                causal=causal, backend="numba_cuda")
    host = lambda x: x.float().cpu().numpy()  # noqa: E731
    ro, rl, *rg = oracle_varlen(host(tq), host(tk), host(tv), cq, ck, do=host(tdo),
                                causal=causal)
    _check(dtype, host(o), host(lse), ro, rl)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        assert rel_err(host(g), r) < TOL_BWD[dtype], f"{name}: {rel_err(host(g), r)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D, causal", [("bfloat16", 128, True), ("float16", 64, True),
                                              ("float32", 64, True), ("bfloat16", 128, False),
                                              ("float16", 64, False)])
def test_packed_varlen_on_gpu(dtype, D, causal, monkeypatch):
    """Packed sequences of random lengths (one empty, one with more queries than keys),
    GQA, causal or not: forward and backward on torch CUDA tensors against the oracle. On
    cc 9.0 the fp16/bf16 forward is the wgmma one (checked)."""
    torch = _cuda_torch()
    from flashcore.backends.numba_cuda import launch

    ran = []
    real = launch.launch_forward
    monkeypatch.setattr(launch, "launch_forward",
                        lambda kern, *a, **kw: ran.append(kern.name) or real(kern, *a, **kw))
    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    _varlen_on_gpu(torch, np.random.default_rng(D), [0, 300, 129, 1000, 64],
                   [17, 200, 129, 1100, 70], 8, 2, D, dtype, causal)
    wgmma = torch.cuda.get_device_capability(0) == (9, 0) and dtype != "float32"
    assert ran[:1] == (["attn_forward_wgmma"] if wgmma else ran[:1]), ran


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D, causal", [("bfloat16", 128, True), ("bfloat16", 64, False),
                                              ("float32", 64, True)])
def test_packed_varlen_many_sequences_on_gpu(dtype, D, causal):
    """45 sequences (two chunks of the grid's warp-wide scan, ``seams.packed_tile``; empty
    ones at a chunk's edges, one of 20 query tiles): forward and backward against the
    oracle."""
    torch = _cuda_torch()
    rng = np.random.default_rng(45 + D)
    lq = [int(n) for n in rng.integers(1, 300, 45)]
    lq[0] = lq[31] = lq[32] = lq[44] = 0
    lq[7] = 20 * 128 - 3
    lk = [n + int(rng.integers(0, 40)) for n in lq]
    _varlen_on_gpu(torch, rng, lq, lk, 4, 2, D, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,dynamic", [(True, True), (False, True), (False, False),
                                            (True, False)],
                         ids=["causal", "full", "full-static", "causal-static"])
def test_persistent_forward_varlen_walks_many_tiles_on_gpu(causal, dynamic, monkeypatch):
    """The persistent forward on varlen rows (tilings.VARLEN_PERSISTENT_TRIAL, the tile
    counter, or the static walk) with several tiles a block: 16 heads over sequences of up
    to 40 tiles (an empty one, one-row ones, more queries than keys, GQA), more items than the GPU has
    blocks, so each block walks several, reusing each Q buffer and its words, its scan of
    the sequences moving on from one item to the next (heads innermost): forward and
    backward against the oracle; then three more forwards on the same arrays (the same
    tensor-map slot's counters, set back to zero by each launch) equal to the first. (First
    passed on an H200 at 84fb6da; the GPU tests before gave each block one varlen tile.)"""
    torch = _cuda_torch()
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    from flashcore.backends.numba_cuda import launch, tilings

    t = replace(tilings.VARLEN_PERSISTENT_TRIAL, dynamic=dynamic)
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    monkeypatch.setitem(tilings.VARLEN_PERSISTENT, (128, causal), t)
    tags = []
    real = launch.launch_forward
    monkeypatch.setattr(launch, "launch_forward", lambda kern, *a, **kw: tags.append(
        kern._dispatcher.py_func.__qualname__) or real(kern, *a, **kw))
    lq, lk = [5000, 0, 300, 1, 129, 2000, 40], [5000, 7, 280, 1, 400, 2100, 10]
    rng = np.random.default_rng(71 + causal)
    _varlen_on_gpu(torch, rng, lq, lk, 16, 4, 128, "bfloat16", causal)
    assert f"_{t.tag}_" in tags[0], tags
    q, k, v, cq, ck = packed(rng, lq, lk, Hq=16, Hkv=4, D=128, dtype="bfloat16")
    dev = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(  # noqa: E731
        "cuda", torch.bfloat16)
    args = (dev(q), dev(k), dev(v), torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda())
    runs = [flashcore.attention_varlen_forward(*args, causal=causal, backend="numba_cuda")
            for _ in range(4)]
    torch.cuda.synchronize()
    assert all(f"_{t.tag}_" in x for x in tags[-4:]), tags
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("D, causal", [(128, False), (128, True), (64, False)])
def test_packed_varlen_bulk_copies_on_gpu(D, causal, monkeypatch):
    """The wgmma forward's bulk tensor copies on varlen rows (``TMA_MIN_WORK`` 0: the
    table's tiling with them at any size, at D=64 the long keys' g2n192op3wt; one tensor
    map over every packed row, each sequence's key tiles from its offset): the sequences
    of the tests above, forward and backward against the oracle; then an inf in one value
    of a sequence's first key, which the previous sequence's last key tile also brings
    (its rows past that sequence are zeroed), reaching that sequence's outputs alone."""
    torch = _cuda_torch()
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wgmma kernels need compute capability 9.0")
    from flashcore.backends.numba_cuda import launch, tilings

    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    tags = []
    real = launch.launch_forward
    monkeypatch.setattr(launch, "launch_forward", lambda kern, *a, **kw: tags.append(
        kern._dispatcher.py_func.__qualname__) or real(kern, *a, **kw))
    if not tilings.HOPPER_FORWARD[D, causal].tma:  # (D=64's table, g1n128ob3, has no
        # copies to test: its long keys' tiling, the table's before it, has)
        monkeypatch.setitem(tilings.HOPPER_FORWARD, (D, causal), tilings.LONG_KEYS[D, causal])
    t = launch.hopper_variant(D, "bfloat16", causal, packed="varlen").tiles
    assert t.tma, t
    rng = np.random.default_rng(D + causal)
    lq, lk = [0, 300, 129, 1000, 64], [17, 200, 129, 1100, 70]
    _varlen_on_gpu(torch, rng, lq, lk, 8, 2, D, "bfloat16", causal)
    assert f"_{t.tag}_" in tags[0], tags
    q, k, v, cq, ck = packed(rng, lq, lk, Hq=8, Hkv=2, D=D, dtype="bfloat16")
    v[ck[3], 1, 7] = np.inf  # (the 4th sequence's first key: in the 3rd's last key tile)
    dev = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(  # noqa: E731
        "cuda", torch.bfloat16)
    tq, tk, tv = dev(q), dev(k), dev(v)
    o, lse = flashcore.attention_varlen_forward(tq, tk, tv, torch.from_numpy(cq).cuda(),
                                                torch.from_numpy(ck).cuda(), causal=causal,
                                                backend="numba_cuda")
    assert f"_{t.tag}_" in tags[-1], tags
    host = lambda x: x.float().cpu().numpy()  # noqa: E731
    o = host(o)
    ro, rl = oracle_varlen(host(tq), host(tk), host(tv), cq, ck, causal=causal)
    fin = np.isfinite(ro)
    assert not fin[cq[3]:cq[4], 4:, 7].any() and fin[:cq[3]].all(), "the inf's rows"
    assert np.array_equal(np.isfinite(o), fin)
    _check("bfloat16", np.where(fin, o, 0), host(lse), np.where(fin, ro, 0), rl)


@pytest.mark.gpu
@pytest.mark.parametrize("page, nq, splits, dtype", [
    (16, 1, 0, "bfloat16"), (None, 1, 0, "bfloat16"), (256, 4, 3, "float16"),
    (None, 2, 1, "float32"), (16, 1, 5, "float32"), (256, 1, 0, "float32")])
def test_packed_kvcache_on_gpu(page, nq, splits, dtype):
    """Append and attend on torch CUDA tensors: pages of 16 keys (a key tile spans pages)
    or 256 (a tile inside one page) shuffled through the pool, or a contiguous cache
    (``page`` None); lengths up to ~3000, GQA 4:1, causal; split-KV."""
    torch = _cuda_torch()
    rng = np.random.default_rng(nq + splits)
    B, Hq, Hkv, D, n_new = 3, 8, 2, 128, 2
    paged = page is not None
    cap = 3072
    seqlens = np.array([0, 700, cap - n_new - 5], np.int32)
    dt = getattr(torch, dtype)
    if paged:
        n_pages = B * cap // page + 7
        table = rng.permutation(n_pages)[:B * cap // page].reshape(B, -1).astype(np.int32)
        shape = (n_pages, page, Hkv, D)
    else:
        table, shape = None, (B, cap, Hkv, D)
    kc, vc = (torch.randn(shape, device="cuda").to(dt) for _ in range(2))
    q = torch.randn(B, nq, Hq, D, device="cuda").to(dt)
    kn, vn = (torch.randn(B, n_new, Hkv, D, device="cuda").to(dt) for _ in range(2))
    want = []
    for cache, new in ((kc, kn), (vc, vn)):
        w = cache.clone()
        for b in range(B):
            for s in range(n_new):
                p = int(seqlens[b]) + s
                at = (b, p) if table is None else (int(table[b, p // page]), p % page)
                w[at] = new[b, s]
        want.append(w)
    o, lse = flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=torch.from_numpy(seqlens).cuda(), k=kn, v=vn,
        block_table=None if table is None else torch.from_numpy(table).cuda(), causal=True,
        num_splits=splits, return_lse=True, backend="numba_cuda")
    torch.cuda.synchronize()
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])
    host = lambda x: x.float().cpu().numpy()  # noqa: E731
    ro, rl = oracle_kvcache(host(q), host(kc), host(vc), seqlens + n_new, table, page or 1,
                            causal=True)
    _check(dtype, host(o), host(lse), ro, rl)


@pytest.mark.gpu
def test_packed_host_reads_remembered_until_written():
    """host_ints reads a torch GPU tensor's values once (a synchronization), gives them
    again while the tensor is unchanged, and reads anew after an in-place write."""
    torch = _cuda_torch()
    from flashcore._packed_checks import host_ints

    x = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    a = host_ints(x, "torch")
    assert host_ints(x, "torch") is a and list(a) == [0, 3, 7]
    x += 1
    b = host_ints(x, "torch")
    assert b is not a and list(b) == [1, 4, 8]
    y = x.clone()  # another tensor with the same values: read on its own
    assert host_ints(y, "torch") is not b


@pytest.mark.gpu
def test_shared_pages_of_a_gpu_table_on_gpu():
    """A torch GPU block table whose rows share prefix pages: an append into unshared pages
    runs (the table's facts kept while it is unchanged); after an in-place write makes a
    written page shared, the call is refused and the cache left as it was."""
    torch = _cuda_torch()
    page, Hq, Hkv, D = 16, 4, 2, 64
    kc, vc = (torch.randn(6, page, Hkv, D, device="cuda").to(torch.bfloat16)
              for _ in range(2))
    # (pages 4, 1: a 32-key prefix both rows read; each appends into its own third page)
    table = torch.tensor([[4, 1, 0], [4, 1, 3]], dtype=torch.int32, device="cuda")
    lens = np.array([32, 32], np.int32)
    q = torch.randn(2, 1, Hq, D, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, 1, Hkv, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    for _ in range(2):  # (the second call: the table's facts as remembered)
        o = flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v,
                                             block_table=table, causal=True)
    assert torch.equal(kc[0, 0], k[0, 0]) and torch.equal(kc[3, 0], k[1, 0])
    from flashcore._packed_checks import _TABLE_FACTS, _offsets_key

    kept = _TABLE_FACTS.get((_offsets_key(table), 6))
    assert kept is not None and kept[1][1] is not None  # (first pages, repeated slots)
    ref, _ = oracle_kvcache(q.float().cpu().numpy(), kc.float().cpu().numpy(),
                            vc.float().cpu().numpy(), lens + 1, table.cpu().numpy(), page,
                            causal=True)
    assert rel_err(o.float().cpu().numpy(), ref) < TOL_FWD["bfloat16"]
    table[1, 2] = 0  # (in place: its version moves on)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=r"block_table\[0, 2\]=0 is a page the append"):
        flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=v,
                                         block_table=table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def _paged_decode_inputs(torch, B=3, page=16, cap=1024, Hq=8, Hkv=2, D=128, seed=0):
    """A shuffled page pool on the GPU (bf16), its block table (device) and host lengths."""
    rng = np.random.default_rng(seed)
    n_pages = B * cap // page + 5
    table = rng.permutation(n_pages)[:B * cap // page].reshape(B, -1).astype(np.int32)
    kc, vc = (torch.randn(n_pages, page, Hkv, D, device="cuda").to(torch.bfloat16)
              for _ in range(2))
    lengths = np.array([0, 300, cap - 40], np.int32)
    return kc, vc, torch.from_numpy(table).cuda(), lengths, (B, Hq, Hkv, D)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["numpy", "cpu_tensor"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_packed_kvcache_host_lengths_on_gpu(where, paged):
    """cache_seqlens given on the host (a NumPy array or a CPU tensor) beside torch CUDA
    caches: the same appends and results, bit for bit, as the same lengths on the GPU."""
    torch = _cuda_torch()
    kc, vc, table, lengths, (B, Hq, Hkv, D) = _paged_decode_inputs(torch)
    if not paged:
        kc, vc = (torch.randn(B, 1024, Hkv, D, device="cuda").to(torch.bfloat16)
                  for _ in range(2))
        table = None
    q = torch.randn(B, 1, Hq, D, device="cuda").to(torch.bfloat16)
    kn, vn = (torch.randn(B, 2, Hkv, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    host = lengths if where == "numpy" else torch.from_numpy(lengths)
    runs = []
    for given in (torch.from_numpy(lengths).cuda(), host):
        k2, v2 = kc.clone(), vc.clone()
        o, lse = flashcore.attention_with_kvcache(
            q, k2, v2, cache_seqlens=given, k=kn, v=vn, block_table=table, causal=True,
            return_lse=True, backend="numba_cuda")
        runs.append((o, lse, k2, v2))
    torch.cuda.synchronize()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    f = lambda x: x.float().cpu().numpy()  # noqa: E731
    ro, rl = oracle_kvcache(f(q), f(runs[0][2]), f(runs[0][3]), lengths + 2,
                            None if table is None else table.cpu().numpy(),
                            16 if paged else 1, causal=True)
    _check("bfloat16", f(runs[0][0]), f(runs[0][1]), ro, rl)


@pytest.mark.gpu
def test_host_lengths_go_through_the_ring_on_gpu(monkeypatch):
    """Host lengths beside torch CUDA tensors are copied through a slot of tensor_maps'
    ring (packed._lengths), one put per call, with or without new keys; the results equal
    the same calls with the lengths on the GPU, bit for bit."""
    torch = _cuda_torch()
    from flashcore.backends.numba_cuda import tensor_maps

    puts = []
    real = tensor_maps.put_values
    monkeypatch.setattr(tensor_maps, "put_values",
                        lambda *a: puts.append(len(a[2])) or real(*a))
    kc, vc, table, lengths, (B, Hq, Hkv, D) = _paged_decode_inputs(torch, seed=3)
    q = torch.randn(B, 1, Hq, D, device="cuda").to(torch.bfloat16)
    kn, vn = (torch.randn(B, 1, Hkv, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    outs = []
    for given in (lengths, torch.from_numpy(lengths).cuda()):
        k2, v2 = kc.clone(), vc.clone()
        outs.append([flashcore.attention_with_kvcache(q, k2, v2, cache_seqlens=given, k=kn,
                                                      v=vn, block_table=table),
                     flashcore.attention_with_kvcache(q, k2, v2, cache_seqlens=given + 1,
                                                      block_table=table), k2, v2])
    torch.cuda.synchronize()
    assert puts == [8 * B, 8 * B]  # (the host calls only: lengths and their ends, int32)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_decode_steps_with_host_lengths_do_not_synchronize(monkeypatch):
    """A decode loop with host lengths (changed every step) and an unchanged device block
    table: after a first step (compiles, reads the table once), no step synchronizes:
    torch's sync debug mode raises on any synchronizing torch call (``.cpu()``,
    ``.item()``, blocking copies, ``torch.cuda.synchronize``), and flashcore's own driver
    waits are patched to raise. The last step's output equals a step given the same
    lengths on the GPU."""
    torch = _cuda_torch()
    from flashcore.backends.numba_cuda import adapters, driver
    from flashcore.backends.numba_cuda import packed as cuda_packed

    kc, vc, table, lengths, (B, Hq, Hkv, D) = _paged_decode_inputs(torch)
    new = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)  # noqa: E731
    steps = [(new(B, 1, Hq, D), new(B, 1, Hkv, D), new(B, 1, Hkv, D)) for _ in range(6)]

    def step(i, lens, k_cache, v_cache):
        q, k, v = steps[i]
        return flashcore.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k,
                                                v=v, block_table=table)

    k0, v0 = kc.clone(), vc.clone()
    step(0, lengths.copy(), kc, vc)
    torch.cuda.synchronize()
    lens = lengths + 1

    def no_wait(*a, **kw):
        raise AssertionError("a decode step waited for the GPU")

    for mod in (driver, cuda_packed, adapters):
        for name in ("synchronize", "copy_to_host"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, no_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, len(steps)):
            o = step(i, lens, kc, vc)
            lens += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.undo()
    # the same steps again with the lengths on the GPU (each read back: synchronizes)
    for i in range(len(steps)):
        want = step(i, torch.from_numpy(lengths + i).cuda(), k0, v0)
    torch.cuda.synchronize()
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    assert torch.equal(o, want)


@pytest.mark.gpu
def test_decode_step_with_device_lengths_captures_in_a_cuda_graph():
    """A decode step whose device lengths and block table were read before (and not
    written since) does nothing that synchronizes, so torch can capture it in a CUDA graph
    (capture fails on any synchronization or read-back). Captured, it splits the keys for
    the cache's capacity, so its replays are right for whatever lengths they find, up to
    the capacity: captured at shorter lengths, replayed with new queries and lengths grown
    to the capacity, against the oracle."""
    torch = _cuda_torch()
    kc, vc, table, _, (B, Hq, Hkv, D) = _paged_decode_inputs(torch, seed=1)
    # (at these lengths an uncaptured call makes 2 splits of 384 keys: a graph that kept
    # that plan would leave out keys 768.. of the longer replays below)
    lens = torch.tensor([600, 20, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, Hq, D, device="cuda").to(torch.bfloat16)

    def step():
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                block_table=table, return_lse=True,
                                                backend="numba_cuda")

    step()  # compiles; reads the lengths and the table once
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    f = lambda x: x.float().cpu().numpy()  # noqa: E731
    host_table = table.cpu().numpy()
    for new in ([600, 20, 700], [1024, 300, 999], [5, 1000, 0]):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ro, rl = oracle_kvcache(f(q), f(kc), f(vc), np.array(new), host_table, 16)
        _check("bfloat16", f(o), f(lse), ro, rl)
    # lengths on the host cannot be captured (the graph would replay those of its capture
    # from a host buffer freed since): refused before anything is queued
    with pytest.raises(ValueError, match="cannot be captured into a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([1, 2, 3],
                                                                            np.int32),
                                             block_table=table, backend="numba_cuda")
