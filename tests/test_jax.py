"""JAX: custom_vjp through flashcore's kernels, eager and under jit, vmap, the "jax"
backend's semantics, bad input at trace time, and buffer_callback on a GPU (gpu)."""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
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
)

import flashcore
from flashcore import _dispatch, _jax_ops

pytestmark = pytest.mark.jax

GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not GPU, reason="needs JAX with a CUDA GPU")

SHAPES = [(16, 16, 2, 2), (9, 23, 4, 2), (21, 8, 3, 1)]
SHAPE_IDS = ["square", "nq<nk-gqa", "nq>nk-mqa"]


def j(x, device=None):
    return jax.device_put(jnp.asarray(x), device)


def host(x):
    return np.asarray(x).astype(np.float64)


def _grads(fn, q, k, v, do):
    """(o, dq, dk, dv) of o = fn(q, k, v) pulled back with do."""
    o, pull = jax.vjp(fn, q, k, v)
    return (o, *pull(do))


def _check(fn, rng, dtype="float32", layout="bhnd", causal=False, shape=SHAPES[0], jit=False):
    Nq, Nk, Hq, Hkv = shape
    q, k, v = qkv(rng, B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, dtype=dtype, layout=layout)
    do = rand(rng, q.shape, dtype)
    opts = {"causal": causal, "layout": layout}

    def f(a, b, c):
        return fn(a, b, c, **opts)

    run = jax.jit(lambda *a: _grads(f, *a)) if jit else (lambda *a: _grads(f, *a))
    o, dq, dk, dv = run(j(q), j(k), j(v), j(do))
    assert o.shape == q.shape and o.dtype == j(q).dtype
    assert rel_err(host(o), oracle_forward(q, k, v, **opts)[0]) <= TOL_FWD[dtype]
    for g, r in zip((dq, dk, dv), oracle_backward(do, q, k, v, **opts)):
        assert rel_err(host(g), r) <= TOL_BWD[dtype]


# --- custom_vjp through the kernels -----------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("layout,causal,shape", [
    ("bhnd", True, SHAPES[1]), ("bnhd", False, SHAPES[2]), ("bnhd", True, SHAPES[0])])
@pytest.mark.parametrize("backend", ["auto", "jax"])
def test_grad_matches_reference(backend, layout, causal, shape, jit):
    _check(lambda *a, **o: flashcore.attention(*a, backend=backend, **o),
           np.random.default_rng(1), layout=layout, causal=causal, shape=shape, jit=jit)


def test_grad_bfloat16_under_jit():
    _check(flashcore.attention, np.random.default_rng(2), dtype="bfloat16", causal=True,
           shape=SHAPES[1], jit=True)


def test_auto_uses_a_numba_backend_through_callbacks():
    rng = np.random.default_rng(3)
    q, k, v = (j(x) for x in qkv(rng))
    jaxpr = str(jax.make_jaxpr(lambda a, b, c: flashcore.attention(a, b, c))(q, k, v))
    assert "custom_vjp" in jaxpr and "callback" in jaxpr
    text = jax.jit(lambda a, b, c: flashcore.attention(a, b, c)).lower(q, k, v).as_text()
    if importlib.util.find_spec("jax.experimental.buffer_callback") is None:
        return  # an older JAX: pure_callback serves the CPU
    assert "xla_buffer_python_" in text  # buffer_callback, not pure_callback


