"""The Numba-CUDA backend on a real GPU (marked ``gpu``; skipped without one).

Matrix: dtypes, head dims 16..256, causal, GQA/MQA, both layouts, strided views, odd and
unequal lengths; torch, CuPy and JAX inputs; zero-copy checked by data pointer; non-default
streams; bitwise determinism; a 65536-long sequence whose extra memory stays O(N).
Every check draws fresh random inputs and compares with the float64 oracle.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, oracle_backward, oracle_forward, rel_err

pytestmark = pytest.mark.gpu
# JAX would otherwise take 75% of the GPU's memory on first use, starving torch's tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0"):
    pytest.skip("GPU tests do not run under the CUDA simulator", allow_module_level=True)

from flashcore.backends import numba_cuda

_REASON = numba_cuda.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"numba_cuda is unavailable: {_REASON}", allow_module_level=True)

from flashcore.backends.numba_cuda import launch

import flashcore

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA GPU", allow_module_level=True)

DEV = "cuda"
TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _t(shape, dtype, layout="bhnd", gen=None):
    """Random normal torch tensor given in bhnd order, returned in ``layout``."""
    x = torch.randn(shape, device=DEV, dtype=torch.float32, generator=gen).to(TDT[dtype])
    return x if layout == "bhnd" else x.transpose(1, 2).contiguous()


def _np(x):
    return x.detach().float().cpu().numpy().astype(np.float64) if x.dtype != torch.float32 \
        else x.detach().cpu().numpy().astype(np.float64)


def _check(q, k, v, do, dtype, causal, layout, backward=True):
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                         backend="numba_cuda")
    assert o.dtype == q.dtype and o.shape == q.shape and o.device == q.device
    assert lse.dtype == torch.float32
    qn, kn, vn = _np(q), _np(k), _np(v)
    ro, rl = oracle_forward(qn, kn, vn, causal=causal, layout=layout)
    e = rel_err(_np(o), ro)
    assert e < TOL_FWD[dtype], f"o: {e}"
    assert rel_err(lse.cpu().numpy(), rl) < 1e-5
    if not backward:
        return o, lse
    grads = flashcore.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout,
                                         backend="numba_cuda")
    refs = oracle_backward(_np(do), qn, kn, vn, causal=causal, layout=layout)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        e = rel_err(_np(g), r)
        assert e < TOL_BWD[dtype], f"{name}: {e}"
    return o, lse


def _qkvdo(B, Hq, Hkv, Nq, Nk, D, dtype, layout):
    return (_t((B, Hq, Nq, D), dtype, layout), _t((B, Hkv, Nk, D), dtype, layout),
            _t((B, Hkv, Nk, D), dtype, layout), _t((B, Hq, Nq, D), dtype, layout))


# --- the matrix ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_matrix(dtype, D, causal, heads, layout):
    Hq, Hkv = heads
    Nq, Nk = (197, 253) if layout == "bhnd" else (256, 131)
    _check(*_qkvdo(2, Hq, Hkv, Nq, Nk, D, dtype, layout), dtype, causal, layout)


@pytest.mark.parametrize("D,dtype,causal", [
    (16, "bfloat16", True), (32, "float16", True), (80, "bfloat16", True),
    (96, "float32", False), (160, "bfloat16", True), (192, "float16", False),
    (256, "bfloat16", True), (256, "float32", False)], ids=str)
def test_head_dims(D, dtype, causal):
    _check(*_qkvdo(1, 4, 2, 77, 131, D, dtype, "bnhd"), dtype, causal, "bnhd")


@pytest.mark.parametrize("Nq,Nk", [(2, 3), (1, 300), (300, 2), (65, 64), (64, 65),
                                   (130, 40)], ids=str)
def test_odd_lengths_causal(Nq, Nk):
    # (Nk = 1 would make dq and dk exactly zero: nothing to compare against)
    _check(*_qkvdo(1, 2, 1, Nq, Nk, 64, "float32", "bhnd"), "float32", True, "bhnd")


def test_strided_views():
    B, H, N, D = 2, 3, 150, 64
    big = [_t((B, H, 2 * N, D + 16), "float16") for _ in range(4)]
    q, k, v, do = (x[:, :, ::2, 8:8 + D] for x in big)  # row stride 2 (D + 16), offset 8
    assert not q.is_contiguous()
    _check(q, k, v, do, "float16", True, "bhnd")
    # head dim not the fastest axis: (B, H, D, N) storage seen as (B, H, N, D)
    q, k, v, do = (_t((B, H, D, N), "float32").transpose(2, 3) for _ in range(4))
    assert q.stride(3) == N
    _check(q, k, v, do, "float32", False, "bhnd")
    # fp32 rows: 16-byte aligned (offset 8) stream by cp.async; offset 1 goes through registers
    from flashcore.backends.numba_cuda import launch

    for off, aligned in ((8, True), (1, False)):
        big = [_t((B, H, 2 * N, D + 16), "float32") for _ in range(4)]
        q, k, v, do = (x[:, :, ::2, off:off + D] for x in big)
        _check(q, k, v, do, "float32", True, "bhnd")
        # (direction, D, dtype, causal, device, tiles, aligned, tensor cores, decode, the
        # wgmma forward, bulk tensor copies allowed (the call's size: tilings.TMA_MIN_WORK),
        # long keys (tilings.LONG_KEYS_MIN, with the copies), then the Variant's mask and
        # layout fields: window, softcap, alibi, user, packed)
        assert ("forward", D, "float32", True, 0, None, aligned, False, False, False, False,
                False, (), 0.0, False, None, "") in launch._PLANS
    # aligned rows of 16 words holding a head dim of 13: a partial 16-byte chunk per row
    q, k, v, do = (_t((B, H, N, 16), "float32")[..., :13] for _ in range(4))
    _check(q, k, v, do, "float32", True, "bhnd")


def test_rows_that_see_no_key_and_empty():
    q, k, v, do = _qkvdo(1, 2, 2, 100, 30, 64, "bfloat16", "bhnd")
    o, lse = _check(q, k, v, do, "bfloat16", True, "bhnd")
    assert torch.all(o[:, :, :70] == 0) and torch.all(torch.isneginf(lse[:, :, :70]))
    q, k, v, do = _qkvdo(1, 2, 2, 5, 0, 64, "float32", "bhnd")
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda")
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda")
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


# --- zero-copy, streams, determinism ------------------------------------------------------


class _Spy:
    """Records the buffers and stream of every launch (launch.run_*, which launches the
    tensor-core or the SIMT kernels), in call order."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("run_forward", "run_backward"):
            orig = getattr(launch, name)
            monkeypatch.setattr(launch, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        def spy(case, device, stream, *bufs, **kw):
            self.calls.append((name, stream, bufs))
            return orig(case, device, stream, *bufs, **kw)
        return spy


def _handles(bufs):
    return [b[0] if isinstance(b, tuple) else b for b in bufs]


def test_zero_copy_torch(monkeypatch):
    spy = _Spy(monkeypatch)
    q, k, v, do = _qkvdo(1, 4, 2, 64, 64, 64, "bfloat16", "bnhd")
    o, lse = flashcore.attention_forward(q, k, v, layout="bnhd", backend="numba_cuda")
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, layout="bnhd",
                                              backend="numba_cuda")
    (_, _, fb), (_, _, bb) = spy.calls
    assert _handles(fb) == [x.data_ptr() for x in (q, k, v, o, lse)]
    hb = _handles(bb)
    assert hb[:6] == [x.data_ptr() for x in (do, q, k, v, o, lse)]
    assert hb[7:] == [x.data_ptr() for x in (dq, dk, dv)]


