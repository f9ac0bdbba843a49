"""Packed calls on JAX GPU arrays: ``attention_varlen`` (forward and gradients) and
``attention_with_kvcache`` (appends into the returned caches) run numba_cuda's kernels on
XLA's buffers and stream through ``buffer_callback``, under ``jit`` and eagerly, against the
per-sequence float64 oracle of tests/packed_helpers.py (gpu: skipped without a CUDA GPU
visible to JAX).

XLA's output buffers are not poisoned by flashcore (they are XLA's, handed out by the
callback); the tests free NaN-filled arrays of the outputs' sizes first, so that a buffer
the kernels leave unwritten is likely to hold NaN. Every test counts the numba_cuda
launches its call made, so a host fallback cannot pass for the GPU path.
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from helpers import TOL_BWD, TOL_FWD, rel_err, run_under_simulator  # noqa: E402
from packed_helpers import oracle_kvcache, oracle_varlen, packed  # noqa: E402

import flashcore  # noqa: E402

GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.jax


def on_gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs JAX with a CUDA GPU")(f))


@pytest.fixture
def launches(monkeypatch):
    """Names of the numba_cuda launches made (forward, backward, append, merge)."""
    from flashcore.backends.numba_cuda import launch

    seen = []
    for name in ("run_forward", "run_backward", "run_append", "run_merge"):
        real = getattr(launch, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(launch, name, spy)
    return seen


def _nan_pool(*shapes):
    """Allocate and free NaN arrays (float32 words enough for ``shapes``), so XLA's
    allocator is likely to hand their memory to the next outputs."""
    for s in shapes:
        jnp.full((int(np.prod(s)) + 1,), jnp.nan, jnp.float32).block_until_ready().delete()


def _dev(x, dtype):
    return jnp.asarray(np.asarray(x, np.float32)).astype(getattr(jnp, dtype))


def host(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32)).astype(np.float64)


def _check_o_lse(dtype, o, lse, ro, rl):
    o, lse = host(o), host(lse)
    assert rel_err(o, ro) < TOL_FWD[dtype], rel_err(o, ro)
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - rl[fin]).max() < 1e-4


def _lowers_to_buffer_callback(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return "xla_buffer_python_gpu_callback" in text


# --- varlen ------------------------------------------------------------------------------

#: one empty sequence, one with more queries than keys (rows that see no key, causal)
LENS_Q = [0, 300, 129, 1000, 64]
LENS_K = [17, 200, 129, 1100, 70]


@pytest.mark.parametrize("dtype, D, causal", [("bfloat16", 128, True), ("float32", 64, True),
                                              ("bfloat16", 64, False)])
@on_gpu
def test_varlen_forward_and_grad_under_jit(dtype, D, causal, launches):
    """GQA 4:1 packed sequences: o and lse under jit, and the gradients of a loss under
    jit(grad), against the oracle; the calls lower to buffer_callback."""
    rng = np.random.default_rng(D)
    q, k, v, cq, ck = packed(rng, LENS_Q, LENS_K, Hq=8, Hkv=2, D=D, dtype="float32")
    do = rng.standard_normal(q.shape).astype(np.float32)
    jq, jk, jv, jdo = (_dev(x, dtype) for x in (q, k, v, do))
    jcq, jck = jnp.asarray(cq), jnp.asarray(ck)
    ro, rl, *rg = oracle_varlen(host(jq), host(jk), host(jv), cq, ck, do=host(jdo),
                                causal=causal)

    def fwd(a, b, c, oq, ok):
        return flashcore.attention_varlen(a, b, c, oq, ok, causal=causal, return_lse=True)

    def loss(a, b, c, oq, ok):
        o = flashcore.attention_varlen(a, b, c, oq, ok, causal=causal)
        return jnp.sum(o.astype(jnp.float32) * jdo.astype(jnp.float32))

    assert _lowers_to_buffer_callback(fwd, jq, jk, jv, jcq, jck)
    _nan_pool(q.shape, (8, q.shape[0]))
    o, lse = jax.jit(fwd)(jq, jk, jv, jcq, jck)
    assert o.dtype == jq.dtype and lse.dtype == jnp.float32 and lse.shape == (8, q.shape[0])
    _check_o_lse(dtype, o, lse, ro, rl)
    assert launches == ["run_forward"]
    _nan_pool(q.shape, k.shape, k.shape, (8, q.shape[0]))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv, jcq, jck)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        assert g.dtype == jq.dtype
        assert rel_err(host(g), r) < TOL_BWD[dtype], f"{name}: {rel_err(host(g), r)}"
    assert launches.count("run_backward") == 1


@on_gpu
def test_varlen_eager_forward_backward_and_max_seqlen(launches):
    """Eager attention_varlen_forward/backward on concrete JAX GPU arrays (the adapter's
    own path, offsets made int32 on the device), and a jitted call given max_seqlen_*."""
    dtype = "bfloat16"
    rng = np.random.default_rng(3)
    lq, lk = [5, 0, 77, 130], [9, 40, 77, 100]
    q, k, v, cq, ck = packed(rng, lq, lk, Hq=4, Hkv=4, D=64, dtype="float32")
    do = rng.standard_normal(q.shape).astype(np.float32)
    jq, jk, jv, jdo = (_dev(x, dtype) for x in (q, k, v, do))
    jcq, jck = jnp.asarray(cq), jnp.asarray(ck)
    ro, rl, *rg = oracle_varlen(host(jq), host(jk), host(jv), cq, ck, do=host(jdo),
                                causal=True)
    o, lse = flashcore.attention_varlen_forward(jq, jk, jv, jcq, jck, causal=True)
    _check_o_lse(dtype, o, lse, ro, rl)
    grads = flashcore.attention_varlen_backward(jdo, jq, jk, jv, o, lse, jcq, jck, causal=True)
    for g, r in zip(grads, rg):
        assert rel_err(host(g), r) < TOL_BWD[dtype]
    f = jax.jit(lambda a, b, c, x, y: flashcore.attention_varlen(
        a, b, c, x, y, max_seqlen_q=130, max_seqlen_k=100, causal=True))
    assert rel_err(host(f(jq, jk, jv, jcq, jck)), ro) < TOL_FWD[dtype]
    assert launches.count("run_forward") == 2 and launches.count("run_backward") == 1


def _seq_doc(b, h, i, j, docs, bias):  # (every mod gets all mod_args)
    return docs[b, i] == docs[b, j]


def _seq_bias(s, b, h, i, j, docs, bias):
    return s + bias[b, h]


@on_gpu
def test_varlen_user_mods_under_jit(launches):
    """Packed sequences with a score_mod and a mask_mod reading mod_args (document ids per
    sequence row, a bias per sequence and head) under jit, forward and gradients (bf16: on
    an H100/H200 the wgmma backward, tile classes per sequence from the mod_args copied on
    XLA's stream), against the per-sequence oracle."""
    dtype = "bfloat16"
    rng = np.random.default_rng(8)
    lens = [300, 0, 700, 129]
    q, k, v, cq, ck = packed(rng, lens, lens, Hq=4, Hkv=2, D=128, dtype="float32")
    do = rng.standard_normal(q.shape).astype(np.float32)
    docs = (np.arange(700)[None, :] * np.array([[3], [1], [5], [2]]) // 350).astype(np.int32)
    bias = rng.standard_normal((len(lens), 4)).astype(np.float32)
    opts = dict(causal=True, score_mod=_seq_bias, mask_mod=_seq_doc)
    jq, jk, jv, jdo = (_dev(x, dtype) for x in (q, k, v, do))
    jcq, jck = jnp.asarray(cq), jnp.asarray(ck)
    margs = (jnp.asarray(docs), jnp.asarray(bias))
    ro, rl, *rg = oracle_varlen(host(jq), host(jk), host(jv), cq, ck, do=host(jdo),
                                mod_args=(docs, bias), **opts)

    def loss(a, b, c, oq, ok, d, t):
        o = flashcore.attention_varlen(a, b, c, oq, ok, mod_args=(d, t), **opts)
        return jnp.sum(o.astype(jnp.float32) * jdo.astype(jnp.float32))

    o = jax.jit(lambda a, b, c, oq, ok, d, t: flashcore.attention_varlen(
        a, b, c, oq, ok, mod_args=(d, t), **opts))(jq, jk, jv, jcq, jck, *margs)
    assert rel_err(host(o), ro) < TOL_FWD[dtype], rel_err(host(o), ro)
    _nan_pool(q.shape, k.shape, k.shape, (4, q.shape[0]))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv, jcq, jck, *margs)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        assert rel_err(host(g), r) < TOL_BWD[dtype], f"{name}: {rel_err(host(g), r)}"
    assert launches.count("run_forward") == 2 and launches.count("run_backward") == 1


@on_gpu
def test_varlen_bad_offsets_under_jit_raise():
    """The callback reads the offsets and checks them before any kernel runs."""
    rng = np.random.default_rng(4)
    q, k, v, cq, ck = packed(rng, [3, 4], [3, 4], Hq=2, Hkv=2, D=32, dtype="float32")
    bad = cq.copy()
    bad[1] = 9  # not non-decreasing
    f = jax.jit(lambda a, b, c, x, y: flashcore.attention_varlen(a, b, c, x, y))
    with pytest.raises(Exception, match="cu_seqlens_q"):
        jax.block_until_ready(f(*(jnp.asarray(x) for x in (q, k, v, bad, ck))))


# --- KV cache ----------------------------------------------------------------------------


def _cache_inputs(rng, page, nq, dtype, B=3, Hq=8, Hkv=2, D=128, n_new=2, cap=3072):
    """(q, k_cache, v_cache, seqlens, k, v, table, want_k, want_v) on the GPU; the wanted
    caches written by a plain loop on the host."""
    seqlens = np.array([0, min(700, cap // 2), cap - n_new - 5][:B], np.int32)
    if page is not None:
        n_pages = B * cap // page + 7
        table = rng.permutation(n_pages)[:B * cap // page].reshape(B, -1).astype(np.int32)
        shape = (n_pages, page, Hkv, D)
    else:
        table, shape = None, (B, cap, Hkv, D)
    kc, vc = (_dev(rng.standard_normal(shape), dtype) for _ in range(2))
    q = _dev(rng.standard_normal((B, nq, Hq, D)), dtype)
    kn, vn = (_dev(rng.standard_normal((B, n_new, Hkv, D)), dtype) for _ in range(2))
    want = []
    for cache, new in ((kc, kn), (vc, vn)):
        w, n = np.array(cache), np.asarray(new)
        for b in range(B):
            for s in range(n_new):
                p = int(seqlens[b]) + s
                at = (b, p) if table is None else (int(table[b, p // page]), p % page)
                w[at] = n[b, s]
        want.append(w)
    return q, kc, vc, seqlens, kn, vn, table, *want


def _bits(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("page, nq, splits, dtype", [
    (16, 1, 0, "bfloat16"), (None, 1, 0, "bfloat16"), (256, 4, 3, "float16"),
    (None, 2, 1, "float32"), (16, 1, 5, "float32")])
@on_gpu
def test_kvcache_append_and_attend_under_jit(page, nq, splits, dtype, launches):
    """A decode step under jit with the caches donated: the returned caches hold the new
    keys where a plain loop puts them and nothing else changed (bit for bit), o and lse
    match the oracle over the appended caches; contiguous and paged (pages of 16 keys: a
    key tile spans pages; 256), GQA 4:1, causal, split-KV."""
    rng = np.random.default_rng(nq + splits)
    q, kc, vc, seqlens, kn, vn, table, want_k, want_v = _cache_inputs(rng, page, nq, dtype)
    jt = None if table is None else jnp.asarray(table)

    def step(q, kc, vc, lengths, k, v, t):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=t, causal=True,
                                                num_splits=splits, return_lse=True)

    args = (q, kc, vc, jnp.asarray(seqlens), kn, vn, jt)
    assert _lowers_to_buffer_callback(step, *args)
    _nan_pool(q.shape, (3, 8, nq))
    o, lse, new_k, new_v = jax.jit(step, donate_argnums=(1, 2))(*args)
    assert np.array_equal(_bits(new_k), _bits(want_k))
    assert np.array_equal(_bits(new_v), _bits(want_v))
    ro, rl = oracle_kvcache(host(q), host(want_k), host(want_v), seqlens + 2, table,
                            page or 1, causal=True)
    _check_o_lse(dtype, o, lse, ro, rl)
    assert launches.count("run_append") == 1 and launches.count("run_forward") == 1
    if splits > 1:
        assert launches.count("run_merge") == 1


@on_gpu
def test_kvcache_without_donation_and_eager_keeps_the_inputs(launches):
    """Without donation XLA copies the caches into the outputs first: the arrays given
    are unchanged (jit and eager), the returned ones appended; no new keys: the caches come
    back as they were."""
    rng = np.random.default_rng(9)
    q, kc, vc, seqlens, kn, vn, table, want_k, want_v = _cache_inputs(
        rng, 16, 1, "bfloat16", cap=512)
    before_k, before_v = np.array(kc), np.array(vc)
    jl, jt = jnp.asarray(seqlens), jnp.asarray(table)

    def step(q, kc, vc, lengths, k, v, t):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=t, causal=True)

    for f in (jax.jit(step), step):
        o, new_k, new_v = f(q, kc, vc, jl, kn, vn, jt)
        assert np.array_equal(_bits(new_k), _bits(want_k))
        assert np.array_equal(_bits(new_v), _bits(want_v))
        assert np.array_equal(_bits(kc), _bits(before_k))
        assert np.array_equal(_bits(vc), _bits(before_v))
        ro, _ = oracle_kvcache(host(q), host(want_k), host(want_v), seqlens + 2, table, 16,
                               causal=True)
        assert rel_err(host(o), ro) < TOL_FWD["bfloat16"]
    o, same_k, same_v = jax.jit(lambda q, kc, vc, lengths, t: flashcore.attention_with_kvcache(
        q, kc, vc, cache_seqlens=lengths, block_table=t))(q, kc, vc, jl + 2, jt)
    assert np.array_equal(_bits(same_k), _bits(kc)) and np.array_equal(_bits(same_v), _bits(vc))
    assert launches.count("run_append") == 2 and launches.count("run_forward") == 3


@on_gpu
def test_kvcache_lengths_beyond_the_pages_raise_under_jit():
    """The callback checks the lengths against the block table before anything is
    written."""
    rng = np.random.default_rng(10)
    q, kc, vc, seqlens, kn, vn, table, *_ = _cache_inputs(rng, 16, 1, "float32", cap=256)
    seqlens = seqlens.copy()
    seqlens[2] = 255  # + 2 new keys > 256

    def step(q, kc, vc, lengths, k, v, t):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=t)

    with pytest.raises(Exception, match="exceed"):
        jax.block_until_ready(jax.jit(step)(q, kc, vc, jnp.asarray(seqlens), kn, vn,
                                            jnp.asarray(table)))


# --- offline: the GPU glue as traced and lowered (no GPU needed) ---------------------------


def test_gpu_glue_lowers_for_cuda(monkeypatch):
    """With numba_cuda made to accept and the arrays said to be on a GPU, the packed calls
    trace and lower for CUDA to buffer_callback custom calls: the KV cache's caches alias
    its outputs (and, donated, the jit's parameters), split-KV partials are lent, the
    varlen gradient is two callbacks (forward, backward)."""
    from flashcore import _dispatch, _jax_varlen

    nc = _dispatch.load("numba_cuda")
    monkeypatch.setattr(nc, "supports", lambda case: None)
    monkeypatch.setattr(nc, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_jax_varlen, "_where", lambda *xs: "cuda:0")
    B, Hq, Hkv, D, page = 3, 8, 2, 64, 16
    q = jnp.zeros((B, 1, Hq, D), jnp.bfloat16)
    kc = jnp.zeros((40, page, Hkv, D), jnp.bfloat16)
    kn = jnp.zeros((B, 2, Hkv, D), jnp.bfloat16)
    args = (q, kc, kc, jnp.zeros((B,), jnp.int32), kn, kn, jnp.zeros((B, 10), jnp.int32))

    def step(q, kc, vc, lengths, k, v, t):
        return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                block_table=t, causal=True)

    text = jax.jit(step, donate_argnums=(1, 2)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla_buffer_python_gpu_callback") == 1
    assert text.count("output_operand_alias<") == 2  # k_cache, v_cache
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text  # (o, kc, vc)
    assert "tensor<64x24x64xf32>" in text  # 64 splits of B*Hq*Nq = 24 rows

    tq, tk = jnp.zeros((50, Hq, D), jnp.float32), jnp.zeros((60, Hkv, D), jnp.float32)
    cq, ck = jnp.array([0, 20, 50], jnp.int32), jnp.array([0, 30, 60], jnp.int32)

    def loss(q, k, v, cq, ck):
        return jnp.sum(flashcore.attention_varlen(q, k, v, cq, ck, causal=True,
                                                  max_seqlen_q=30))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(tq, tk, tk, cq, ck).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla_buffer_python_gpu_callback") == 2
    assert "xla_python" not in text  # no host callback


def test_split_room():
    """Lent split-KV partials: num_splits (or 64) within 2^23 float32 words and the
    capacity."""
    from flashcore._case import Case, KVCache
    from flashcore._jax_varlen import _split_room

    def case(B, Hq, Nq, D, cap, splits):
        kv = KVCache(paged=False, page_size=cap, num_pages=B, pages_per_seq=1, n_new=0,
                     num_splits=splits)
        return Case(library="jax", device="cuda:0", dtype="bfloat16", batch=B, heads_q=Hq,
                    heads_kv=Hq, seqlen_q=Nq, seqlen_k=cap, head_dim=D, causal=False,
                    scale=1.0, layout="bnhd", kvcache=kv)

    assert _split_room(case(8, 32, 1, 128, 32768, 0)) == 64
    assert _split_room(case(8, 32, 1, 128, 32768, 5)) == 5
    assert _split_room(case(8, 32, 1, 128, 3, 0)) == 3
    assert _split_room(case(64, 32, 16, 128, 32768, 0)) == 1


# --- offline: the GPU callbacks under numba's CUDA simulator ----------------------------
#
# buffer_callback is replaced by a pure_callback that lends NumPy buffers (outputs NaN,
# aliased outputs holding a copy of their input, as XLA's copy gives them without
# donation) and the callbacks' view of a buffer by its simulator view: the callbacks'
# own code (checks on host reads, lent outputs in order, the shifted lengths, the split
# cap) runs as on a GPU, with the kernels on the simulator.

SIM = __import__("os").environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"


def _fake_buffer_callback(cb, types, *, vmap_method=None, input_output_aliases=None):
    from types import SimpleNamespace

    aliases = dict(input_output_aliases or {})

    def host(*ins):
        ins = [np.array(x) for x in ins]
        outs = [np.full(t.shape, np.nan, t.dtype) for t in types]
        for i, o in aliases.items():
            outs[o][...] = ins[i]
        cb(SimpleNamespace(stream=0), tuple(outs), *ins)
        return tuple(outs)

    return lambda *args: jax.pure_callback(host, tuple(types), *args,
                                           vmap_method=vmap_method)


@pytest.fixture
def simulated_gpu(monkeypatch):
    from flashcore.backends.numba_cuda import launch

    from flashcore import _jax_ops, _jax_varlen

    def view(x, keep):
        flat, strides = launch.host_flat(x.buf)
        keep.append(flat)
        return flat, strides[len(strides) - x.ndim_core:]

    monkeypatch.setattr(_jax_varlen, "_buffer_callback", lambda: _fake_buffer_callback)
    monkeypatch.setattr(_jax_varlen, "_where", lambda *xs: "cuda:0")
    monkeypatch.setattr(_jax_ops, "_xla_view", view)
    for f in (_jax_varlen._varlen_fn, _jax_varlen._kvcache_gpu_fn):
        f.cache_clear()
    yield _jax_varlen
    for f in (_jax_varlen._varlen_fn, _jax_varlen._kvcache_gpu_fn):
        f.cache_clear()


if not SIM:

    @pytest.mark.cudasim
    def test_callbacks_under_simulator(request):
        """Runs the cases below in a subprocess with the simulator on (CUDA-core family)."""
        run_under_simulator(request, __file__, "sim_", tensor_cores=False)

else:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
    def test_sim_varlen_forward_and_grad(jit, simulated_gpu, launches):
        rng = np.random.default_rng(5)
        q, k, v, cq, ck = packed(rng, [0, 9, 23], [7, 4, 23], Hq=4, Hkv=2, D=16,
                                 dtype="float32")
        do = rng.standard_normal(q.shape).astype(np.float32)
        ro, rl, *rg = oracle_varlen(q, k, v, cq, ck, do=do, causal=True)

        def fwd(a, b, c, x, y):
            return flashcore.attention_varlen(a, b, c, x, y, causal=True, return_lse=True)

        def loss(a, b, c, x, y):
            return jnp.sum(flashcore.attention_varlen(a, b, c, x, y, causal=True) * do)

        wrap = jax.jit if jit else (lambda f: f)
        args = tuple(jnp.asarray(x) for x in (q, k, v, cq, ck))
        o, lse = wrap(fwd)(*args)
        _check_o_lse("float32", o, lse, ro, rl)
        grads = wrap(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
            assert rel_err(host(g), r) < TOL_BWD["float32"], name
        assert launches.count("run_forward") == 2 and launches.count("run_backward") == 1

    @pytest.mark.cudasim
    @pytest.mark.parametrize("paged, nq, splits, room", [
        (True, 3, 3, 2), (False, 1, 1, None), (True, 1, 2, None)],
        ids=["paged-capped", "contiguous", "paged-split"])
    def test_sim_kvcache(paged, nq, splits, room, simulated_gpu, launches, monkeypatch):
        import test_kvcache as T

        if room is not None:  # lent partials for 2 splits: the plan keeps to them
            rows = T.B * T.HQ * nq
            monkeypatch.setattr(simulated_gpu, "_SPLIT_WORDS", room * rows * (T.D + 1))
        merged = []
        from flashcore.backends.numba_cuda import launch

        real_merge = launch.run_merge
        monkeypatch.setattr(launch, "run_merge",
                            lambda *a: merged.append(a[-1]) or real_merge(*a))
        kc, vc, table, q, k, v, want_k, want_v = T.inputs(2, paged, nq=nq, n_new=2,
                                                          dtype="float32")

        def step(q, kc, vc, lengths, k, v, t):
            return flashcore.attention_with_kvcache(
                q, kc, vc, cache_seqlens=lengths, k=k, v=v, block_table=t, causal=True,
                num_splits=splits, return_lse=True)

        jt = None if table is None else jnp.asarray(table)
        o, lse, new_k, new_v = jax.jit(step)(*(jnp.asarray(x) for x in (q, kc, vc, T.SEQLENS,
                                                                         k, v)), jt)
        assert np.array_equal(np.asarray(new_k), want_k)
        assert np.array_equal(np.asarray(new_v), want_v)
        ro, rl = oracle_kvcache(q, want_k, want_v, T.SEQLENS + 2, table, T.PAGE, causal=True)
        _check_o_lse("float32", o, lse, ro, rl)
        assert launches.count("run_append") == 1
        want_merge = {2: [2], 1: []}.get(room or splits, None)
        if want_merge is not None:
            assert merged == want_merge
        else:
            assert merged and merged[0] <= splits
