"""The sliding window, the softcap and ALiBi in the CUDA kernels (SIMT and tensor-core; forward, dK/dV, dQ): under
numba's CUDA simulator on small shapes, compiled to PTX for sm_90 without a GPU, and on a
GPU, each against the float64 reference with the same window.

A windowed variant starts its key loop at the window's first tile and ends its query loop
at the window's last row (device/seams.py, window_key_range / window_query_range); tiles at
both edges take the per-element mask. The simulator cases put several tiles on each side
of the window (SIMT tiles are 4 x 8 rows there, tensor-core tiles 16 x 16).
"""
from __future__ import annotations

import importlib.util
import os
import zlib

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, qkv, rand, rel_err, run_under_simulator

import flashcore

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
pytestmark = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")

# (B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout, window; softcap; alibi: slopes of shape
# "h" (Hq,) or "bh" (B, Hq))
SIMT_CASES = [
    dict(B=1, Hq=2, Hkv=1, Nq=13, Nk=19, D=8, dtype="float32", causal=True, layout="bhnd",
         window=(5, None), softcap=0.7),
    dict(B=1, Hq=2, Hkv=1, Nq=11, Nk=9, D=16, dtype="float32", causal=False, layout="bhnd",
         window=None, softcap=1.3, alibi="h"),
    dict(B=1, Hq=2, Hkv=2, Nq=12, Nk=12, D=16, dtype="float32", causal=False, layout="bnhd",
         window=(3, 2)),
    dict(B=2, Hq=2, Hkv=1, Nq=9, Nk=14, D=4, dtype="float16", causal=False, layout="bhnd",
         window=(None, 1), alibi="bh"),
]
TC_CASES = [
    dict(B=1, Hq=2, Hkv=1, Nq=40, Nk=52, D=64, dtype="bfloat16", causal=True, layout="bhnd",
         window=(17, 0), softcap=0.9),
    dict(B=1, Hq=1, Hkv=1, Nq=37, Nk=37, D=64, dtype="float16", causal=False, layout="bnhd",
         window=(9, 20)),
    dict(B=2, Hq=2, Hkv=1, Nq=40, Nk=45, D=32, dtype="bfloat16", causal=True, layout="bnhd",
         window=None, softcap=1.1, alibi="bh"),
    # ALiBi without a mask: key tiles wholly left of the rows' diagonal (i' = i + 50), across
    # it, and wholly right of it (the forward's linear bias on each side, |.| across)
    dict(B=1, Hq=2, Hkv=1, Nq=40, Nk=90, D=32, dtype="float16", causal=False, layout="bhnd",
         window=None, alibi="h"),
]


def _case_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", "")


def _inputs(c):
    rng = np.random.default_rng(zlib.crc32(_case_id(c).encode()))
    q, k, v = qkv(rng, B=c["B"], Hq=c["Hq"], Hkv=c["Hkv"], Nq=c["Nq"], Nk=c["Nk"], D=c["D"],
                  dtype=c["dtype"], layout=c["layout"])
    do = rand(rng, (c["B"], c["Hq"], c["Nq"], c["D"]), c["dtype"], c["layout"])
    return q, k, v, do


def _slopes(c):
    """ALiBi slopes of the case (float32; the geometric slopes of the ALiBi paper, one per
    head, times 1 + b / 4 per batch for "bh"), or None."""
    if c.get("alibi") is None:
        return None
    h = 2.0 ** (-8.0 * np.arange(1, c["Hq"] + 1) / c["Hq"])
    if c["alibi"] == "h":
        return h.astype(np.float32)
    return (h[None, :] * (1 + np.arange(c["B"])[:, None] / 4)).astype(np.float32)


def _opts(c, slopes=None):
    return dict(causal=c["causal"], layout=c["layout"], window=c["window"],
                softcap=c.get("softcap"), alibi_slopes=_slopes(c) if slopes is None else slopes)


def _reference(q, k, v, do, c):
    """float64 o, lse and gradients of the reference on float64 copies of the inputs."""
    x64 = [np.asarray(x, dtype=np.float64) for x in (q, k, v, do)]
    o, lse = flashcore.attention_forward(*x64[:3], backend="reference", **_opts(c))
    grads = flashcore.attention_backward(x64[3], *x64[:3], o, lse, backend="reference",
                                         **_opts(c))
    return o, lse, grads


