"""attention_varlen: numba_cpu and the reference against a per-sequence float64 oracle
(slices of the packed arrays through the dense reference, tests/packed_helpers.py),
forward and backward, with empty sequences, sequences with more queries than keys, GQA,
causal, window, softcap, ALiBi and user mods (``b`` = the sequence); torch autograd and JAX
custom_vjp; every bad input. The packed kernels compile once per dtype (~40 s forward,
~50 s backward on the 2-core host), so CI runs float64 and nox the other dtypes (slow).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, rel_err
from packed_helpers import oracle_varlen, packed

import flashcore
from flashcore._rules import lse_dtype

#: Sequence lengths: an empty query sequence with keys, one with more queries than keys
#: (its first rows see no key when causal), one with no keys at all, one longer than a tile.
LENS_Q = [3, 0, 5, 4, 2, 70]
LENS_K = [4, 2, 3, 0, 6, 90]


def _check_forward(o, lse, ref_o, ref_lse, dtype):
    assert rel_err(o, ref_o) < TOL_FWD[dtype]
    assert lse.shape == ref_lse.shape and str(lse.dtype) == lse_dtype(dtype)
    assert rel_err(lse, ref_lse) < max(TOL_FWD[dtype], 1e-6 if dtype != "float64" else 0)


def _check_both(rng, q, k, v, cq, ck, opts):
    """numba_cpu's forward and backward (float64) against the oracle, with ``opts``."""
    do = rng.standard_normal(q.shape)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, **opts)
    ref = oracle_varlen(q, k, v, cq, ck, do=do, **opts)
    _check_forward(o, lse, ref[0], ref[1], "float64")
    grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, **opts)
    for g, r in zip(grads, ref[2:]):
        assert rel_err(g, r) < TOL_BWD["float64"]


@pytest.mark.parametrize("backend", ["numba_cpu", "reference"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_matches_per_sequence(backend, causal):
    rng = np.random.default_rng(0)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, causal=causal, backend=backend)
    ref_o, ref_lse = oracle_varlen(q, k, v, cq, ck, causal=causal)
    _check_forward(o, lse, ref_o, ref_lse, "float64")
    if causal:  # sequence 2 (5 queries, 3 keys): its first 2 rows see nothing
        rows = slice(cq[2], cq[2] + 2)
        assert np.all(o[rows] == 0) and np.all(lse[:, rows] == -np.inf)
    o2 = flashcore.attention_varlen(q, k, v, cq, ck, causal=causal, backend=backend)
    assert np.array_equal(o2, o)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_per_sequence(causal):
    rng = np.random.default_rng(1)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    do = rng.standard_normal(q.shape)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, causal=causal)
    grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=causal)
    ref = oracle_varlen(q, k, v, cq, ck, do=do, causal=causal)
    for g, r in zip(grads, ref[2:]):
        assert g.shape == r.shape
        assert rel_err(g, r) < TOL_BWD["float64"]
    ref_grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=causal,
                                                    backend="reference")
    for g, r in zip(ref_grads, ref[2:]):
        assert rel_err(g, r) < TOL_BWD["float64"]


def test_window_softcap_alibi_compose():
    rng = np.random.default_rng(2)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    slopes = rng.uniform(0.1, 0.5, (len(LENS_Q), 4)).astype(np.float32)
    opts = {"causal": True, "window": (3, None), "softcap": 2.0, "alibi_slopes": slopes}
    _check_both(rng, q, k, v, cq, ck, opts)


def seq_bias(s, b, h, i, j, doc):
    """A score_mod that reads the sequence index, positions within the sequence and (as
    every mod receives every mod_arg) the document table."""
    return s + 0.3 * b - 0.05 * (i - j) + 0.1 * doc[b, j]


def same_doc(b, h, i, j, doc):
    """Documents inside each packed sequence: doc[sequence, position]."""
    return doc[b, i] == doc[b, j]


@pytest.mark.slow
def test_mods_see_the_sequence_and_positions_in_it():
    rng = np.random.default_rng(3)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_Q)
    doc = (np.arange(max(LENS_Q))[None, :] // 3 + np.arange(len(LENS_Q))[:, None]) % 2
    opts = {"causal": True, "score_mod": seq_bias, "mask_mod": same_doc, "mod_args": (doc,)}
    _check_both(rng, q, k, v, cq, cq, opts)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(dtype):
    rng = np.random.default_rng(4)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K, dtype=dtype)
    do = rng.standard_normal(q.shape).astype(q.dtype)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, causal=True)
    assert o.dtype == q.dtype
    ref = oracle_varlen(q, k, v, cq, ck, do=do, causal=True)
    _check_forward(o, lse, ref[0], ref[1], dtype)
    grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True)
    for g, r in zip(grads, ref[2:]):
        assert g.dtype == q.dtype and rel_err(g, r) < TOL_BWD[dtype]


