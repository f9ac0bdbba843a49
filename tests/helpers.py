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
#: float64: lse is float64 for float64 inputs (the contract), so the backward is
#: float64-accurate too (a float32 lse gave ~1e-7: P = exp(S - lse) carried |lse| * 6e-8).
TOL_BWD = {"float64": 1e-11, "float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}

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
    """float64 (dq, dk, dv) of the reference, with lse computed in float64 whatever the
    inputs' dtype (the contract's lse is float32 for inputs below float64)."""
    import array_api_compat as aac

    q64, k64, v64, case = _case64(q, k, v, opts)
    o, _ = reference.forward(q64, k64, v64, case)
    qb, kb = (x if case.layout == "bhnd" else np.transpose(x, (0, 2, 1, 3)) for x in (q64, k64))
    _, lse, _ = reference._probabilities(aac.array_namespace(qb), "cpu", qb, kb, case)
    lse = lse.reshape(case.batch, case.heads_q, case.seqlen_q)
    return reference.backward(to64(do), q64, k64, v64, o, lse, case)


def _case64(q, k, v, opts):
    from flashcore._checks import make_case

    other = sorted(set(opts) - {"causal", "scale", "layout"})
    if other:  # (a mask or score modifier would be left out of the oracle without a word)
        raise TypeError(f"the oracle helpers take causal, scale and layout, not {other}: "
                        f"call the public API with backend='reference' for those")
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


#: (Nq, Nk) for the NaN tests: square, Nq < Nk, and Nq > Nk (causal: leading rows see no key)
NAN_SHAPES = [(16, 16), (12, 20), (20, 16)]


def nan_inputs(rng, Nq, Nk, causal, q_row=5, key=None, D=8):
    """float32 q, k, v (B=1, Hq=4, Hkv=2, bhnd) with a NaN in query row ``q_row`` of head 0
    and in key ``key`` (default ``Nk // 2``) of key/value head 1, and the (1, 4, Nq) boolean
    rows whose o and lse must be NaN: that query row if it sees a key, and the rows of
    query heads 2 and 3 (key head 1's group) that see that key. No other row."""
    key = Nk // 2 if key is None else key
    q, k, v = qkv(rng, B=1, Hq=4, Hkv=2, Nq=Nq, Nk=Nk, D=D)
    q[0, 0, q_row, 1] = np.nan
    k[0, 1, key, 0] = np.nan
    seen = _rules.visible(np, Nq, Nk, causal)
    seen = np.ones((Nq, Nk), bool) if seen is None else seen
    bad = np.zeros((1, 4, Nq), bool)
    bad[0, 0, q_row] = seen[q_row].any()
    bad[0, 2:] = seen[:, key]
    return q, k, v, bad


def assert_nan_rows(o, lse, bad):
    """o (bhnd) and lse are NaN exactly in rows ``bad``; every other row is NaN-free
    (``lse`` None: o only)."""
    o = np.asarray(o, dtype=np.float64)
    rows = np.isnan(o).any(axis=-1)
    assert (rows == bad).all(), (f"NaN rows {np.argwhere(rows).tolist()}, "
                                 f"expected {np.argwhere(bad).tolist()}")
    assert np.isnan(o[bad]).all(), "a row that sees a NaN is NaN in every column"
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        assert (np.isnan(lse) == bad).all(), f"NaN lse {np.argwhere(np.isnan(lse)).tolist()}"


def run_under_simulator(request, test_file, select=None, tensor_cores=None, timeout=1800):
    """Runs ``test_file``'s tests again in a subprocess with numba's CUDA simulator on
    (``FLASHCORE_POISON=1``; ``tensor_cores`` True/False sets ``FLASHCORE_TENSOR_CORES``),
    those matching the ``-k`` expression ``select``, and fails with the subprocess's tail.
    A calling run that leaves out tests marked slow (``-m "not slow"``, the README's command)
    leaves them out of the subprocess too; ``nox -s tests-cudasim`` runs them all."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", FLASHCORE_POISON="1")
    if tensor_cores is not None:
        env["FLASHCORE_TENSOR_CORES"] = "1" if tensor_cores else "0"
    here = Path(test_file).resolve()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)]
    if select:
        cmd += ["-k", select]
    if "not slow" in (request.config.getoption("markexpr") or ""):
        cmd += ["-m", "not slow"]
    proc = subprocess.run(cmd, cwd=here.parent.parent, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"simulator run failed:\n{tail}"
    assert " passed" in proc.stdout, tail
    print(proc.stdout.strip().splitlines()[-1])
