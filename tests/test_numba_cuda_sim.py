"""Every CUDA kernel under numba's CUDA simulator, on small shapes, against the float64 oracle.

The simulator must be switched on before ``numba.cuda`` is first imported, so in an ordinary
``pytest`` run this file has one test that runs itself again in a subprocess with
``NUMBA_ENABLE_CUDASIM=1`` (and fails with that run's output). Run the cases directly with
``NUMBA_ENABLE_CUDASIM=1 pytest tests/test_numba_cuda_sim.py``.

The simulator runs each thread as a Python thread, so tilings.SIMULATOR_SIMT uses tiny tiles that
put several query and key tiles, tails and diagonal tiles in play on these shapes.
"""
from __future__ import annotations

import importlib.util
import os
import zlib

import numpy as np
import pytest
from helpers import (
    NAN_SHAPES,
    TOL_BWD,
    TOL_FWD,
    assert_nan_rows,
    nan_inputs,
    oracle_backward,
    oracle_forward,
    qkv,
    rand,
    rel_err,
    run_under_simulator,
)

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None

pytestmark = [
    pytest.mark.cudasim,
    pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed"),
]


if not SIM:

    def test_kernels_under_simulator(request):
        """Runs the cases below in a subprocess with the simulator on."""
        # The SIMT kernels: fp16/bf16 would otherwise go to the tensor-core kernel, whose
        # simulator tests are tests/test_numba_cuda_tc.py.
        run_under_simulator(request, __file__, tensor_cores=False)