def _check(q, k, v, do, c, o, lse, grads):
    ro, rl, rg = _reference(q, k, v, do, c)
    assert rel_err(o, ro) < TOL_FWD[c["dtype"]], rel_err(o, ro)
    fin = np.isfinite(rl)
    lse = np.asarray(lse)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - rl[fin]).max() < 1e-4
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        e = rel_err(g, r)
        assert e < TOL_BWD[c["dtype"]], f"{name}: {e}"


if not SIM:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("family", ["simt", "tensor_core"])
    def test_window_under_simulator(family, request):
        """Runs the cases below in a subprocess with the simulator on."""
        run_under_simulator(request, __file__, f"sim_{family}",
                            tensor_cores=family != "simt")

else:
    # (marked cudasim so that ``nox -s tests-cudasim``, which runs with the simulator on,
    # selects them; each sets the tensor-core switch as the subprocess above does)
    pytestmark = [pytestmark, pytest.mark.cudasim]

    @pytest.mark.parametrize("c", SIMT_CASES, ids=_case_id)
    def test_sim_simt(c, monkeypatch):
        from flashcore.backends.numba_cuda import launch

        monkeypatch.setenv(launch.TC_ENV, "0")
        q, k, v, do = _inputs(c)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c))
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                             **_opts(c))
        _check(q, k, v, do, c, o, lse, grads)

    @pytest.mark.parametrize("c", TC_CASES, ids=_case_id)
    def test_sim_tensor_core(c, monkeypatch):
        from flashcore.backends.numba_cuda import launch

        monkeypatch.setenv(launch.TC_ENV, "1")
        served = []
        real = launch._serves  # (what each call takes, kept per kind of call or not)
        monkeypatch.setattr(launch, "_serves",
                            lambda *a: served.append(real(*a)[0]) or real(*a))
        q, k, v, do = _inputs(c)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c))
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                             **_opts(c))
        assert served == [True, True]
        _check(q, k, v, do, c, o, lse, grads)


def test_numba_cuda_takes_window_softcap_alibi(monkeypatch):
    """numba_cuda serves a window, a softcap and ALiBi (on any host: the GPU's
    availability is taken as given)."""
    from flashcore import _dispatch
    from flashcore._checks import make_case

    q = np.zeros((1, 2, 8, 16), np.float32)
    impl = _dispatch.load("numba_cuda")
    monkeypatch.setattr(impl, "unavailable_reason", lambda: None)
    monkeypatch.setattr(impl, "_device_reason", lambda device: None)
    case = make_case(q, q, q, causal=False, scale=None, layout="bhnd", explicit=True,
                     options={"window": (2, 2), "softcap": None, "alibi_slopes": None,
                              "score_mod": None, "mask_mod": None, "mod_args": (),
                              "block_mask": None})
    assert impl.supports(case) is None
    case = make_case(q, q, q, causal=False, scale=None, layout="bhnd", explicit=True,
                     options={"window": (2, 2), "softcap": 3.0,
                              "alibi_slopes": np.ones(2, np.float32), "score_mod": None,
                              "mask_mod": None, "mod_args": (), "block_mask": None})
    assert impl.supports(case) is None
    # (score_mod / mask_mod: tests/test_numba_cuda_mods.py)


def _ptx(v, cc, monkeypatch):
    """PTX of variant ``v`` for ``cc`` without a GPU (as tests/test_numba_cuda_ptx.py)."""
    import types as pytypes

    import numba.cuda.dispatcher as nd
    from flashcore.backends.numba_cuda import driver, launch
    from numba import cuda

    monkeypatch.setattr(nd, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=cc))
    ptx, _ = cuda.compile_ptx(launch.build(v), launch.signature(v.entry, v.dtype), cc=cc,
                              fastmath=driver.FASTMATH, **driver.jit_options(v.launch_bounds))
    return ptx


@pytest.mark.skipif(SIM, reason="compiles PTX for a real architecture")
@pytest.mark.parametrize("dtype,head_dim,mask", [
    ("float32", 64, dict(window=(64, 0), softcap=30.0)),
    pytest.param("float32", 64, dict(window=(64, 0), alibi=True), marks=pytest.mark.slow),
    ("bfloat16", 128, dict(window=(64, 0), softcap=30.0, alibi=True))])