def test_max_seqlen_given_and_checked():
    rng = np.random.default_rng(5)
    q, k, v, cq, ck = packed(rng, [3, 2], [2, 4], Hq=2, Hkv=2, D=8)
    o = flashcore.attention_varlen(q, k, v, cq, ck, max_seqlen_q=10, max_seqlen_k=4,
                                   backend="reference")
    assert rel_err(o, oracle_varlen(q, k, v, cq, ck)[0]) < TOL_FWD["float64"]
    with pytest.raises(ValueError, match=r"max_seqlen_q=2 is less than the longest sequence \(3\)"):
        flashcore.attention_varlen(q, k, v, cq, ck, max_seqlen_q=2, backend="reference")


def _bad_cases():
    c = np.array([0, 3, 5], np.int32)
    return [
        ({"cu_seqlens_q": c.astype(np.float32)}, TypeError, r"cu_seqlens_q must be an integer"),
        ({"cu_seqlens_k": np.array([0, 4, 2, 6], np.int32)}, ValueError, "one length"),
        ({"cu_seqlens_k": np.array([0, 7, 6], np.int32)}, ValueError,
         r"cu_seqlens_k must be non-decreasing; got cu_seqlens_k\[1\]=7 > cu_seqlens_k\[2\]=6"),
        ({"cu_seqlens_q": np.array([1, 3, 5], np.int32)}, ValueError,
         r"cu_seqlens_q must start at 0; got cu_seqlens_q\[0\]=1"),
        ({"cu_seqlens_q": np.array([0, 3, 4], np.int32)}, ValueError,
         r"cu_seqlens_q must end at the total number of rows of q \(5\); got cu_seqlens_q\[-1\]=4"),
        ({"cu_seqlens_q": np.zeros((2, 3), np.int32)}, ValueError, r"cu_seqlens_q must have 1"),
        ({"max_seqlen_k": 1}, ValueError, r"max_seqlen_k=1 is less than the longest"),
        ({"max_seqlen_k": 2.5}, TypeError, r"max_seqlen_k must be an int"),
        ({"k": np.zeros((6, 3, 8)), "v": np.zeros((6, 3, 8))}, ValueError,
         "multiple of the key/value heads"),
        ({"v": np.zeros((6, 2, 8), np.float32)}, TypeError, "share one dtype"),
        ({"q": np.zeros((5, 2, 8, 1))}, ValueError, r"q must have 3 dimensions"),
        ({"window": (-1, 2)}, ValueError, "window's left bound"),
        ({"alibi_slopes": np.zeros(3, np.float32)}, ValueError, "alibi_slopes must have shape"),
        ({"scale": -1.0}, ValueError, "scale must be a positive"),
        ({"backend": "numba_cuda"}, flashcore.BackendUnavailableError, "numba_cuda"),
    ]


@pytest.mark.parametrize("change, error, match", [
    pytest.param(*c, id=f"{n}-{'-'.join(c[0])}") for n, c in enumerate(_bad_cases())])
def test_bad_inputs(change, error, match):
    rng = np.random.default_rng(6)
    q, k, v, cq, ck = packed(rng, [3, 2], [2, 4], Hq=2, Hkv=2, D=8)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cq, "cu_seqlens_k": ck, **change}
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    with pytest.raises(error, match=match):
        flashcore.attention_varlen(*pos, **args)


def test_backward_bad_lse_shape():
    rng = np.random.default_rng(7)
    q, k, v, cq, ck = packed(rng, [3, 2], [2, 4], Hq=2, Hkv=2, D=8)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, backend="reference")
    with pytest.raises(ValueError, match=r"lse must have shape \(Hq, total_q\) = \(2, 5\)"):
        flashcore.attention_varlen_backward(o, q, k, v, o, lse.T, cq, ck, backend="reference")


