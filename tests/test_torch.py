"""PyTorch: autograd through flashcore's kernels, torch.compile, opcheck, gradcheck, the
"torch" (SDPA) backend's semantics, mixed-library errors, and CUDA streams/devices (gpu)."""
from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

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
from flashcore import _dispatch, _torch_ops
from flashcore._case import Case

pytestmark = pytest.mark.torch

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (Nq, Nk, Hq, Hkv): square, Nq < Nk, Nq > Nk (causal: leading rows see no key), GQA, MQA
SHAPES = [(16, 16, 2, 2), (9, 23, 4, 2), (21, 8, 3, 1)]
SHAPE_IDS = ["square", "nq<nk-gqa", "nq>nk-mqa"]


def t(x, device="cpu", grad=False):
    """A torch tensor sharing x's values (bfloat16 through its bits)."""
    if x.dtype.name == "bfloat16":
        out = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.ascontiguousarray(x))
    return out.to(device).requires_grad_(grad)


def host(x):
    x = x.detach().cpu()
    return x.double().numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _check_grads(rng, backend, dtype, layout, causal, shape, device="cpu"):
    Nq, Nk, Hq, Hkv = shape
    q, k, v = qkv(rng, B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, dtype=dtype, layout=layout)
    do = rand(rng, q.shape, dtype)
    opts = {"causal": causal, "layout": layout}
    tq, tk, tv = (t(x, device, grad=True) for x in (q, k, v))
    o = flashcore.attention(tq, tk, tv, backend=backend, **opts)
    assert o.requires_grad and o.shape == tq.shape and o.dtype == tq.dtype
    o.backward(t(do, device))
    ro, _ = oracle_forward(q, k, v, **opts)
    assert rel_err(host(o), ro) <= TOL_FWD[dtype]
    for g, r in zip((tq.grad, tk.grad, tv.grad), oracle_backward(do, q, k, v, **opts)):
        assert rel_err(host(g), r) <= TOL_BWD[dtype]


# --- autograd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_backward_matches_reference(backend, layout, causal, shape):
    _check_grads(np.random.default_rng(1), backend, "float32", layout, causal, shape)


@pytest.mark.parametrize("dtype", ["bfloat16"])  # float16 shares the path (and costs a compile)
def test_backward_low_precision(dtype):
    _check_grads(np.random.default_rng(2), "auto", dtype, "bhnd", True, SHAPES[1])


def test_custom_op_glue_with_reference_backend():
    """The custom op + autograd registration, independent of which kernel serves them."""
    _check_grads(np.random.default_rng(3), "reference", "float32", "bnhd", True, SHAPES[2])


def test_autograd_grad_and_lse_is_not_differentiable():
    rng = np.random.default_rng(4)
    q, k, v = (t(x, grad=True) for x in qkv(rng, Nq=8, D=8))
    o, lse = flashcore.attention(q, k, v, return_lse=True)
    assert o.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    dq, = torch.autograd.grad(o.sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all()


def test_no_grad_takes_the_plain_path():
    rng = np.random.default_rng(5)
    q, k, v = (t(x, grad=True) for x in qkv(rng, Nq=8, D=8))
    assert _torch_ops.wants(q, k, v)
    with torch.no_grad():
        assert not _torch_ops.wants(q, k, v)
        o = flashcore.attention(q, k, v)
    assert not o.requires_grad


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    rng = np.random.default_rng(6)
    q, k, v = (t(x, grad=True) for x in qkv(rng, B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=4,
                                             dtype="float64"))
    assert torch.autograd.gradcheck(
        lambda a, b, c: flashcore.attention(a, b, c, causal=causal), (q, k, v))


def test_empty_rows_get_zero_gradients():
    rng = np.random.default_rng(7)
    q, k, v = (t(x, grad=True) for x in qkv(rng, Nq=12, Nk=5, D=8))
    o, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(o[:, :, :7] == 0) and torch.all(lse[:, :, :7] == -math.inf)
    o.sum().backward()
    assert torch.all(q.grad[:, :, :7] == 0) and torch.isfinite(q.grad).all()


def test_autograd_falls_back_to_a_backend_without_lse(monkeypatch):
    """As torch SDPA in float64 on CUDA: no lse, but forward and backward all the same."""
    from flashcore.backends import numba_cpu, torch_sdpa

    from flashcore import reference

    monkeypatch.setattr(numba_cpu, "supports", lambda case: "declined for this test")
    monkeypatch.setattr(reference, "AUTO_MAX_SCORES", 0)  # auto declines it; named, it serves
    monkeypatch.setattr(torch_sdpa, "_lse_unavailable", lambda case: "no lse in this test")
    _check_grads(np.random.default_rng(19), "auto", "float32", "bnhd", True, SHAPES[1])
    q, k, v = (t(x, grad=True) for x in qkv(np.random.default_rng(20)))
    with pytest.raises(flashcore.BackendUnavailableError, match="no lse in this test"):
        flashcore.attention(q, k, v, return_lse=True)


# --- opcheck, compile -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("layout,causal,shape", [("bhnd", True, SHAPES[1]),
                                                 ("bnhd", False, SHAPES[2])])
