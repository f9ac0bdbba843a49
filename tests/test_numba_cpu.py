"""The numba_cpu backend against the float64 reference, forward and backward."""
import math

import numpy as np
import pytest
from helpers import (
    TOL_BWD,
    TOL_FWD,
    grad_floor,
    oracle_backward,
    oracle_forward,
    qkv,
    rand,
    rel_err,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashcore

BACKEND = "numba_cpu"
DTYPES = ["float32", "float64", "float16", "bfloat16"]


def check(rng, dtype="float32", layout="bhnd", causal=False, backward=True, **shape):
    q, k, v = qkv(rng, dtype=dtype, layout=layout, **shape)
    opts = dict(causal=causal, layout=layout)
    o, lse = flashcore.attention_forward(q, k, v, backend=BACKEND, **opts)
    ro, rlse = oracle_forward(q, k, v, **opts)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert lse.shape == rlse.shape
    assert rel_err(o, ro) <= TOL_FWD[dtype], rel_err(o, ro)
    # lse = (row max score) + log(row sum): its rounding error follows the scores' size,
    # O(1) for these standard-normal inputs (scale 1/sqrt(D)), not lse's own, which can
    # cancel to near 0 (Nk=1: lse is one score, e.g. -0.11, whose fp32 dot product of 40
    # terms is off by 1e-7, "1.02e-6" relative; hypothesis found it): a floor of 1 a row
    lse_floor = np.sqrt(np.isfinite(rlse).sum())
    assert rel_err(lse, rlse, lse_floor) <= (1e-12 if dtype == "float64" else 1e-6), \
        rel_err(lse, rlse, lse_floor)
    if not backward:
        return
    do = rand(rng, q.shape if layout == "bhnd" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3]),
              dtype, layout)
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND, **opts)
    refs = oracle_backward(do, q, k, v, **opts)
    floors = grad_floor(do, q, k, v, **opts)
    for name, g, r, x, fl in zip("qkv", grads, refs, (q, k, v), floors):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        err = rel_err(g, r, fl)
        assert err <= TOL_BWD[dtype], (name, err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dtypes(dtype, causal):
    check(np.random.default_rng(), dtype, causal=causal, B=2, Hq=4, Hkv=2, Nq=150, Nk=140, D=40)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("Nq,Nk", [(1, 1), (7, 300), (300, 7), (129, 129), (256, 384)])
def test_lengths_and_layouts(layout, Nq, Nk):
    check(np.random.default_rng(), layout=layout, causal=True, Hq=3, Hkv=1, Nq=Nq, Nk=Nk, D=16)


@pytest.mark.parametrize("D", [1, 40, 128, 200, 256])
def test_head_dims(D):
    check(np.random.default_rng(), Nq=70, Nk=130, D=D, causal=D % 2 == 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 4]),
    Nq=st.sampled_from([0, 1, 7, 64, 129, 200]), Nk=st.sampled_from([0, 1, 7, 128, 129, 257]),
    D=st.sampled_from([1, 8, 40, 64]), causal=st.booleans(),
    layout=st.sampled_from(["bhnd", "bnhd"]), seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes(B, Hkv, G, Nq, Nk, D, causal, layout, seed):
    check(np.random.default_rng(seed), layout=layout, causal=causal, B=B, Hq=Hkv * G, Hkv=Hkv,
          Nq=Nq, Nk=Nk, D=D)


def test_strided_views_are_read_in_place():
    rng = np.random.default_rng()
    base = rand(rng, (2, 6, 90, 48))
    q = base[:, ::2, 10:80, :32]  # every other head, a window of rows, part of the features
    k = base[:, 1::2, :, 8:40]
    v = np.swapaxes(rand(rng, (2, 3, 32, 90)), 2, 3)  # transposed last two axes
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend=BACKEND)
    ro, rlse = oracle_forward(q, k, v, causal=True)
    assert rel_err(o, ro) <= TOL_FWD["float32"]
    do = rand(rng, q.shape)
    for g, r in zip(flashcore.attention_backward(do, q, k, v, o, lse, causal=True, backend=BACKEND),
                    oracle_backward(do, q, k, v, causal=True)):
        assert rel_err(g, r) <= TOL_BWD["float32"]


def test_rows_that_see_no_key():
    rng = np.random.default_rng()
    q, k, v = qkv(rng, Nq=200, Nk=50, D=16)  # causal offset -150: rows 0..149 see nothing
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend=BACKEND)
    assert np.all(o[:, :, :150] == 0) and np.all(lse[:, :, :150] == -np.inf)
    assert np.all(np.isfinite(o[:, :, 150:])) and np.all(np.isfinite(lse[:, :, 150:]))
    do = rand(rng, q.shape)
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True, backend=BACKEND)
    assert np.all(dq[:, :, :150] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_nan_propagates_to_affected_rows_only():
    rng = np.random.default_rng()
    q, k, v = qkv(rng, Nq=64, Nk=64, D=16)
    q[0, 0, 5, 3] = np.nan
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend=BACKEND)
    bad = np.isnan(o).any(axis=-1)
    assert bad[0, 0, 5] and bad.sum() == 1
    k[0, 1, 40, 0] = np.nan  # a key is seen by causal rows 40.. of head 1
    o, _ = flashcore.attention_forward(q, k, v, causal=True, backend=BACKEND)
    rows = np.isnan(o[0, 1]).any(axis=-1)
    assert not rows[:40].any() and rows[40:].all()