def test_auto_selects_numba_cuda_for_torch_gpu_tensors():
    from flashcore import _dispatch
    from flashcore._checks import make_case

    q, k, v, _ = _qkvdo(1, 2, 2, 8, 8, 32, "float16", "bhnd")
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd")
    assert _dispatch.select(case, "auto") is numba_cuda


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lse_not_asked_for_goes_to_scratch(dtype):
    # flashcore.attention without return_lse: small calls write lse to the per-GPU scratch
    # buffer (no allocation, none returned); calls with more rows than it holds allocate
    from flashcore.backends.numba_cuda import adapters as _io

    from flashcore._checks import make_case

    for B, H, N in ((2, 3, 77), (1, 2, _io.SCRATCH_WORDS // 2 + 5)):
        q, k, v, _ = _qkvdo(B, H, H, N, 64 if N < 1000 else 300, 64, dtype, "bhnd")
        case = make_case(q, k, v, causal=True, scale=None, layout="bhnd")
        o, lse = numba_cuda.forward(q, k, v, case)
        assert (lse is None) == (B * H * N <= _io.SCRATCH_WORDS)
        o2 = flashcore.attention(q, k, v, causal=True)
        ro, _ = oracle_forward(_np(q), _np(k), _np(v), causal=True)
        for x in (o, o2):
            assert rel_err(_np(x), ro) < TOL_FWD[dtype]
        assert torch.equal(o, o2)


def test_torch_non_default_stream(monkeypatch):
    spy = _Spy(monkeypatch)
    s = torch.cuda.Stream()
    q0, k0, v0, do0 = _qkvdo(2, 4, 4, 512, 512, 64, "float32", "bhnd")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy: a kernel launched elsewhere
        q, k, v, do = (x * 1 for x in (q0, k0, v0, do0))  # would read unwritten memory
        o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
        dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                                  backend="numba_cuda")
    s.synchronize()
    assert {c[1] for c in spy.calls} == {s.cuda_stream}
    ro, _ = oracle_forward(_np(q0), _np(k0), _np(v0), causal=True)
    assert rel_err(_np(o), ro) < TOL_FWD["float32"]
    refs = oracle_backward(_np(do0), _np(q0), _np(k0), _np(v0), causal=True)
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(_np(g), r) < TOL_BWD["float32"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_bitwise(dtype):
    q, k, v, do = _qkvdo(2, 8, 2, 300, 300, 64, dtype, "bhnd")
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
    first = flashcore.attention_backward(do, q, k, v, o, lse, causal=True, backend="numba_cuda")
    for _ in range(3):
        o2, lse2 = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
        again = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                             backend="numba_cuda")
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# --- a long sequence: O(N) memory --------------------------------------------------------


def _oracle_chunked(q, k, v, do, causal, chunk=2048):
    """float64 forward and backward on the GPU, a block of query rows at a time
    (bhnd, one head: (N, D) matrices)."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    Nq, Nk = q.shape[0], k.shape[0]
    scale = 1 / math.sqrt(q.shape[1])
    o = torch.empty_like(q)
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    j = torch.arange(Nk, device=q.device)
    for i0 in range(0, Nq, chunk):
        i = torch.arange(i0, min(Nq, i0 + chunk), device=q.device)
        s = (q[i] @ k.T) * scale
        if causal:
            s = s.masked_fill(j[None, :] > i[:, None] + (Nk - Nq), -math.inf)
        p = torch.softmax(s, dim=1)
        o[i] = p @ v
        dp = do[i] @ v.T
        ds = p * (dp - (do[i] * o[i]).sum(1, keepdim=True))
        dq[i] = ds @ k * scale
        dk += ds.T @ q[i] * scale
        dv += p.T @ do[i]
    return o, dq, dk, dv


def test_long_sequence_memory_linear():
    N, D, dtype = 65536, 64, "bfloat16"
    q, k, v, do = _qkvdo(1, 1, 1, N, N, D, dtype, "bhnd")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
    torch.cuda.synchronize()
    fwd_extra = torch.cuda.max_memory_allocated() - base
    # exactly the outputs: o (N x D bf16) and lse (N fp32), in allocator granules
    assert fwd_extra <= o.numel() * 2 + N * 4 + 4 * 2**20, fwd_extra
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                              backend="numba_cuda")
    torch.cuda.synchronize()
    bwd_extra = torch.cuda.max_memory_allocated() - base
    # dq, dk, dv and the fp32 delta scratch: O(N D), never O(N^2)
    assert bwd_extra <= 3 * q.numel() * 2 + N * 4 + 8 * 2**20, bwd_extra
    ro, rdq, rdk, rdv = _oracle_chunked(q[0, 0], k[0, 0], v[0, 0], do[0, 0], causal=True)

    def err(x, r):
        return ((x.double() - r).norm() / r.norm()).item()

    assert err(o[0, 0], ro) < TOL_FWD[dtype]
    for g, r in zip((dq, dk, dv), (rdq, rdk, rdv)):
        assert err(g[0, 0], r) < TOL_BWD[dtype]


# --- CuPy and JAX -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cupy(dtype, monkeypatch):
    cupy = pytest.importorskip("cupy")
    spy = _Spy(monkeypatch)
    rng = np.random.default_rng(5)
    shapes = [(1, 33, 4, 80), (1, 47, 2, 80), (1, 47, 2, 80), (1, 33, 4, 80)]  # bnhd, GQA
    host = [rng.standard_normal(s).astype(dtype) for s in shapes]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        q, k, v, do = (cupy.asarray(x) for x in host)
        o, lse = flashcore.attention_forward(q, k, v, causal=True, layout="bnhd",
                                             backend="numba_cuda")
        dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                                  layout="bnhd", backend="numba_cuda")
    s.synchronize()
    assert isinstance(o, cupy.ndarray) and o.dtype == q.dtype
    assert _handles(spy.calls[0][2]) == [x.data.ptr for x in (q, k, v, o, lse)]
    assert {c[1] for c in spy.calls} == {s.ptr}
    ro, _ = oracle_forward(*host[:3], causal=True, layout="bnhd")
    assert rel_err(o.get(), ro) < TOL_FWD[dtype]
    refs = oracle_backward(host[3], *host[:3], causal=True, layout="bnhd")
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(g.get(), r) < TOL_BWD[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax(dtype, monkeypatch):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    spy = _Spy(monkeypatch)
    key = jax.random.split(jax.random.PRNGKey(3), 4)
    shapes = [(2, 4, 70, 64), (2, 2, 90, 64), (2, 2, 90, 64), (2, 4, 70, 64)]
    q, k, v, do = (jax.random.normal(kk, s, dtype=jnp.float32).astype(getattr(jnp, dtype))
                   for kk, s in zip(key, shapes))
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                              backend="numba_cuda")
    assert isinstance(o, jax.Array) and o.dtype == q.dtype
    ptrs = [x.unsafe_buffer_pointer() for x in (q, k, v, o, lse)]
    assert _handles(spy.calls[0][2]) == ptrs
    host = [np.asarray(x.astype(jnp.float32)) for x in (q, k, v, do)]
    ro, _ = oracle_forward(*host[:3], causal=True)
    assert rel_err(np.asarray(o.astype(jnp.float32)), ro) < TOL_FWD[dtype]
    refs = oracle_backward(host[3], *host[:3], causal=True)
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(np.asarray(g.astype(jnp.float32)), r) < TOL_BWD[dtype]


def test_numpy_explicit_copies_to_gpu_and_back():
    rng = np.random.default_rng(9)
    q, k, v, do = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(4))
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
    assert isinstance(o, np.ndarray)
    ro, _ = oracle_forward(q, k, v, causal=True)
    assert rel_err(o, ro) < TOL_FWD["float32"]
    dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                              backend="numba_cuda")
    refs = oracle_backward(do, q, k, v, causal=True)
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(g, r) < TOL_BWD["float32"]


# --- a second GPU ---------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_gpu_torch(dtype, monkeypatch):
    """Inputs on cuda:1 while cuda:0 is current: kernels load and launch on device 1, on its
    current stream, and the outputs live there (SIMT for float32, tensor cores for bf16)."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator(device="cuda:1").manual_seed(11)
    shape = (2, 4, 200, 64)
    q, k, v, do = (torch.randn(shape, device="cuda:1", generator=gen).to(TDT[dtype])
                   for _ in range(4))
    s1 = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.device(0), torch.cuda.stream(s1):
        o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda")
        dq, dk, dv = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                                  backend="numba_cuda")
    s1.synchronize()
    assert {x.device for x in (o, lse, dq, dk, dv)} == {torch.device("cuda:1")}
    assert {c[1] for c in spy.calls} == {s1.cuda_stream}
    ro, _ = oracle_forward(_np(q), _np(k), _np(v), causal=True)
    assert rel_err(_np(o), ro) < TOL_FWD[dtype]
    refs = oracle_backward(_np(do), _np(q), _np(k), _np(v), causal=True)
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(_np(g), r) < TOL_BWD[dtype]
    # device 0 still works in the same process afterwards
    o0, _ = flashcore.attention_forward(q.to("cuda:0"), k.to("cuda:0"), v.to("cuda:0"),
                                        causal=True, backend="numba_cuda")
    assert o0.device == torch.device("cuda:0")
    assert rel_err(_np(o0), ro) < TOL_FWD[dtype]