# --- frameworks ------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    do = rng.standard_normal(q.shape)
    ref = oracle_varlen(q, k, v, cq, ck, do=do, causal=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    o, lse = flashcore.attention_varlen(tq, tk, tv, torch.tensor(cq), torch.tensor(ck),
                                        causal=True, return_lse=True)
    assert isinstance(o, torch.Tensor) and not lse.requires_grad
    (o * torch.tensor(do)).sum().backward()
    _check_forward(o.detach().numpy(), lse.numpy(), ref[0], ref[1], "float64")
    for x, r in zip((tq, tk, tv), ref[2:]):
        assert rel_err(x.grad.numpy(), r) < TOL_BWD["float64"]


@pytest.mark.torch
@pytest.mark.slow
def test_torch_compile_fullgraph():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tcq, tck = torch.tensor(cq), torch.tensor(ck)

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return flashcore.attention_varlen(q, k, v, tcq, tck, max_seqlen_q=70, max_seqlen_k=90,
                                          causal=True).sum()

    f(tq, tk, tv).backward()
    ref = oracle_varlen(q, k, v, cq, ck, do=np.ones_like(q), causal=True)
    assert rel_err(tq.grad.numpy(), ref[2]) < TOL_BWD["float64"]


@pytest.mark.jax
def test_jax_grad_and_jit():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    rng = np.random.default_rng(10)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K)
    do = rng.standard_normal(q.shape)
    ref = oracle_varlen(q, k, v, cq, ck, do=do, causal=True)
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    jcq, jck = jnp.asarray(cq), jnp.asarray(ck)

    def loss(q, k, v, cq, ck):
        return jnp.sum(flashcore.attention_varlen(q, k, v, cq, ck, causal=True) * do)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv, jcq, jck)
    for g, r in zip(grads, ref[2:]):
        assert rel_err(np.asarray(g), r) < TOL_BWD["float64"]
    o, lse = flashcore.attention_varlen_forward(jq, jk, jv, jcq, jck, causal=True)
    _check_forward(np.asarray(o), np.asarray(lse), ref[0], ref[1], "float64")


def test_lse_is_the_log_of_the_softmax_sum():
    # one sequence, one key: lse is exactly the scaled score
    q = np.ones((1, 1, 4))
    k = np.full((1, 1, 4), 0.5)
    o, lse = flashcore.attention_varlen_forward(q, k, k, np.array([0, 1], np.int32),
                                                np.array([0, 1], np.int32), backend="reference")
    assert math.isclose(float(lse[0, 0]), 2.0 / 2.0, rel_tol=1e-6)



@pytest.mark.torch
def test_checked_calls_are_remembered_until_the_offsets_change(monkeypatch):
    """A varlen call on torch GPU offsets is checked once and looked up after, until the
    offsets are written (the version counter moves), replaced by another tensor, or the
    kind of call changes. GPU offsets stand in here as CPU tensors (the memo keys only
    tensors whose writes it sees: on the GPU, torch's version counter; a CPU tensor can
    also be written through a NumPy view, which moves no counter)."""
    torch = pytest.importorskip("torch")
    from flashcore import _packed_checks

    monkeypatch.setattr(_packed_checks, "_offsets_key", lambda x: (
        id(x), x.data_ptr(), x._version, tuple(x.shape), x.dtype))
    checks = []
    real = _packed_checks.make_varlen_case
    monkeypatch.setattr(_packed_checks, "make_varlen_case",
                        lambda *a, **kw: checks.append(kw.get("direction")) or real(*a, **kw))
    _packed_checks._VARLEN_PLANS.clear()
    rng = np.random.default_rng(11)
    q, k, v, cq, ck = (torch.tensor(x) for x in packed(rng, LENS_Q, LENS_K))
    ref = oracle_varlen(*(x.numpy() for x in (q, k, v, cq, ck)), causal=True)

    def call(cq, ck, **kw):
        return flashcore.attention_varlen_forward(q, k, v, cq, ck, causal=True,
                                                  backend="numba_cpu", **kw)

    for _ in range(3):
        o, lse = call(cq, ck)
        _check_forward(o.numpy(), lse.numpy(), ref[0], ref[1], "float64")
    assert len(checks) == 1
    call(cq.clone(), ck)  # another tensor, the same values: checked again
    call(cq, ck, max_seqlen_k=100)  # another kind of call
    assert len(checks) == 3
    grads = flashcore.attention_varlen_backward(torch.ones_like(q), q, k, v, o, lse, cq, ck,
                                                causal=True, backend="numba_cpu")
    assert len(checks) == 4 and checks[-1] == "backward" and len(grads) == 3
    cq[2] = cq[1] - 1  # written in place: checked again, and rejected
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        call(cq, ck)
    assert len(checks) == 5