def test_large_scores_neither_overflow_nor_nan():
    rng = np.random.default_rng()
    q, k, v = qkv(rng, Nq=100, Nk=100, D=4)
    q = q * np.float32(100.0)
    k = np.sign(k) * np.float32(100.0)  # |scores| up to 1e4 * scale
    o, lse = flashcore.attention_forward(q, k, v, scale=1.0, backend=BACKEND)
    ro, rlse = oracle_forward(q, k, v, scale=1.0)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    assert np.abs(lse).max() > 1e4 * 0.5
    # Scores near 1e4 carry float32 rounding of ~1e-3 in the exponent, whatever the kernel
    # does: the output may move by sum_j p_j eps_j |v_j - o| (eps_j: the rounding bound of
    # score j, (D + 2) 2^-24 sum |q k|: D products and sums, the scale folded into q). With
    # TOL_FWD alone the test failed for ~1 input in 13 (measured error <= 4% of this bound).
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bhnd,bhmd->bhnm", q64, k64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    eps = (q.shape[-1] + 2) * 2.0**-24 * np.einsum("bhnd,bhmd->bhnm", np.abs(q64),
                                                   np.abs(k64))
    moved = np.einsum("bhnm,bhnmd->bhnd", p * eps,
                      np.abs(v64[:, :, None] - ro[:, :, :, None]))
    assert np.all(np.abs(o - ro) <= moved + TOL_FWD["float32"] * np.abs(ro).max())


def test_backward_is_deterministic():
    rng = np.random.default_rng()
    q, k, v = qkv(rng, Hq=4, Hkv=1, Nq=300, Nk=300, D=32)
    o, lse = flashcore.attention_forward(q, k, v, backend=BACKEND)
    do = rand(rng, q.shape)
    g1 = flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND)
    g2 = flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND)
    for a, b in zip(g1, g2):
        assert np.array_equal(a, b)


def test_phases_cut_at_tile_starts_within_the_budget(monkeypatch):
    """backward_kernels.phase_bounds: the query rows cut only at tile starts, each phase's
    parts within the budget (PARTS_BYTES or PARTS_DQ times dQ), a tile wider than the
    budget alone, one empty phase where there is no row."""
    from flashcore.backends.numba_cpu import backward_kernels as bk

    monkeypatch.setattr(bk, "PARTS_BYTES", 0)
    monkeypatch.setattr(bk, "PARTS_DQ", 2)
    starts = np.arange(0, 1000, 64)
    # 8 parts of 1 byte a row, a budget of 2000 bytes: at most 250 rows a phase, cut at
    # the last tile start within them (the last phase: the 232 rows left)
    assert bk.phase_bounds(starts, 1000, 8, 1) == [(0, 192), (192, 384), (384, 576),
                                                   (576, 768), (768, 1000)]
    assert bk.phase_bounds(starts, 1000, 2, 1) == [(0, 1000)]  # (within twice dQ)
    monkeypatch.setattr(bk, "PARTS_DQ", 0)
    assert bk.phase_bounds(starts, 1000, 8, 1) == [(lo, min(lo + 64, 1000)) for lo in starts]
    ragged = np.array([0, 64, 100, 164, 170])  # (packed sequences' tiles: 100, 70 and 6 rows)
    assert bk.phase_bounds(ragged, 176, 1, 1) == [(0, 64), (64, 100), (100, 164),
                                                  (164, 170), (170, 176)]
    assert bk.phase_bounds(np.arange(0, 0, 64), 0, 8, 1) == [(0, 0)]
    monkeypatch.setattr(bk, "PARTS_BYTES", 64 << 20)
    assert bk.phase_bounds(starts, 1000, 16, 128) == [(0, 1000)]


