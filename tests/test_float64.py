"""float64 is really float64: lse has dtype float64 for float64 inputs (float32 otherwise),
so the backward pass's ``P = exp(S - lse)`` is float64-accurate and float64 gradients agree
with the float64 reference to ~1e-12, through every path that takes float64: NumPy
``attention_backward``, torch autograd (eager, the custom ops' fake implementations) and
``jax.grad`` (custom VJP), for each backend that serves float64 on the CPU."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, oracle_backward, oracle_forward, qkv, rel_err

import flashcore

#: (Nq, Nk, Hq, Hkv): GQA with fewer queries than keys (the causal mask's bottom-right
#: alignment) and the transposed case, whose first rows see no key.
SHAPES = [(40, 56, 4, 2), (56, 40, 2, 2)]
_ids = lambda s: f"Nq{s[0]}-Nk{s[1]}-H{s[2]}/{s[3]}"  # noqa: E731


def _inputs(seed, shape, dtype="float64", layout="bhnd"):
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, dtype=dtype, layout=layout)
    do = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, do


def _check_grads(grads, do, q, k, v, **opts):
    for name, g, r in zip(("dq", "dk", "dv"), grads, oracle_backward(do, q, k, v, **opts)):
        assert rel_err(np.asarray(g), r) <= TOL_BWD["float64"], (name, rel_err(g, r))


@pytest.mark.parametrize("backend", ["reference", "numba_cpu"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_lse_dtype_follows_the_inputs(backend, dtype):
    q, k, v, _ = _inputs(0, SHAPES[0], dtype)
    o, lse = flashcore.attention_forward(q, k, v, backend=backend)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)


@pytest.mark.parametrize("backend", ["reference", "numba_cpu"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_attention_backward_float64(backend, layout, causal, shape):
    q, k, v, do = _inputs(1, shape, layout=layout)
    opts = {"causal": causal, "layout": layout}
    o, lse = flashcore.attention_forward(q, k, v, backend=backend, **opts)
    o_ref, lse_ref = oracle_forward(q, k, v, **opts)
    assert lse.dtype == np.float64
    assert rel_err(o, o_ref) <= TOL_FWD["float64"]
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - lse_ref[fin]).max() <= 1e-12 * max(1.0, np.abs(lse_ref[fin]).max())
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend=backend, **opts)
    _check_grads(grads, do, q, k, v, **opts)


torch_only = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed")
jax_only = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                              reason="jax is not installed")


@torch_only
@pytest.mark.torch
@pytest.mark.parametrize("backend", ["auto", "numba_cpu", "reference", "torch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_autograd_float64(backend, causal):
    import torch

    q, k, v, do = _inputs(2, SHAPES[0])
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    o, lse = flashcore.attention(qt, kt, vt, causal=causal, backend=backend, return_lse=True)
    assert lse.dtype == torch.float64
    o.backward(torch.tensor(do))
    _check_grads([x.grad.numpy() for x in (qt, kt, vt)], do, q, k, v, causal=causal)
    _, lse_ref = oracle_forward(q, k, v, causal=causal)
    fin = np.isfinite(lse_ref)
    assert np.abs(lse.numpy()[fin] - lse_ref[fin]).max() <= 1e-12 * np.abs(lse_ref[fin]).max()


@torch_only
@pytest.mark.torch
def test_torch_ops_fake_lse_dtype():
    # torch.compile traces the ops through their fake implementations: the same dtypes
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashcore import _torch_ops

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        with FakeTensorMode():
            q = torch.empty(1, 2, 8, 16, dtype=dtype)
            o, lse = _torch_ops.attention_forward_op(q, q, q, False, 0.25, "bhnd", "auto", -1, [])
        assert o.dtype == dtype
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    q, k, v, _ = _inputs(3, SHAPES[1])
    args = tuple(torch.tensor(x, requires_grad=True) for x in (q, k, v))
    torch.library.opcheck(_torch_ops.attention_forward_op,
                          (*args, True, 0.25, "bhnd", "numba_cpu", -1, []))


@jax_only
@pytest.mark.jax
@pytest.mark.parametrize("backend", ["auto", "numba_cpu", "reference", "jax"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_grad_float64(backend, jit):
    import jax
    import jax.numpy as jnp

    q, k, v, do = _inputs(4, SHAPES[0])
    with jax.enable_x64(True):
        qj, kj, vj, doj = (jnp.asarray(x) for x in (q, k, v, do))
        f = lambda q, k, v: flashcore.attention(q, k, v, causal=True, backend=backend,  # noqa
                                                return_lse=True)
        f = jax.jit(f) if jit else f
        o, lse = f(qj, kj, vj)
        assert o.dtype == jnp.float64 and lse.dtype == jnp.float64
        loss = lambda q, k, v: jnp.sum(f(q, k, v)[0] * doj)  # noqa: E731
        grads = jax.grad(loss, argnums=(0, 1, 2))(qj, kj, vj)
        _check_grads([np.asarray(g) for g in grads], do, q, k, v, causal=True)