def test_window_variants_compile_to_ptx(dtype, head_dim, mask, monkeypatch):
    """Every kernel of a case class with a window and a softcap or ALiBi compiles for sm_90
    without a GPU, keeps its register tiles out of local memory (SIMT), and the tensor-core
    dK/dV kernel (the one nearest its register limit) spills at most 16 bytes more than
    without them (ptxas, where installed; measured at D=128 bf16 causal: 12 bytes plain,
    12 with all three). (The SIMT fp32 dK/dV kernel with all three at D=64 puts its score tile in local
    memory: LLVM stops unrolling its loops there.)"""
    import re
    from dataclasses import replace

    from flashcore.backends.numba_cuda import launch, tilings
    from test_numba_cuda_mma import ptxas_report

    cc = (9, 0)
    if dtype == "float32":
        kt = tilings.choose_simt(head_dim, dtype, True, cc)
        variants = launch.simt_variants(head_dim, dtype, True, kt, **mask)
    else:
        variants = launch.tc_variants(head_dim, dtype, True, cc, **mask)
    for v in variants:
        if v.kernel == "preprocess":
            continue
        assert "_w64_0" in v.tag and ("_sc30" in v.tag) == ("softcap" in mask)
        assert ("_alibi" in v.tag) == ("alibi" in mask)
        ptx = _ptx(v, cc, monkeypatch)
        entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
        assert len(re.findall(r"\.param\s+\.(\w+)", entry.group(1))) == len(
            launch.signature(v.entry, v.dtype))
        if v.family == "simt":
            assert "ld.local" not in ptx and "st.local" not in ptx, v.tag
        if v.family == "tensor_core" and v.kernel == "dkdv":
            spills = []
            for w in (ptx, _ptx(replace(v, window=(), softcap=0.0, alibi=False), cc,
                                monkeypatch)):
                report = ptxas_report(w, cc)
                if report is None:
                    break
                spills.append(int(re.search(r"(\d+) bytes spill stores", report).group(1)))
            assert not spills or spills[0] <= spills[1] + 16, (v.tag, spills)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [
    dict(B=2, Hq=4, Hkv=2, Nq=1000, Nk=1000, D=128, dtype="bfloat16", causal=True,
         layout="bnhd", window=(256, 0)),
    dict(B=1, Hq=4, Hkv=2, Nq=800, Nk=800, D=128, dtype="bfloat16", causal=True,
         layout="bhnd", window=(300, 0), softcap=2.5),
    dict(B=1, Hq=2, Hkv=2, Nq=500, Nk=700, D=64, dtype="float32", causal=False,
         layout="bnhd", window=None, softcap=1.5),
    dict(B=1, Hq=4, Hkv=4, Nq=700, Nk=900, D=64, dtype="float16", causal=False,
         layout="bhnd", window=(100, 50)),
    dict(B=1, Hq=2, Hkv=1, Nq=600, Nk=600, D=64, dtype="float32", causal=False,
         layout="bhnd", window=(None, 70)),
    dict(B=2, Hq=8, Hkv=2, Nq=700, Nk=1000, D=128, dtype="bfloat16", causal=True,
         layout="bnhd", window=None, alibi="bh"),
    dict(B=1, Hq=4, Hkv=4, Nq=500, Nk=500, D=64, dtype="float32", causal=False,
         layout="bhnd", window=(64, 64), softcap=3.0, alibi="h"),
    dict(B=1, Hq=4, Hkv=1, Nq=300, Nk=300, D=64, dtype="float16", causal=False,
         layout="bhnd", window=None, alibi="h"),
], ids=_case_id)
def test_mods_on_gpu(c):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    q, k, v, do = (torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda().to(
        getattr(torch, c["dtype"])) for x in _inputs(c))
    slopes = _slopes(c)
    opts = _opts(c, None if slopes is None else torch.from_numpy(slopes).cuda())
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **opts)
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
    torch.cuda.synchronize()
    host = lambda x: x.float().cpu().numpy()  # noqa: E731
    _check(*(host(x) for x in (q, k, v, do)), c, host(o), host(lse),
           [host(g) for g in grads])