def test_opcheck(backend, layout, causal, shape):
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(8)
    q, k, v = (t(x, grad=True) for x in qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=8,
                                             layout=layout))
    args = (q, k, v, causal, 0.3, layout, backend, -1, [])
    torch.library.opcheck(_torch_ops.attention_forward_op, args)
    with torch.no_grad():
        o, lse = _torch_ops.attention_forward_op(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(_torch_ops.attention_backward_op,
                          (do, q.detach(), k.detach(), v.detach(), o, lse, causal, 0.3, layout,
                           backend, -1, []))


class _Block(torch.nn.Module):
    def __init__(self, d=16, heads=2, backend="auto"):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.heads, self.backend = heads, backend

    def forward(self, x):
        B, N, d = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, d // self.heads).unbind(2)
        o = flashcore.attention(q, k, v, causal=True, layout="bnhd", backend=self.backend)
        return o.reshape(B, N, d).square().sum()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_fullgraph_forward_and_backward(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _Block(backend=backend)
    x = torch.randn(2, 12, 16)
    loss = model(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    closs = compiled(x)
    cgrads = torch.autograd.grad(closs, list(model.parameters()))
    assert rel_err(closs.detach().numpy(), loss.detach().numpy()) <= TOL_FWD["float32"]
    for a, b in zip(cgrads, grads):
        assert rel_err(a.numpy(), b.numpy()) <= TOL_BWD["float32"]


def test_compile_dynamic_shapes_without_grad():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flashcore.attention(q, k, v, causal=True),
                      fullgraph=True, dynamic=True)
    rng = np.random.default_rng(9)
    for n in (8, 13):
        q, k, v = qkv(rng, Nq=n, Nk=n + 3, D=8)
        o = f(t(q), t(k), t(v))
        assert rel_err(o.numpy(), oracle_forward(q, k, v, causal=True)[0]) <= TOL_FWD["float32"]


# --- the "torch" backend ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES + [(6, 0, 2, 1), (0, 5, 2, 2)],
                         ids=SHAPE_IDS + ["nk=0", "nq=0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_torch_backend_forward(layout, causal, shape, dtype):
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, dtype=dtype, layout=layout)
    opts = {"causal": causal, "layout": layout}
    o, lse = flashcore.attention_forward(t(q), t(k), t(v), backend="torch", **opts)
    o2 = flashcore.attention(t(q), t(k), t(v), backend="torch", **opts)
    ro, rlse = oracle_forward(q, k, v, **opts)
    lse_dtype = torch.float64 if dtype == "float64" else torch.float32
    assert o.dtype == t(q).dtype and lse.dtype == lse_dtype and lse.shape == rlse.shape
    assert rel_err(host(o), ro) <= TOL_FWD[dtype]
    assert rel_err(host(o2), ro) <= TOL_FWD[dtype]
    assert rel_err(lse.numpy(), rlse) <= TOL_FWD["float64" if dtype == "float64" else "float32"]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_backend_backward(causal, shape):
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, layout="bnhd")
    do = rand(rng, q.shape)
    opts = {"causal": causal, "layout": "bnhd"}
    o, lse = flashcore.attention_forward(t(q), t(k), t(v), backend="torch", **opts)
    grads = flashcore.attention_backward(t(do), t(q), t(k), t(v), o, lse, backend="torch", **opts)
    for g, r in zip(grads, oracle_backward(do, q, k, v, **opts)):
        assert rel_err(g.numpy(), r) <= TOL_BWD["float32"]


def _case(**kw):
    base = {"library": "torch", "device": "cpu", "dtype": "float32", "batch": 1,
            "heads_q": 2, "heads_kv": 2, "seqlen_q": 4, "seqlen_k": 4, "head_dim": 8,
            "causal": False, "scale": 0.3, "layout": "bhnd"}
    return Case(**{**base, **kw})


def test_torch_backend_declines_other_libraries_and_lse_it_cannot_give():
    mod = _dispatch.load("torch")
    assert "PyTorch" in mod.supports(_case(library="numpy"))
    assert mod.supports(_case()) is None
    assert "float64" in mod.supports(_case(device="cuda:0", dtype="float64", need_lse=True))
    assert mod.supports(_case(device="mps:0", need_lse=False)) is None
    assert "lse" in mod.supports(_case(device="mps:0", need_lse=True))
    # Named explicitly too: one rule for every backend (the reason reaches the user as a
    # BackendUnavailableError, see the test below); forward() called directly says so too.
    case = _case(device="mps:0", need_lse=True, explicit=True)
    assert "lse" in mod.supports(case)
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(flashcore.BackendUnavailableError, match="lse"):
        mod.forward(x, x, x, case)


def test_named_torch_backend_without_lse_raises_backend_unavailable(monkeypatch):
    from flashcore.backends import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "_lse_unavailable", lambda case: "no lse in this test")
    q, k, v = (t(x, grad=True) for x in qkv(np.random.default_rng(21)))
    for call in (lambda: flashcore.attention_forward(q, k, v, backend="torch"),
                 lambda: flashcore.attention(q, k, v, backend="torch", return_lse=True)):
        with pytest.raises(flashcore.BackendUnavailableError, match="no lse in this test"):
            call()
    o = flashcore.attention(q, k, v, backend="torch", causal=True)  # lse only a residual
    o.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_torch_backend_is_not_picked_for_numpy():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng)
    with pytest.raises(flashcore.BackendUnavailableError, match="PyTorch"):
        flashcore.attention(q, k, v, backend="torch")