else:
    import flashcore

    @pytest.fixture(autouse=True)
    def _simt_only(monkeypatch):
        """The SIMT kernels, as the subprocess above runs them (``nox -s tests-cudasim``
        runs this branch directly): fp16/bf16 would otherwise take the tensor-core kernel."""
        from flashcore.backends.numba_cuda import launch

        monkeypatch.setenv(launch.TC_ENV, "0")

    def _case_id(c):
        return "-".join(f"{k}{v}" for k, v in c.items())

    # (B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout): tiles are 4 query x 8 key rows, so
    # these cover several tiles, ragged tails, Nq != Nk both ways, rows that see no key
    # (causal with Nq > Nk), GQA and MQA, head dims not a multiple of the thread columns.
    CASES = [
        dict(B=1, Hq=2, Hkv=2, Nq=9, Nk=11, D=5, dtype="float32", causal=False, layout="bhnd"),
        dict(B=2, Hq=2, Hkv=1, Nq=13, Nk=13, D=8, dtype="float32", causal=True, layout="bhnd"),
        dict(B=1, Hq=4, Hkv=2, Nq=7, Nk=17, D=6, dtype="float32", causal=True, layout="bnhd"),
        dict(B=1, Hq=2, Hkv=2, Nq=10, Nk=4, D=4, dtype="float32", causal=True, layout="bhnd"),
        # 16-byte rows: fp32 K/V (Q/dO) stream as rows, products read B 16 bytes at a time
        dict(B=1, Hq=2, Hkv=1, Nq=12, Nk=19, D=16, dtype="float32", causal=True,
             layout="bhnd"),
        dict(B=1, Hq=2, Hkv=1, Nq=6, Nk=9, D=3, dtype="float16", causal=False, layout="bnhd"),
        dict(B=1, Hq=2, Hkv=2, Nq=9, Nk=9, D=9, dtype="float16", causal=True, layout="bhnd"),
        dict(B=1, Hq=3, Hkv=1, Nq=5, Nk=12, D=4, dtype="bfloat16", causal=True, layout="bhnd"),
        dict(B=1, Hq=2, Hkv=2, Nq=11, Nk=6, D=7, dtype="bfloat16", causal=False, layout="bnhd"),
        # 16-byte rows of 16-bit elements: the preprocess reads O and dO by dot16
        dict(B=1, Hq=2, Hkv=1, Nq=9, Nk=7, D=16, dtype="bfloat16", causal=False, layout="bnhd"),
        dict(B=1, Hq=1, Hkv=1, Nq=6, Nk=6, D=8, dtype="float16", causal=True, layout="bhnd"),
    ]

    def _opts(c):
        return dict(causal=c["causal"], layout=c["layout"])

    def _inputs(c, seed):
        rng = np.random.default_rng(seed)
        q, k, v = qkv(rng, B=c["B"], Hq=c["Hq"], Hkv=c["Hkv"], Nq=c["Nq"], Nk=c["Nk"],
                      D=c["D"], dtype=c["dtype"], layout=c["layout"])
        do = rand(rng, (c["B"], c["Hq"], c["Nq"], c["D"]), c["dtype"], c["layout"])
        return q, k, v, do

    @pytest.mark.parametrize("c", CASES, ids=_case_id)
    def test_forward_backward(c):
        q, k, v, do = _inputs(c, seed=zlib.crc32(_case_id(c).encode()))
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c))
        assert o.dtype == q.dtype and o.shape == q.shape
        assert lse.dtype == np.float32 and lse.shape == (c["B"], c["Hq"], c["Nq"])
        ro, rl = oracle_forward(q, k, v, **_opts(c))
        tol = TOL_FWD[c["dtype"]]
        assert rel_err(o, ro) < tol, rel_err(o, ro)
        assert rel_err(lse, rl) < 1e-5, rel_err(lse, rl)
        assert not np.isnan(np.asarray(o, dtype=np.float64)).any()
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                             **_opts(c))
        refs = oracle_backward(do, q, k, v, **_opts(c))
        for name, g, r, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
            assert g.dtype == x.dtype and g.shape == x.shape, name
            err = rel_err(g, r)
            assert err < TOL_BWD[c["dtype"]], f"{name}: {err}"

    def test_rows_that_see_no_key():
        # causal, Nq > Nk: the first Nq - Nk rows see no key: o = 0, lse = -inf, zero dq
        c = dict(B=1, Hq=1, Hkv=1, Nq=9, Nk=3, D=4, dtype="float32", causal=True,
                 layout="bhnd")
        q, k, v, do = _inputs(c, seed=7)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c))
        assert np.all(o[0, 0, :6] == 0) and np.all(np.isneginf(lse[0, 0, :6]))
        assert np.all(np.isfinite(lse[0, 0, 6:]))
        dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                                  **_opts(c))
        assert np.all(dq[0, 0, :6] == 0)
        for g in (dq, dk, dv):
            assert np.all(np.isfinite(g))

    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    @pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
    def test_nan_reaches_exactly_the_rows_that_see_it(shape, causal):
        q, k, v, bad = nan_inputs(np.random.default_rng(5), *shape, causal, D=4)
        o, _ = flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cuda")
        assert_nan_rows(o, None, bad)

    @pytest.mark.xfail(strict=True, reason="the SIMT forward writes lse = -inf where the row "
                       "sum is NaN (simt/forward.py: `if lsum > 0`)")
    def test_nan_reaches_lse():
        q, k, v, bad = nan_inputs(np.random.default_rng(5), 12, 20, True, D=4)
        o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
        assert_nan_rows(o, lse, bad)

    def test_empty_keys_and_queries():
        rng = np.random.default_rng(3)
        q, k, v = qkv(rng, Nq=5, Nk=0, D=4)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda")
        assert np.all(o == 0) and np.all(np.isneginf(lse))
        dq, dk, dv = flashcore.attention_backward(rand(rng, q.shape), q, k, v, o, lse,
                                                  backend="numba_cuda")
        assert np.all(dq == 0) and dk.shape == k.shape
        q, k, v = qkv(rng, Nq=0, Nk=6, D=4)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda")
        assert o.shape == q.shape and lse.shape == (1, 2, 0)
        dq, dk, dv = flashcore.attention_backward(q, q, k, v, o, lse, backend="numba_cuda")
        assert np.all(dk == 0) and np.all(dv == 0)

    def test_strided_views_read_in_place():
        # every other row and a slice of a wider head dim: non-trivial strides
        rng = np.random.default_rng(11)
        big = [rand(rng, (1, 2, 14, 10)) for _ in range(3)]
        q, k, v = (x[:, :, ::2, 1:7] for x in big)
        assert not q.flags.c_contiguous
        o, _ = flashcore.attention_forward(q, k, v, backend="numba_cuda", causal=True)
        ro, _ = oracle_forward(q, k, v, causal=True)
        assert rel_err(o, ro) < TOL_FWD["float32"]

    def test_padded_rows_stream_a_partial_chunk():
        # rows of 16 words (16-byte aligned) holding a head dim of 13: the copies stream
        # rows and the last 16-byte chunk of each row carries one word, zero-filled after
        rng = np.random.default_rng(12)
        big = [rand(rng, (1, 2, 14, 16)) for _ in range(4)]
        q, k, v, do = (x[..., :13] for x in big)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda")
        ro, _ = oracle_forward(q, k, v)
        assert rel_err(o, ro) < TOL_FWD["float32"]
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda")
        for g, r in zip(grads, oracle_backward(do, q, k, v)):
            assert rel_err(g, r) < TOL_BWD["float32"]

    @pytest.mark.parametrize("streamed,min_blocks", [(False, 1), (True, 1), (True, 2)],
                             ids=["registers", "cp_async", "cp_async_2_blocks"])
    def test_warp_sized_blocks(monkeypatch, streamed, min_blocks):
        # blocks of 32 threads take the loaders' 8 x 4 path (the GPU tilings' one); with
        # streamed tiles, the copies' stepped path, the forward's row maxima by warp
        # shuffles (with 2 blocks per SM, the next K copied after the P barrier) and
        # separate P and dS buffers in dK/dV (the default simulator tiling streams and
        # shares one P/dS buffer)
        from flashcore.backends.numba_cuda import launch
        from flashcore.backends.numba_cuda import tilings as tiles

        t = tiles.Tiles(block_m=8, block_n=16, rows=2, cols=16, min_blocks=min_blocks,
                        async_copy=streamed)
        kt = tiles.KernelTiles(t, t, t, tiles.RowTiles(32, 32))  # (the GPU's 32 lanes)
        monkeypatch.setattr(tiles, "SIMULATOR_SIMT", kt)
        monkeypatch.setattr(launch, "_PLANS", {})  # (plans are cached per kind of call)
        c = dict(B=1, Hq=2, Hkv=1, Nq=11, Nk=19, D=12, dtype="float32", causal=True,
                 layout="bnhd")
        q, k, v, do = _inputs(c, seed=5)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c))
        ro, _ = oracle_forward(q, k, v, **_opts(c))
        assert rel_err(o, ro) < TOL_FWD["float32"]
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                             **_opts(c))
        for g, r in zip(grads, oracle_backward(do, q, k, v, **_opts(c))):
            assert rel_err(g, r) < TOL_BWD["float32"]

    def test_auto_does_not_take_host_arrays():
        from flashcore.backends import numba_cuda

        from flashcore._checks import make_case

        rng = np.random.default_rng(0)
        q, k, v = qkv(rng)
        case = make_case(q, k, v, causal=False, scale=None, layout="bhnd")
        assert "explicit" in numba_cuda.supports(case)
        assert numba_cuda.unavailable_reason() is None