@two_gpus
def test_second_gpu_cupy_and_jax():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(12)
    host = [rng.standard_normal((1, 2, 130, 64)).astype(np.float32) for _ in range(3)]
    ro, _ = oracle_forward(*host)
    with cupy.cuda.Device(1):
        q, k, v = (cupy.asarray(x) for x in host)
    o, _ = flashcore.attention_forward(q, k, v, backend="numba_cuda")  # device 0 current
    assert o.device.id == 1
    assert rel_err(o.get(), ro) < TOL_FWD["float32"]
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("JAX sees fewer than two GPUs")
    jq, jk, jv = (jax.device_put(x, gpus[1]) for x in host)
    jo = flashcore.attention(jq, jk, jv)
    assert jo.devices() == {gpus[1]}
    assert rel_err(np.asarray(jo), ro) < TOL_FWD["float32"]
    jo2 = jax.jit(flashcore.attention)(jq, jk, jv)  # XLA's stream on device 1
    assert rel_err(np.asarray(jo2), ro) < TOL_FWD["float32"]


_LOAD_SCRIPT = """
import json
from flashcore.backends.numba_cuda import launch
out = []
for v in launch.case_variants(32, "bfloat16", True, launch.device_cc(0))[:1] + \\
        launch.tc_variants(32, "bfloat16", True, launch.device_cc(0))[:1]:
    d = launch.kernel(v, 0)._dispatcher
    out.append([v.tag, sum(d._cache_hits.values()), sum(d._cache_misses.values())])
print(json.dumps(out))
"""


def test_a_second_process_loads_the_kernels_from_the_disk_cache(tmp_path):
    """A new process finds on disk the kernels another compiled (driver.VariantCache):
    numba's own key hashed a per-process pickle of each kernel's closure, so every process
    compiled every variant again."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], env=env,
                                      capture_output=True, text=True, check=True,
                                      timeout=600).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert [(t, h) for t, h, _ in runs[0]] == [(t, 0) for t, _, _ in runs[0]]  # compiled
    assert [(t, h, m) for t, h, m in runs[1]] == [(t, 1, 0) for t, _, _ in runs[0]], runs