# --- bad input ----------------------------------------------------------------------------------


def test_mixed_libraries_raise():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="one library"):
        flashcore.attention(t(q, grad=True), k, t(v))
    tq, tk, tv = t(q), t(k), t(v)
    o, lse = flashcore.attention_forward(tq, tk, tv)
    with pytest.raises(TypeError, match="one library"):
        flashcore.attention_backward(q, tq, tk, tv, o, lse)


def test_bad_input_raises_under_autograd():
    rng = np.random.default_rng(14)
    q, k, v = (t(x, grad=True) for x in qkv(rng, Hq=3, Hkv=2))
    with pytest.raises(ValueError, match="multiple"):
        flashcore.attention(q, k, v)
    with pytest.raises(ValueError, match="layout"):
        flashcore.attention(q, q, q, layout="nhbd")
    with pytest.raises(ValueError, match="scale"):
        flashcore.attention(q, q, q, scale=-1.0)
    with pytest.raises(TypeError, match="causal"):
        flashcore.attention(q, q, q, causal=[True])  # unhashable: past the plan cache
    with pytest.raises(TypeError, match="causal"):
        flashcore.attention(q, q, q, causal="yes")


# --- CUDA (run on a GPU machine) ------------------------------------------------------------


class _Recorder:
    """Wraps the selected backend and records the data pointers it saw and returned."""

    def __init__(self, monkeypatch):
        self.seen, self.made = [], []
        real = _dispatch.select

        def select(case, backend):
            impl = real(case, backend)
            rec = self

            class Wrapped:
                NAME = impl.NAME

                @staticmethod
                def forward(q, k, v, c):
                    rec.seen += [x.data_ptr() for x in (q, k, v)]
                    out = impl.forward(q, k, v, c)
                    rec.made += [x.data_ptr() for x in out]
                    return out

                @staticmethod
                def backward(*args):
                    rec.seen += [x.data_ptr() for x in args[:6]]
                    out = impl.backward(*args)
                    rec.made += [x.data_ptr() for x in out]
                    rec.weak = [weakref.ref(x) for x in out]
                    return out

            return Wrapped

        monkeypatch.setattr(_dispatch, "select", select)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_zero_copy_by_data_pointer(monkeypatch, device):
    rec = _Recorder(monkeypatch)
    rng = np.random.default_rng(15)
    q, k, v = (t(x, device, grad=True) for x in qkv(rng, Nq=16, D=16, layout="bnhd"))
    o = flashcore.attention(q, k, v, layout="bnhd")
    assert rec.seen == [x.data_ptr() for x in (q, k, v)]
    assert rec.made[0] == o.data_ptr()
    # (diagnosis of a failure seen now and then on a GPU, never outside pytest: who else
    # held the backend's dq when autograd copied it instead of keeping it)
    holders = []

    def who(p):
        dq = rec.weak[0]()
        if dq is not None and p.grad.data_ptr() != dq.data_ptr():
            holders.extend(_referrers(dq))

    q.register_post_accumulate_grad_hook(who)
    o.sum().backward()
    assert rec.seen[4:7] == [x.data_ptr() for x in (q, k, v)]
    assert rec.made[-3:] == [x.grad.data_ptr() for x in (q, k, v)], \
        f"autograd copied the backend's gradients; dq was held by {holders}"