@pytest.mark.parametrize("dtype,causal,shape", [
    ("float32", True, dict(B=1, Hq=4, Hkv=2, Nq=300, Nk=450, D=40)),
    ("bfloat16", False, dict(B=2, Hq=2, Hkv=1, Nq=257, Nk=200, D=64)),
    ("float64", True, dict(B=1, Hq=1, Hkv=1, Nq=200, Nk=130, D=16)),
])
def test_backward_in_phases_equals_one_pass(monkeypatch, dtype, causal, shape):
    """dQ parts over a budget take the query rows in phases (here a phase a query tile),
    dK and dV carried between them: every sum in the same order, so the gradients are
    the one-pass gradients bit for bit."""
    from flashcore.backends.numba_cpu import backward_kernels as bk

    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, dtype=dtype, **shape)
    do = rand(rng, q.shape, dtype)
    o, lse = flashcore.attention_forward(q, k, v, backend=BACKEND, causal=causal)
    one = flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND, causal=causal)
    seen = []
    real = bk.phase_bounds
    monkeypatch.setattr(bk, "phase_bounds", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(bk, "PARTS_BYTES", 0)
    monkeypatch.setattr(bk, "PARTS_DQ", 0)
    phased = flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND,
                                          causal=causal)
    assert len(seen[-1]) > 1, seen
    for a, b in zip(one, phased):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _softcap_mod(s, b, h, i, j):
    return 20.0 * math.tanh(s / 20.0)


@pytest.mark.parametrize("varlen,budget", [(False, 0), (True, 0), (True, 60_000)])
def test_masked_backward_in_phases_equals_one_pass(monkeypatch, varlen, budget):
    """The masked kernels' phases (cut at each packed sequence's query tile starts): a
    window, a score_mod and GQA, or packed sequences (one empty) with causal, a phase a
    query tile (budget 0) or phases of several sequences (whose partial last key tiles
    border the next sequence's keys, carried by other jobs); the same gradients bit for
    bit as one pass, and near the reference."""
    from flashcore.backends.numba_cpu import backward_kernels as bk

    rng = np.random.default_rng(8)
    if varlen:
        cu = np.array([0, 150, 150, 407, 500, 610, 633], np.int32)
        q, k, v, do = (rand(rng, (633, h, 32)) for h in (4, 2, 2, 4))

        def grads():
            o, lse = flashcore.attention_varlen_forward(q, k, v, cu, cu, causal=True,
                                                        backend=BACKEND)
            return flashcore.attention_varlen_backward(do, q, k, v, o, lse, cu, cu,
                                                       causal=True, backend=BACKEND)
    else:
        q, k, v = qkv(rng, B=2, Hq=4, Hkv=2, Nq=300, Nk=350, D=24)
        do = rand(rng, q.shape)
        opts = dict(window=(90, 40), score_mod=_softcap_mod)

        def grads():
            o, lse = flashcore.attention_forward(q, k, v, backend=BACKEND, **opts)
            return flashcore.attention_backward(do, q, k, v, o, lse, backend=BACKEND, **opts)

    one = grads()
    seen = []
    real = bk.phase_bounds
    monkeypatch.setattr(bk, "phase_bounds", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(bk, "PARTS_BYTES", budget)
    monkeypatch.setattr(bk, "PARTS_DQ", 0)
    for _ in range(3 if budget else 1):  # (a lost update between jobs would be a race)
        phased = grads()
        assert len(seen[-1]) > 2, seen
        for a, b in zip(one, phased):
            assert np.array_equal(a, b)
    if budget:  # some phase holds rows of two sequences or more
        assert any(((cu > lo) & (cu < hi)).any() for lo, hi in seen[-1]), seen[-1]
    if varlen:  # (the reference of the dense case runs in test_mods)
        o, lse = flashcore.attention_varlen_forward(q, k, v, cu, cu, causal=True,
                                                    backend="reference")
        refs = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, causal=True,
                                                   backend="reference")
        for g, r in zip(phased, refs):
            assert rel_err(g, r) <= TOL_BWD["float32"], rel_err(g, r)


def test_default_scale_and_explicit_scale():
    rng = np.random.default_rng()
    q, k, v = qkv(rng, D=25)
    o1 = flashcore.attention(q, k, v, backend=BACKEND)
    o2 = flashcore.attention(q, k, v, scale=0.2, backend=BACKEND)
    assert rel_err(o1, o2) == 0
    o3, lse3 = flashcore.attention(q, k, v, scale=0.7, return_lse=True, backend=BACKEND)
    ro, rl = oracle_forward(q, k, v, scale=0.7)
    assert rel_err(o3, ro) <= TOL_FWD["float32"] and rel_err(lse3, rl) <= 1e-6


def test_torch_cpu_tensors_are_read_without_copy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    for dtype, tdt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        q, k, v = (torch.from_numpy(x.astype(np.float32)).to(tdt)
                   for x in qkv(rng, Nq=33, Nk=65, D=16))
        from flashcore import _interop
        assert _interop.host_view(q, "torch").ctypes.data == q.data_ptr()
        o, lse = flashcore.attention_forward(q, k, v, causal=True, backend=BACKEND)
        assert isinstance(o, torch.Tensor) and o.dtype == tdt
        ro, _ = oracle_forward(*(x.float().numpy() for x in (q, k, v)), causal=True)
        assert rel_err(o.float().numpy(), ro) <= TOL_FWD[dtype]
