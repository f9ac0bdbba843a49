"""The front end: argument checks, dispatch, backend registry, and import hygiene."""
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import NAN_SHAPES, assert_nan_rows, nan_inputs, qkv, rand

import flashcore
from flashcore import BackendUnavailableError


@pytest.fixture
def rng():
    return np.random.default_rng()


def test_available_backends_lists_every_backend_with_reason_or_none():
    av = flashcore.available_backends()
    assert set(av) == {"numba_cuda", "numba_cpu", "torch", "jax", "reference"}
    assert av["numba_cpu"] is None and av["reference"] is None
    for name, why in av.items():
        assert why is None or (isinstance(why, str) and why), name


def test_import_flashcore_imports_no_framework():
    code = (
        "import sys, numpy as np, flashcore\n"
        "q = np.ones((1, 1, 4, 8), np.float32) * np.arange(8, dtype=np.float32)\n"
        "flashcore.attention(q, q, q)\n"
        "flashcore.attention(q, q, q, backend='reference')\n"
        "p = np.ones((5, 2, 8)); cu = np.array([0, 2, 5], np.int32)\n"
        "flashcore.attention_varlen(p, p, p, cu, cu, backend='reference')\n"
        "c = np.zeros((2, 4, 2, 8)); n = np.array([1, 2], np.int32)\n"
        "flashcore.attention_with_kvcache(p[:4].reshape(2, 2, 2, 8), c, c, cache_seqlens=n,\n"
        "                                 backend='reference')\n"
        "bad = [m for m in ('torch', 'jax', 'cupy', 'numba.cuda') if m in sys.modules]\n"
        "flashcore.available_backends()\n"
        "bad += [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import flashcore pulled in {out.stdout.strip()}"


def test_auto_picks_numba_cpu_for_host_arrays(rng):
    from flashcore import _dispatch
    from flashcore._checks import make_case

    q, k, v = qkv(rng)
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd")
    assert _dispatch.select(case, "auto").NAME == "numba_cpu"


def test_auto_never_gives_reference_a_large_input():
    from flashcore import reference
    from flashcore._case import Case

    big = Case(library="numpy", device="cpu", dtype="float32", batch=1, heads_q=8, heads_kv=8,
               seqlen_q=4096, seqlen_k=4096, head_dim=64, causal=False, scale=0.125,
               layout="bhnd")
    assert reference.supports(big) is not None
    assert reference.supports(Case(**{**big.__dict__, "explicit": True})) is None


def test_named_backend_that_cannot_serve_says_why(rng):
    q, k, v = qkv(rng)
    with pytest.raises(BackendUnavailableError, match="numba_cuda"):
        # No GPU here (or host arrays with a GPU): either way the reason is given.
        if flashcore.available_backends()["numba_cuda"] is not None:
            flashcore.attention(q, k, v, backend="numba_cuda")
        else:
            raise BackendUnavailableError("numba_cuda usable here; nothing to check")


def test_no_backend_fits_lists_each_reason(rng, monkeypatch):
    from flashcore import _dispatch

    monkeypatch.setattr(_dispatch, "AUTO_ORDER", ("reference",))
    q, k, v = qkv(rng, Nq=2048, Nk=4096, Hq=1)  # 8M scores: more than auto gives the reference
    with pytest.raises(BackendUnavailableError, match="reference: it materializes"):
        flashcore.attention(q, k, v)


# --- bad input ------------------------------------------------------------------------


def test_non_array_input(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=r"k must be an array .* got builtins.list"):
        flashcore.attention(q, k.tolist(), v)


def test_integer_dtype(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="q has dtype int32"):
        flashcore.attention(q.astype(np.int32), k, v)


def test_mismatched_dtypes(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="share one dtype.*float64"):
        flashcore.attention(q, k, v.astype(np.float64))


def test_wrong_ndim(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions .*q.shape=\(2, 16, 16\)"):
        flashcore.attention(q[0], k, v)


@pytest.mark.parametrize("which,shape,match", [
    ("k", (2, 2, 16, 16), "batch size"),
    ("k", (1, 2, 16, 8), "head dim"),
    ("v", (1, 2, 12, 16), "k and v must have one shape"),
    ("k", (1, 3, 16, 16), "multiple of the key/value heads"),
    ("k", (1, 0, 16, 16), r"k must have at least one head; got Hq=2, Hkv=0"),
])
def test_mismatched_shapes(rng, which, shape, match):
    q, k, v = qkv(rng)
    args = {"q": q, "k": k, "v": v}
    if which == "k":
        args["k"] = args["v"] = rand(rng, shape)
        if match.startswith("k and v"):
            args["v"] = v
    else:
        args["v"] = rand(rng, shape)
    with pytest.raises(ValueError, match=match):
        flashcore.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_no_query_heads_is_an_empty_call(rng, layout):
    """Zero query heads against key/value heads (0 is a multiple of any): an empty output
    and lse, as for B=0 or N=0; zero key/value heads are refused by name."""
    q, k, v = qkv(rng, Hq=2, layout=layout)
    q0 = q[:, :0] if layout == "bhnd" else q[:, :, :0]
    o, lse = flashcore.attention(q0, k, v, layout=layout, return_lse=True)
    assert o.shape == q0.shape and lse.shape == (1, 0, 16)
    with pytest.raises(ValueError, match="k must have at least one head; got Hq=0, Hkv=0"):
        flashcore.attention(q0, k[:, :0] if layout == "bhnd" else k[:, :, :0],
                            v[:, :0] if layout == "bhnd" else v[:, :, :0], layout=layout)


def test_unknown_layout_and_backend(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="layout='bshd'"):
        flashcore.attention(q, k, v, layout="bshd")
    with pytest.raises(ValueError, match="backend='flash'"):
        flashcore.attention(q, k, v, backend="flash")


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_bad_scale_values(rng, scale):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        flashcore.attention(q, k, v, scale=scale)


def test_bad_scale_type_and_causal(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="scale must be a real number"):
        flashcore.attention(q, k, v, scale="0.1")
    with pytest.raises(TypeError, match="causal must be True or False"):
        flashcore.attention(q, k, v, causal="yes")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_return_lse_is_a_flag(rng, framework):
    """return_lse=2 or "yes" is a TypeError in every entry point (it was taken as true)."""
    q, k, v = qkv(rng)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    cu = np.array([0, 16], np.int32)
    if framework == "torch":
        cu = torch.from_numpy(cu)
    q3, k3, v3 = (x[0].transpose(1, 0, 2) if framework == "numpy" else x[0].transpose(0, 1)
                  for x in (q, k, v))
    calls = [lambda flag: flashcore.attention(q, k, v, return_lse=flag),
             lambda flag: flashcore.attention_varlen(q3, k3, v3, cu, cu, return_lse=flag),
             lambda flag: flashcore.attention_with_kvcache(
                 q3[None], k3[None], v3[None], cache_seqlens=cu[1:], return_lse=flag)]
    for call in calls:
        for flag in (2, "yes", None):
            with pytest.raises(TypeError, match=f"return_lse must be True or False; "
                                                f"got return_lse={flag!r}"):
                call(flag)
        assert len(call(np.True_)) == 2


def test_backward_argument_checks(rng):
    q, k, v = qkv(rng)
    o, lse = flashcore.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"do must have q's shape"):
        flashcore.attention_backward(o[:, :1], q, k, v, o, lse)
    with pytest.raises(TypeError, match="o must have q's dtype float32"):
        flashcore.attention_backward(o, q, k, v, o.astype(np.float64), lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(B, Hq, Nq\)"):
        flashcore.attention_backward(o, q, k, v, o, lse[..., :3])
    with pytest.raises(TypeError, match="lse must be float32"):
        flashcore.attention_backward(o, q, k, v, o, lse.astype(np.float16))


def test_mixed_libraries_raise(rng):
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="one library.*torch"):
        flashcore.attention(q, torch.from_numpy(k), v)


def test_checked_calls_are_planned_once_per_kind(rng):
    from flashcore import _api

    q, k, v = qkv(rng)
    o1 = flashcore.attention(q, k, v, causal=True)
    (plan,) = _api._PLANS.values()
    o2 = flashcore.attention(*qkv(rng), causal=True)  # same kind of call: the same plan
    assert list(_api._PLANS.values()) == [plan] and o1.shape == o2.shape
    flashcore.attention(q, k, v, causal=True, scale=0.5)  # another option: another plan
    flashcore.attention_forward(q, k, v, causal=True)  # lse wanted: another plan
    assert len(_api._PLANS) == 3
    cases = [c for c, _ in _api._PLANS.values()]
    assert {c.scale for c in cases} == {0.5, 1 / math.sqrt(q.shape[-1])}
    assert {c.need_lse for c in cases} == {True, False}
    with pytest.raises(ValueError, match="scale"):  # a failing call is checked each time
        flashcore.attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="scale"):
        flashcore.attention(q, k, v, scale=-1.0)
    assert len(_api._PLANS) == 3
    # options equal to planned ones (1 == True == 1.0) but of types the checks refuse
    good = {"causal": True, "softcap": 1.0, "window": (1, 0), "scale": 1.0}
    flashcore.attention(q, k, v, **good)
    for bad, match in [({"causal": 1}, "causal"), ({"scale": True}, "scale"),
                       ({"softcap": True}, "softcap"), ({"window": (True, 0)}, "window")]:
        with pytest.raises(TypeError, match=match):
            flashcore.attention(q, k, v, **{**good, **bad})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "numba_cpu"])
def test_nan_reaches_exactly_the_rows_that_see_it(rng, backend, shape, causal):
    # The reference once gave a row with a NaN query output 0 (as if it saw no key).
    q, k, v, bad = nan_inputs(rng, *shape, causal)
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, backend=backend)
    assert_nan_rows(o, lse, bad)


@pytest.mark.torch
@pytest.mark.jax
@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_framework_plans_refuse_options_of_refused_types(lib):
    """torch's autograd path and JAX's path keep plans too: an option equal to a planned
    one (1 == True) but of a type the checks refuse is refused after the good call."""
    mod = pytest.importorskip(lib)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3)]
    if lib == "torch":
        q, k, v = (mod.tensor(a, requires_grad=True) for a in arrays)
    else:
        q, k, v = (mod.numpy.asarray(a) for a in arrays)
    good = {"causal": True, "scale": 1.0, "softcap": 1.0}
    flashcore.attention(q, k, v, **good)
    for bad, match in [({"causal": 1}, "causal"), ({"scale": True}, "scale"),
                       ({"softcap": True}, "softcap")]:
        with pytest.raises(TypeError, match=match):
            flashcore.attention(q, k, v, **{**good, **bad})
