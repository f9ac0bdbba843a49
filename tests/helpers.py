"""Shared test helpers: fresh random inputs, the float64 oracle, error norms, tolerances."""
from __future__ import annotations

import numpy as np

from flashcore import _rules, reference
from flashcore._interop import np_dtype

#: Norm-wise relative error ||x - ref|| / ||ref|| allowed per input dtype. The oracle works in
#: float64 on the same (already rounded) inputs, so the error is the kernel's own: rounding
#: of the output to the dtype (unit roundoff u: fp16 4.9e-4, bf16 3.9e-3, whose norm-wise
#: effect is about u/sqrt(3)) plus float32 accumulation over Nk terms (~1e-6 at our sizes).
#: The bounds are a few times those, far below what one wrong tile or mask produces.
TOL_FWD = {"float64": 1e-12, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
#: Gradients go through one more rounding (dS = P * (dP - D), with D from the rounded O).
#: float64: the backward pass reads lse, which the contract makes float32 (rounding 6e-8
#: relative, so P = exp(S - lse) carries |lse| * 6e-8): a few times that.
TOL_BWD = {"float64": 1e-6, "float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}

LAYOUT_AXES = {"bhnd": (0, 1, 2, 3), "bnhd": (0, 2, 1, 3)}


def rand(rng, shape, dtype="float32", layout="bhnd", scale=1.0):
    """Standard normal numbers in ``dtype``; ``shape`` is given in bhnd order and the array is
    returned in ``layout`` (a transposed view for bnhd, so strides are not trivial)."""
    x = (rng.standard_normal(shape) * scale).astype(np_dtype(dtype))
    if layout == "bnhd":
        x = np.ascontiguousarray(np.transpose(x, (0, 2, 1, 3)))
    return x


def qkv(rng, B=1, Hq=2, Hkv=None, Nq=16, Nk=None, D=16, dtype="float32", layout="bhnd"):
    Hkv = Hq if Hkv is None else Hkv
    Nk = Nq if Nk is None else Nk
    return (rand(rng, (B, Hq, Nq, D), dtype, layout),
            rand(rng, (B, Hkv, Nk, D), dtype, layout),
            rand(rng, (B, Hkv, Nk, D), dtype, layout))


def to64(x):
    return np.asarray(x).astype(np.float64)


def oracle_forward(q, k, v, **opts):
    """float64 (o, lse) of the reference on float64 copies of the inputs."""
    o, lse = reference.forward(*_case64(q, k, v, opts))
    return o, lse.astype(np.float64)


def oracle_backward(do, q, k, v, **opts):
    """float64 (dq, dk, dv) of the reference, with lse kept in float64 (the contract's lse
    is float32, which is what limits float64 backends, see TOL_BWD)."""
    import array_api_compat as aac

    q64, k64, v64, case = _case64(q, k, v, opts)
    o, _ = reference.forward(q64, k64, v64, case)
    qb, kb = (x if case.layout == "bhnd" else np.transpose(x, (0, 2, 1, 3)) for x in (q64, k64))
    _, lse, _ = reference._probabilities(aac.array_namespace(qb), "cpu", qb, kb, case)
    lse = lse.reshape(case.batch, case.heads_q, case.seqlen_q)
    return reference.backward(to64(do), q64, k64, v64, o, lse, case)


def _case64(q, k, v, opts):
    from flashcore._checks import make_case

    q64, k64, v64 = (to64(x) for x in (q, k, v))
    case = make_case(q64, k64, v64, causal=opts.get("causal", False), scale=opts.get("scale"),
                     layout=opts.get("layout", "bhnd"), explicit=True)
    return q64, k64, v64, case


def rel_err(x, ref, floor=0.0):
    """||x - ref|| / max(||ref||, floor) in float64; NaN where ref has none gives inf.

    ``floor`` keeps a reference that vanishes by cancellation (dq when every row sees one key
    is exactly 0) from turning rounding noise into a huge relative error; pass
    :func:`grad_floor` for gradients."""
    x = to64(x)
    ref = to64(ref)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {x.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(x) == np.isfinite(ref)):
        return np.inf
    fin = np.isfinite(ref)
    if not np.array_equal(x[~fin], ref[~fin]):
        return np.inf
    num = np.linalg.norm(x[fin] - ref[fin])
    den = max(np.linalg.norm(ref[fin]), floor)
    return num / den if den > 0 else num


def grad_floor(do, q, k, v, causal=False, scale=None, layout="bhnd"):
    """Floors for rel_err of (dq, dk, dv): 1e-3 of the norm of the terms each gradient sums.

    Where an exact gradient cancels to zero (dk and dq when every row sees a single key:
    P = 1 and dP - D = 0), relative error only measures rounding noise; there the check
    becomes "small next to the magnitudes it cancelled from", the error bound of a sum.
    Elsewhere ||ref|| is far above the floor and the plain relative check applies.
    """
    t = lambda x: np.transpose(to64(x), LAYOUT_AXES[layout])  # noqa: E731  (to bhnd)
    q, k, v, do = t(q), t(k), t(v), t(do)
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    seen = _rules.visible(np, *s.shape[-2:], causal)
    if seen is not None:
        s = np.where(seen, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    tot = p.sum(-1, keepdims=True)
    p = np.divide(p, tot, out=np.zeros_like(p), where=tot > 0)
    # dS = P * (dP - D) with dP = dO V^T and D = rowsum(dO * O): the terms summed are
    # |dO| |V|^T and |dO| |O|, which bound the rounding of a cancelling difference.
    o_abs = np.abs(p @ v)
    ads = p * (np.abs(do) @ np.swapaxes(np.abs(v), -1, -2)
               + np.sum(np.abs(do) * o_abs, axis=-1, keepdims=True))
    dq = scale * ads @ np.abs(k)
    dk = scale * np.swapaxes(ads, -1, -2) @ np.abs(q)
    dv = np.swapaxes(p, -1, -2) @ np.abs(do)
    return tuple(1e-3 * np.linalg.norm(x) for x in (dq, dk, dv))