def _referrers(obj):
    """Short descriptions of what refers to ``obj`` (frames by code location), one level
    into containers."""
    out = []
    for r in gc.get_referrers(obj):
        kind = type(r).__name__
        if kind == "frame":
            out.append(f"frame {r.f_code.co_filename}:{r.f_lineno} {r.f_code.co_name}")
        elif isinstance(r, (dict, list, tuple)):
            inner = [type(x).__name__ if type(x).__name__ != "frame" else
                     f"frame {x.f_code.co_name}" for x in gc.get_referrers(r)][:4]
            out.append(f"{kind} of {len(r)} <- {inner}")
        else:
            out.append(kind)
    return out


@pytest.mark.gpu
@gpu
def test_mixed_devices_raise():
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="one device"):
        flashcore.attention(t(q, "cuda", grad=True), t(k), t(v, "cuda"))
    tq, tk, tv = (t(x, "cuda") for x in (q, k, v))
    o, lse = flashcore.attention_forward(tq, tk, tv)
    with pytest.raises(ValueError, match="one device"):
        flashcore.attention_backward(t(q), tq, tk, tv, o, lse)


@pytest.mark.gpu
@gpu
def test_cuda_backward_matches_reference():
    _check_grads(np.random.default_rng(16), "auto", "bfloat16", "bnhd", True, SHAPES[1], "cuda")
    _check_grads(np.random.default_rng(16), "torch", "float16", "bhnd", True, SHAPES[2], "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout,causal,shape,D", [
    ("bhnd", True, SHAPES[1], 20), ("bnhd", True, SHAPES[2], 64), ("bnhd", False, SHAPES[0], 8)])
def test_cuda_torch_backend_with_lse(dtype, layout, causal, shape, D):
    """The aten kernels that return lse on CUDA (flash for 16-bit, mem-efficient for fp32)."""
    Nq, Nk, Hq, Hkv = shape
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, dtype=dtype, layout=layout)
    do = rand(rng, q.shape, dtype)
    opts = {"causal": causal, "layout": layout}
    tq, tk, tv, tdo = (t(x, "cuda") for x in (q, k, v, do))
    o, lse = flashcore.attention_forward(tq, tk, tv, backend="torch", **opts)
    ro, rlse = oracle_forward(q, k, v, **opts)
    assert rel_err(host(o), ro) <= TOL_FWD[dtype]
    assert rel_err(host(lse), rlse) <= TOL_FWD["float32"]
    grads = flashcore.attention_backward(tdo, tq, tk, tv, o, lse, backend="torch", **opts)
    for g, r in zip(grads, oracle_backward(do, q, k, v, **opts)):
        assert rel_err(host(g), r) <= TOL_BWD[dtype]