def test_custom_vjp_glue_with_reference_kernels():
    """The custom_vjp + callbacks, with the reference serving the callbacks (NumPy)."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, B=2, Hq=4, Hkv=2, Nq=9, Nk=23, D=16, layout="bnhd")
    case = _jax_ops._case(j(q), j(k), j(v), causal=True, scale=None, layout="bnhd",
                          need_lse=True, backend="auto", device="cpu")
    f = _jax_ops._numba_attention("reference", case)

    def fn(a, b, c, **_):
        return f(a, b, c)[0]

    with jax.default_device(jax.devices("cpu")[0]):  # the CPU callbacks, also on a GPU host
        _check(fn, rng, layout="bnhd", causal=True, shape=SHAPES[1], jit=True)


def test_numba_call_caches_are_bounded():
    # A serving loop with ever new sequence lengths once kept a jitted function per length.
    from dataclasses import replace

    rng = np.random.default_rng(4)
    q, k, v = (j(x) for x in qkv(rng, Nq=4, D=8))
    case = _jax_ops._case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True,
                          backend="auto", device="cpu")
    bound = _jax_ops._ATTENTIONS.max_size
    for n in range(1, bound + 20):
        c = replace(case, seqlen_q=n, seqlen_k=n)
        assert _jax_ops._numba_attention("numba_cpu", c) is _jax_ops._numba_attention(
            "numba_cpu", c)
    assert 0 < len(_jax_ops._ATTENTIONS) <= bound
    assert 0 < len(_jax_ops._CALLS) <= _jax_ops._CALLS.max_size


def test_grad_function_and_lse_is_a_constant():
    rng = np.random.default_rng(5)
    q, k, v = (j(x) for x in qkv(rng, Nq=8, D=8))

    def loss(a):
        o, lse = flashcore.attention(a, k, v, return_lse=True)
        return jnp.sum(o) + jnp.sum(lse)

    def loss_o(a):
        return jnp.sum(flashcore.attention(a, k, v))

    np.testing.assert_allclose(jax.grad(loss)(q), jax.grad(loss_o)(q), rtol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "jax"])
def test_vmap_over_a_leading_axis(backend):
    rng = np.random.default_rng(6)
    qs = np.stack([qkv(rng, Hq=4, Hkv=2, Nq=9, Nk=12, D=8)[0] for _ in range(3)])
    _, k, v = qkv(rng, Hq=4, Hkv=2, Nq=9, Nk=12, D=8)

    def f(a):
        return flashcore.attention(a, j(k), j(v), causal=True, backend=backend)

    out = jax.jit(jax.vmap(f))(j(qs))
    assert out.shape == qs.shape
    for i in range(3):
        assert rel_err(host(out[i]), oracle_forward(qs[i], k, v, causal=True)[0]) <= 2e-5
    # ...and its gradient (vmap of grad batches the backward callback too).
    g = jax.vmap(jax.grad(lambda a: jnp.sum(f(a) ** 2)))(j(qs))
    do = 2 * np.asarray(out, dtype=np.float64)
    for i in range(3):
        dq = oracle_backward(do[i].astype(np.float32), qs[i], k, v, causal=True)[0]
        assert rel_err(host(g[i]), dq) <= TOL_BWD["float32"]


def test_vmap_with_option_arrays():
    """ALiBi slopes and mod_args through the CPU callback under vmap (they came with the
    vmapped axis in front and failed the checks): unmapped slopes (Hq,), slopes mapped
    with q ((V, B, Hq)), and a score_mod reading an unmapped table; forward under jit, and
    the gradient, against the float64 reference per problem."""
    rng = np.random.default_rng(23)
    V, B, H, N, D = 3, 2, 4, 20, 8
    qs = np.stack([qkv(rng, B=B, Hq=H, Hkv=H, Nq=N, Nk=N, D=D)[0] for _ in range(V)])
    _, k, v = qkv(rng, B=B, Hq=H, Hkv=H, Nq=N, Nk=N, D=D)
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    mapped = np.stack([np.broadcast_to(slopes * (i + 1), (B, H)) for i in range(V)])
    table = (rng.standard_normal((H, 2 * N + 1)) * 0.5).astype(np.float32)

    def rel_bias(s, b, h, i, j, t):
        return s + t[h, i - j + 20]

    cases = [({"alibi_slopes": slopes}, None), (None, mapped),
             ({"score_mod": rel_bias, "mod_args": (table,)}, None)]
    for opts, per in cases:
        def f(a, s=None, opts=opts):
            extra = opts if s is None else {"alibi_slopes": s}
            jextra = {n: (tuple(j(x) for x in val) if n == "mod_args" else
                          j(val) if n == "alibi_slopes" else val) for n, val in extra.items()}
            return flashcore.attention(a, j(k), j(v), causal=True, **jextra)

        args = (j(qs),) if per is None else (j(qs), j(per))
        out = jax.jit(jax.vmap(f))(*args)
        grads = jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a) ** 2)))(*args)
        for i in range(V):
            ref_opts = opts if per is None else {"alibi_slopes": per[i].copy()}
            x64 = [x.astype(np.float64) for x in (qs[i], k, v)]
            ro, rl = flashcore.attention_forward(*x64, causal=True, backend="reference",
                                                 **ref_opts)
            assert rel_err(host(out[i]), ro) <= TOL_FWD["float32"], (opts, per is None)
            do = 2 * np.asarray(out[i], dtype=np.float64)
            rq = flashcore.attention_backward(do, *x64, ro, rl, causal=True,
                                              backend="reference", **ref_opts)[0]
            assert rel_err(host(grads[i]), rq) <= TOL_BWD["float32"], (opts, per is None)
    # mod_args mapped by vmap are refused (each problem would read the first one's); when
    # the call runs (a ValueError inside XLA's runtime error)
    tables = j(np.stack([table, 2 * table, 3 * table]))
    with pytest.raises(Exception, match=r"mod_args\[0\] is mapped under jax.vmap"):
        jax.block_until_ready(jax.vmap(lambda a, t: flashcore.attention(
            a, j(k), j(v), score_mod=rel_bias, mod_args=(t,)))(j(qs), tables))


def test_option_mistakes_raise_at_trace_time():
    """Mistakes in the options are TypeErrors at the call (at trace time under jit), as in
    NumPy calls, not errors inside XLA's host callback: a score_mod or mask_mod that does
    not compile (wrong arity) or returns the wrong kind, mod_args not a tuple, slopes that
    are a list or of another library."""
    rng = np.random.default_rng(29)
    q, k, v = (j(x) for x in qkv(rng, Hq=2, Hkv=2, Nq=8, Nk=8, D=8))
    table = j(np.zeros((2, 4), np.float32))
    for opts, match in [
            ({"score_mod": lambda s, b, h, i: s}, "score_mod .* does not compile"),
            ({"score_mod": lambda s, b, h, i, j: s > 0}, "score_mod .* must return a number"),
            ({"mask_mod": lambda b, h, i, j: (i, j)}, "mask_mod .* must return a bool"),
            ({"score_mod": lambda s, b, h, i, j, t: s + t[h, 0], "mod_args": table},
             "mod_args must be a tuple"),
            ({"alibi_slopes": [0.5, 0.25]}, "alibi_slopes must be an array"),
            ({"score_mod": 3}, "score_mod must be a Python function"),
            ({"mask_mod": "causal"}, "mask_mod must be a Python function")]:
        for wrap in (lambda g: g, jax.jit):
            with pytest.raises(TypeError, match=match):
                wrap(lambda a, b, c, opts=opts: flashcore.attention(a, b, c, **opts))(q, k, v)
    # (the CPU's compile check is numba_cpu's: the reference runs a mod Numba cannot
    # compile, as Python)
    bias = {0: 0.5, 1: -0.5}
    o = flashcore.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h],
                            backend="reference")
    assert np.isfinite(host(o)).all()
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="alibi_slopes must be a JAX"):
        flashcore.attention(q, k, v, alibi_slopes=torch.ones(2))


# --- the "jax" backend ------------------------------------------------------------------------


@pytest.mark.parametrize("layout,causal,shape", [
    ("bhnd", False, SHAPES[0]), ("bnhd", True, SHAPES[0]), ("bnhd", True, SHAPES[1]),
    ("bhnd", True, SHAPES[2]), ("bnhd", False, SHAPES[1]), ("bhnd", True, (6, 0, 2, 1)),
    ("bnhd", False, (0, 5, 2, 2))],
    ids=["full-square", "causal-square", "causal-nq<nk-gqa", "causal-nq>nk-mqa",
         "full-nq<nk-gqa", "causal-nk=0", "full-nq=0"])
def test_jax_backend_forward(layout, causal, shape):
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, layout=layout)
    opts = {"causal": causal, "layout": layout}
    o, lse = flashcore.attention_forward(j(q), j(k), j(v), backend="jax", **opts)
    ro, rlse = oracle_forward(q, k, v, **opts)
    assert lse.dtype == jnp.float32 and lse.shape == rlse.shape
    assert rel_err(host(o), ro) <= TOL_FWD["float32"]
    assert rel_err(host(lse), rlse) <= TOL_FWD["float32"]
    oj, lj = jax.jit(lambda a, b, c: flashcore.attention(a, b, c, return_lse=True,
                                                         backend="jax", **opts))(j(q), j(k), j(v))
    assert rel_err(host(oj), ro) <= TOL_FWD["float32"]
    assert rel_err(host(lj), rlse) <= TOL_FWD["float32"]


def test_jax_backend_backward_and_empty_rows():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, Hq=3, Hkv=1, Nq=21, Nk=8, D=16)
    do = rand(rng, q.shape)
    o, lse = flashcore.attention_forward(j(q), j(k), j(v), causal=True, backend="jax")
    assert np.all(np.asarray(o)[:, :, :13] == 0) and np.all(np.asarray(lse)[:, :, :13] == -math.inf)
    grads = flashcore.attention_backward(j(do), j(q), j(k), j(v), o, lse, causal=True,
                                         backend="jax")
    for g, r in zip(grads, oracle_backward(do, q, k, v, causal=True)):
        assert np.all(np.isfinite(np.asarray(g)))
        assert rel_err(host(g), r) <= TOL_BWD["float32"]


def test_jax_backend_declines_other_libraries():
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng)
    with pytest.raises(flashcore.BackendUnavailableError, match="JAX"):
        flashcore.attention(q, k, v, backend="jax")


# --- bad input ----------------------------------------------------------------------------------


def test_mixed_libraries_raise():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="one library"):
        flashcore.attention(j(q), k, j(v))
    o, lse = flashcore.attention_forward(j(q), j(k), j(v))
    with pytest.raises(TypeError, match="one library"):
        flashcore.attention_backward(q, j(q), j(k), j(v), o, lse)


def test_bad_input_raises_at_trace_time():
    rng = np.random.default_rng(11)
    q, k, v = (j(x) for x in qkv(rng, Hq=3, Hkv=2))
    with pytest.raises(ValueError, match="multiple"):
        jax.jit(flashcore.attention)(q, k, v)
    with pytest.raises(TypeError, match="dtype"):
        jax.jit(flashcore.attention)(q, q, q.astype(jnp.int32))
    with pytest.raises(ValueError, match="scale"):
        jax.jit(lambda a: flashcore.attention(a, a, a, scale=0.0))(q)
    with pytest.raises(ValueError, match="4 dimensions"):
        flashcore.attention(q[0], q[0], q[0])


def test_gpu_path_without_buffer_callback_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_buffer_callback(name, *args, **kw):
        if name == "jax.experimental.buffer_callback":
            raise ImportError("no buffer_callback here")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_buffer_callback)
    with pytest.raises(flashcore.BackendUnavailableError, match="buffer_callback"):
        _jax_ops._buffer_callback()


# --- GPU (run on a GPU machine) ------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gpu_grad_matches_reference(jit):
    _check(flashcore.attention, np.random.default_rng(12), dtype="bfloat16", layout="bnhd",
           causal=True, shape=SHAPES[1], jit=jit)
    _check(flashcore.attention, np.random.default_rng(12), dtype="float32", layout="bhnd",
           causal=False, shape=SHAPES[2], jit=jit)


@pytest.mark.gpu
@gpu
def test_gpu_alibi_and_window_under_jit_grad_and_vmap():
    """ALiBi slopes reach the CUDA kernels through buffer_callback (as a (B, Hq) buffer, so
    vmap folds into the batch): forward and gradients under jit, and a vmapped forward,
    against the float64 reference."""
    rng = np.random.default_rng(17)
    B, Hq, Hkv, N, D = 2, 4, 2, 100, 64
    q, k, v = qkv(rng, B=B, Hq=Hq, Hkv=Hkv, Nq=N, Nk=N, D=D)
    do = rand(rng, q.shape, "float32")
    slopes = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32)
    opts = dict(causal=True, window=(40, 0))
    ro, _ = flashcore.attention_forward(*(x.astype(np.float64) for x in (q, k, v)),
                                        alibi_slopes=slopes, backend="reference", **opts)
    rg = flashcore.attention_backward(
        do.astype(np.float64), *(x.astype(np.float64) for x in (q, k, v)), ro,
        flashcore.attention_forward(*(x.astype(np.float64) for x in (q, k, v)),
                                    alibi_slopes=slopes, backend="reference", **opts)[1],
        alibi_slopes=slopes, backend="reference", **opts)

    def loss(a, b, c, s):
        return jnp.sum(flashcore.attention(a, b, c, alibi_slopes=s, **opts) * j(do))

    o = jax.jit(lambda a, b, c, s: flashcore.attention(a, b, c, alibi_slopes=s, **opts))(
        j(q), j(k), j(v), j(slopes))
    assert rel_err(host(o), ro) <= TOL_FWD["float32"]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(j(q), j(k), j(v), j(slopes))
    for g, r in zip(grads, rg):
        assert rel_err(host(g), r) <= TOL_BWD["float32"]
    # two problems stacked by vmap, each with its own (B, Hq) slopes
    s2 = np.stack([np.broadcast_to(slopes, (B, Hq)), np.broadcast_to(slopes[::-1], (B, Hq))])
    out = jax.jit(jax.vmap(lambda s: flashcore.attention(j(q), j(k), j(v), alibi_slopes=s,
                                                         **opts)))(j(s2.copy()))
    for i in range(2):
        ri, _ = flashcore.attention_forward(*(x.astype(np.float64) for x in (q, k, v)),
                                            alibi_slopes=s2[i].copy(), backend="reference",
                                            **opts)
        assert rel_err(host(out[i]), ri) <= TOL_FWD["float32"]


def _doc_mask(b, h, i, j, docs, table):  # (every mod gets all mod_args)
    return docs[b, i] == docs[b, j]


def _table_bias(s, b, h, i, j, docs, table):
    return s + table[h, i - j + 127]


@pytest.mark.gpu
@gpu
def test_gpu_score_mod_and_mask_mod_with_mod_args():
    """A document mask_mod and a relative-position score_mod reading mod_args (int32
    document ids (B, N), a float32 bias table (Hq, 255)) run in the CUDA kernels on JAX
    arrays: eagerly through attention_forward/backward (backend numba_cuda) and under jit
    through buffer_callback (forward and gradients; the tile classes come from the mod_args
    copied on XLA's stream), and under vmap with unmapped mod_args; against the float64
    reference."""
    rng = np.random.default_rng(21)
    B, Hq, Hkv, N, D = 2, 4, 2, 128, 64
    q, k, v = qkv(rng, B=B, Hq=Hq, Hkv=Hkv, Nq=N, Nk=N, D=D)
    do = rand(rng, q.shape, "float32")
    docs = np.sort(rng.integers(0, 4, size=(B, N)), axis=1).astype(np.int32)
    table = (0.1 * rng.standard_normal((Hq, 255))).astype(np.float32)
    opts = dict(causal=True, score_mod=_table_bias, mask_mod=_doc_mask)
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    ro, rl = flashcore.attention_forward(*f64, mod_args=(docs, table), backend="reference",
                                         **opts)
    rg = flashcore.attention_backward(do.astype(np.float64), *f64, ro, rl,
                                      mod_args=(docs, table), backend="reference", **opts)
    margs = (j(docs), j(table))
    case = _jax_ops._case(j(q), j(k), j(v), causal=True, scale=None, layout="bhnd",
                          need_lse=True, backend="auto",
                          options=flashcore._mods.options(None, None, None, _table_bias,
                                                          _doc_mask, margs, None))
    assert case.on_gpu and _dispatch.select(case, "auto").NAME == "numba_cuda"
    # eager, the backend named
    o, lse = flashcore.attention_forward(j(q), j(k), j(v), mod_args=margs,
                                         backend="numba_cuda", **opts)
    assert rel_err(host(o), ro) <= TOL_FWD["float32"]
    grads = flashcore.attention_backward(j(do), j(q), j(k), j(v), o, lse, mod_args=margs,
                                         backend="numba_cuda", **opts)
    for g, r in zip(grads, rg):
        assert rel_err(host(g), r) <= TOL_BWD["float32"]

    # under jit: forward and gradients
    def loss(a, b, c, d, t):
        return jnp.sum(flashcore.attention(a, b, c, mod_args=(d, t), **opts) * j(do))

    o = jax.jit(lambda a, b, c, d, t: flashcore.attention(a, b, c, mod_args=(d, t), **opts))(
        j(q), j(k), j(v), *margs)
    assert rel_err(host(o), ro) <= TOL_FWD["float32"]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(j(q), j(k), j(v), *margs)
    for g, r in zip(grads, rg):
        assert rel_err(host(g), r) <= TOL_BWD["float32"]
    # vmap over two problems (q differs), the mod_args not mapped
    q2 = np.stack([q, q[:, ::-1].copy()])
    out = jax.jit(jax.vmap(lambda a: flashcore.attention(a, j(k), j(v), mod_args=margs,
                                                         **opts)))(j(q2))
    for i in range(2):
        ri, _ = flashcore.attention_forward(q2[i].astype(np.float64), *f64[1:],
                                            mod_args=(docs, table), backend="reference",
                                            **opts)
        assert rel_err(host(out[i]), ri) <= TOL_FWD["float32"]


@pytest.mark.gpu
@gpu
def test_gpu_jit_uses_buffer_callback_and_numba_cuda():
    rng = np.random.default_rng(13)
    q, k, v = (j(x) for x in qkv(rng, Nq=64, D=32, dtype="bfloat16"))
    case = _jax_ops._case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True,
                          backend="auto")
    assert case.on_gpu and _dispatch.select(case, "auto").NAME == "numba_cuda"
    text = jax.jit(lambda a, b, c: flashcore.attention(a, b, c)).lower(q, k, v).as_text()
    assert "xla_buffer_python_gpu_callback" in text


@pytest.mark.gpu
@gpu
def test_gpu_mixed_devices_raise():
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng)
    cpu = jax.devices("cpu")[0]
    with pytest.raises(ValueError, match="one device"):
        flashcore.attention(j(q), j(k, cpu), j(v))


@pytest.mark.gpu
@gpu
def test_gpu_vmap_under_jit():
    rng = np.random.default_rng(14)
    qs = np.stack([qkv(rng, Nq=40, D=32)[0] for _ in range(2)])
    _, k, v = qkv(rng, Nq=40, D=32)
    out = jax.jit(jax.vmap(lambda a: flashcore.attention(a, j(k), j(v), causal=True)))(j(qs))
    for i in range(2):
        assert rel_err(host(out[i]), oracle_forward(qs[i], k, v, causal=True)[0]) <= 2e-5


@pytest.mark.gpu
@gpu
def test_gpu_output_stays_on_the_input_device():
    devs = jax.devices("gpu")
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, Nq=32, D=16)
    dev = devs[-1]
    o = jax.jit(lambda a, b, c: flashcore.attention(a, b, c))(*(j(x, dev) for x in (q, k, v)))
    assert o.devices() == {dev}
    assert rel_err(host(o), oracle_forward(q, k, v)[0]) <= TOL_FWD["float32"]


@pytest.mark.gpu
@gpu
def test_gpu_host_runs_cpu_arrays_under_jit_on_the_cpu():
    """Traced arrays carry no device: each platform gets its branch (platform_dependent)."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, Hq=4, Hkv=2, Nq=9, Nk=23, D=16)
    do = rand(rng, q.shape)
    args = [j(x, cpu) for x in (q, k, v, do)]
    o, dq, dk, dv = jax.jit(lambda *a: _grads(
        lambda x, y, z: flashcore.attention(x, y, z, causal=True), *a))(*args)
    assert o.devices() == {cpu}
    assert rel_err(host(o), oracle_forward(q, k, v, causal=True)[0]) <= TOL_FWD["float32"]
    for g, r in zip((dq, dk, dv), oracle_backward(do, q, k, v, causal=True)):
        assert rel_err(host(g), r) <= TOL_BWD["float32"]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_functional_api_under_jit_matches_eager(layout):
    """attention_forward / attention_backward on traced arrays go through the glue."""
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(x) for x in qkv(rng, Hq=4, Hkv=2, Nq=33, Nk=40, D=16, layout=layout))
    do = jnp.asarray(rand(rng, (1, 4, 33, 16), layout=layout))
    opts = dict(causal=True, layout=layout)
    o, lse = jax.jit(lambda q, k, v: flashcore.attention_forward(q, k, v, **opts))(q, k, v)
    ro, rlse = oracle_forward(*(np.asarray(x) for x in (q, k, v)), **opts)
    assert rel_err(np.asarray(o), ro) <= TOL_FWD["float32"]
    assert rel_err(np.asarray(lse), rlse) <= 1e-6
    grads = jax.jit(lambda *a: flashcore.attention_backward(*a, **opts))(do, q, k, v, o, lse)
    refs = oracle_backward(*(np.asarray(x) for x in (do, q, k, v)), **opts)
    for g, r in zip(grads, refs):
        assert rel_err(np.asarray(g), r) <= TOL_BWD["float32"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "numba_cpu", "jax"])
def test_nan_reaches_exactly_the_rows_that_see_it(backend, shape, causal):
    q, k, v, bad = nan_inputs(np.random.default_rng(), *shape, causal)
    o, lse = flashcore.attention_forward(j(q), j(k), j(v), causal=causal, backend=backend)
    assert_nan_rows(o, lse, bad)