@pytest.mark.gpu
@gpu
def test_cuda_torch_backend_float64_lse_is_unavailable():
    q, k, v = (t(x, "cuda") for x in qkv(np.random.default_rng(23), dtype="float64"))
    with pytest.raises(flashcore.BackendUnavailableError, match="float64"):
        flashcore.attention_forward(q, k, v, backend="torch")
    o = flashcore.attention(q, k, v, backend="torch", causal=True)  # no lse needed: fine
    assert rel_err(host(o), oracle_forward(*(host(x) for x in (q, k, v)), causal=True)[0]) \
        <= TOL_FWD["float64"]


@pytest.mark.gpu
@gpu
def test_cuda_runs_on_the_current_stream():
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, B=4, Hq=8, Nq=1024, D=64)
    ro = oracle_forward(q[:1, :1], k[:1, :1], v[:1, :1])[0]
    w = torch.eye(64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        # q is produced on s by queued work: a kernel on another stream would race with it.
        tq = t(q, "cuda").requires_grad_(True)
        tq2 = tq
        for _ in range(50):
            tq2 = tq2 @ w
        o = flashcore.attention(tq2, t(k, "cuda"), t(v, "cuda"))
        o.sum().backward()
    s.synchronize()
    assert rel_err(host(o[:1, :1]), ro) <= TOL_FWD["float32"]
    assert torch.isfinite(tq.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_second_device():
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, Nq=64, D=32)
    tq, tk, tv = (t(x, "cuda:1", grad=True) for x in (q, k, v))
    with torch.cuda.device(0):
        o = flashcore.attention(tq, tk, tv, causal=True)
        o.sum().backward()
    assert o.device == tq.device and tq.grad.device == tq.device
    assert rel_err(host(o), oracle_forward(q, k, v, causal=True)[0]) <= TOL_FWD["float32"]


@pytest.mark.gpu
@gpu
def test_cuda_compile_fullgraph():
    torch._dynamo.reset()
    model = _Block().cuda()
    x = torch.randn(2, 64, 16, device="cuda")
    loss = model(x)
    closs = torch.compile(model, fullgraph=True)(x)
    assert rel_err(closs.detach().cpu().numpy(), loss.detach().cpu().numpy()) <= 1e-4


def test_functional_api_under_compile_fullgraph():
    """attention_forward / attention_backward trace as the custom ops, no graph break."""
    rng = np.random.default_rng()
    q, k, v = (torch.from_numpy(x) for x in qkv(rng, Hq=4, Hkv=2, Nq=33, Nk=40, D=16))
    do = torch.from_numpy(rand(rng, (1, 4, 33, 16)))

    def step(q, k, v, do):
        o, lse = flashcore.attention_forward(q, k, v, causal=True)
        return (o, lse, *flashcore.attention_backward(do, q, k, v, o, lse, causal=True))

    o, lse, dq, dk, dv = torch.compile(step, fullgraph=True)(q, k, v, do)
    ro, rlse = oracle_forward(q.numpy(), k.numpy(), v.numpy(), causal=True)
    assert rel_err(o.numpy(), ro) <= TOL_FWD["float32"]
    assert rel_err(lse.numpy(), rlse) <= 1e-6
    refs = oracle_backward(do.numpy(), q.numpy(), k.numpy(), v.numpy(), causal=True)
    for g, r in zip((dq, dk, dv), refs):
        assert rel_err(g.numpy(), r) <= TOL_BWD["float32"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "numba_cpu", "torch"])
def test_nan_reaches_exactly_the_rows_that_see_it(backend, shape, causal, request):
    if backend == "torch" and causal and shape[0] < shape[1]:
        # torch's CPU kernels take the bottom-right mask as an additive -inf bias, and
        # NaN + -inf is NaN: a NaN key reaches rows that do not see it.
        request.applymarker(pytest.mark.xfail(reason="SDPA's additive mask on the CPU",
                                              strict=True))
    q, k, v, bad = nan_inputs(np.random.default_rng(), *shape, causal)
    o, lse = flashcore.attention_forward(t(q), t(k), t(v), causal=causal, backend=backend)
    assert_nan_rows(o.numpy(), lse.numpy(), bad)
