"""Masks and score modifiers (window, softcap, ALiBi, score_mod, mask_mod, mod_args,
BlockMask): the reference against a loop over every score written from the issue's rule,
its gradients against finite differences, numba_cpu against the reference (forward and
backward, each option alone and combined, GQA, both layouts), tile skipping, and every bad
input. The CPU kernels compile once per (score_mod, mask_mod) pair and dtype (~20-60 s
each on the 2-core host), so the user functions below are shared by the tests, and the
float32/bfloat16 runs are marked slow (nox runs them; CI's command deselects them).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, rel_err

import flashcore
from flashcore import _mods


def rel_bias(s, b, h, i, j):
    """A relative position bias written as a score_mod."""
    return s + 0.05 * (j - i) - 0.01 * h


def py_softcap(s, b, h, i, j):
    """softcap=3 written in Python (its derivative is known: the built-in's)."""
    return 3.0 * math.tanh(s / 3.0)


def same_doc(b, h, i, j, doc):
    """Document masking of packed sequences: doc holds a document id per token (-1: a
    token of no document, which sees nothing)."""
    return doc[b, i] >= 0 and doc[b, i] == doc[b, j]


def doc_bias(s, b, h, i, j, doc):
    return s + 0.1 * doc[b, j] if doc[b, j] > 0 else s


def doc_bias_curved(s, b, h, i, j, doc):
    """doc_bias plus a term not linear in ``s`` (written out: Numba compiles the mod and
    what it calls): the finite-difference derivative the kernels take of it is not the
    constant 1 a pure bias gives."""
    return (s + 0.1 * doc[b, j] if doc[b, j] > 0 else s) + 0.5 * math.tanh(s / 2.0)


def dense(q, k, v, *, causal=False, window=None, softcap=None, alibi=None, score_mod=None,
          mask_mod=None, mod_args=(), scale=None):
    """o by the issue's rule, one score at a time (float64, bhnd, any GQA group)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    o = np.zeros((B, Hq, Nq, D))
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Nq):
                ip = i + Nk - Nq
                row = np.full(Nk, -np.inf)
                for j in range(Nk):
                    s = float(q[b, h, i] @ k[b, hk, j]) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        s -= float(alibi.reshape(-1, Hq)[min(b, alibi.reshape(-1, Hq).shape[0]
                                                           - 1), h]) * abs(ip - j)
                    if score_mod is not None:
                        s = score_mod(s, b, h, i, j, *mod_args)
                    hidden = causal and j > ip
                    if window is not None:
                        left, right = window
                        hidden |= left is not None and j < ip - left
                        hidden |= right is not None and j > ip + right
                    if mask_mod is not None and not mask_mod(b, h, i, j, *mod_args):
                        hidden = True
                    if not hidden:
                        row[j] = s
                if np.isfinite(row).any():
                    p = np.exp(row - row.max())
                    o[b, h, i] = p @ v[b, hk] / p.sum()
    return o


def inputs(rng, B=2, Hq=4, Hkv=2, Nq=37, Nk=45, D=8, dtype=np.float64):
    q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    return q, k, v


def docs(B, N, sizes):
    """Document ids (B, N): documents of the given sizes, packed, per batch entry rolled."""
    ids = np.repeat(np.arange(len(sizes)), sizes)[:N]
    return np.stack([np.roll(ids, 3 * b) for b in range(B)]).astype(np.int64)


ALIBI = np.array([0.3, 0.1, 0.05, 0.02], np.float32)
DOC = docs(2, 45, [10, 20, 15])

#: (name, options as flashcore takes them, as dense() takes them)
CASES = [
    ("window", {"window": (6, 2)}, {"window": (6, 2)}),
    ("window-left-only-causal", {"window": (9, None), "causal": True},
     {"window": (9, None), "causal": True}),
    ("softcap", {"softcap": 0.8}, {"softcap": 0.8}),
    ("alibi", {"alibi_slopes": ALIBI}, {"alibi": ALIBI}),
    ("alibi-per-batch", {"alibi_slopes": np.stack([ALIBI, 2 * ALIBI])},
     {"alibi": np.stack([ALIBI, 2 * ALIBI])}),
    ("builtins-combined", {"window": (11, 3), "softcap": 1.5, "alibi_slopes": ALIBI,
                           "causal": True},
     {"window": (11, 3), "softcap": 1.5, "alibi": ALIBI, "causal": True}),
    ("score_mod", {"score_mod": rel_bias}, {"score_mod": rel_bias}),
    ("documents", {"mask_mod": same_doc, "mod_args": (DOC,)},
     {"mask_mod": same_doc, "mod_args": (DOC,)}),
    ("everything", {"mask_mod": same_doc, "score_mod": doc_bias_curved, "mod_args": (DOC,),
                    "window": (20, 0), "softcap": 2.0, "alibi_slopes": ALIBI},
     {"mask_mod": same_doc, "score_mod": doc_bias_curved, "mod_args": (DOC,),
      "window": (20, 0),
      "softcap": 2.0, "alibi": ALIBI}),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,opts,dense_opts", CASES, ids=IDS)
def test_reference_is_the_rule(name, opts, dense_opts):
    q, k, v = inputs(np.random.default_rng(1))
    o = flashcore.attention(q, k, v, backend="reference", **opts)
    assert rel_err(o, dense(q, k, v, **dense_opts)) < 1e-13


def test_reference_gradients_are_derivatives():
    """The reference backward (with the finite-difference derivative of score_mod inside)
    against central differences of sum(o * do) in q, k and v."""
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=3)
    doc = docs(1, 7, [3, 4])
    opts = {"softcap": 1.2, "alibi_slopes": ALIBI[:2], "score_mod": doc_bias,
            "mask_mod": same_doc, "mod_args": (doc,), "window": (4, 1)}
    do = rng.standard_normal(q.shape)
    o, lse = flashcore.attention_forward(q, k, v, backend="reference", **opts)
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="reference", **opts)
    loss = lambda q, k, v: float(np.sum(flashcore.attention(q, k, v, backend="reference",
                                                             **opts) * do))
    for n, (x, g) in enumerate(zip((q, k, v), grads)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += 1e-6
            xm[idx] -= 1e-6
            args = [q, k, v]
            args[n] = xp
            up = loss(*args)
            args[n] = xm
            num[idx] = (up - loss(*args)) / 2e-6
        assert rel_err(g, num) < 1e-7, n


@pytest.mark.parametrize("backend", [
    "reference",
    # py_softcap compiles its own numba_cpu kernels (~100 s on the 2-core host), used by no
    # other test: slow. CI keeps numba_cpu's derivative of a score_mod that is not linear in
    # s through test_numba_cpu_float64[everything] (doc_bias_curved, against the reference,
    # whose finite difference the reference case here checks against the analytic one).
    pytest.param("numba_cpu", marks=pytest.mark.slow)])
def test_score_mod_derivative_matches_the_builtin(backend):
    """softcap in Python as a score_mod: same o and gradients as the built-in softcap (whose
    derivative is analytic), so the finite difference is float64-accurate."""
    rng = np.random.default_rng(3)
    q, k, v = (3 * x for x in inputs(rng))
    do = rng.standard_normal(q.shape)
    a = flashcore.attention_forward(q, k, v, softcap=3.0, backend=backend)
    b = flashcore.attention_forward(q, k, v, score_mod=py_softcap, backend=backend)
    assert rel_err(b[0], a[0]) < 1e-13
    ga = flashcore.attention_backward(do, q, k, v, *a, softcap=3.0, backend=backend)
    gb = flashcore.attention_backward(do, q, k, v, *b, score_mod=py_softcap, backend=backend)
    for x, y in zip(gb, ga):
        assert rel_err(x, y) < 1e-10, backend


def _check_backend(q, k, v, opts, dtype, layout="bhnd", backend="numba_cpu"):
    rng = np.random.default_rng(4)
    do = rng.standard_normal(q.shape)
    to = (lambda x: x) if layout == "bhnd" else (lambda x: np.ascontiguousarray(
        np.swapaxes(x, 1, 2)))
    cast = lambda x: to(x).astype(dtype)
    qc, kc, vc, doc_ = (cast(x) for x in (q, k, v, do))
    # Outputs and gradients are compared to the float64 reference on the same (cast) inputs.
    ref64 = [to(x) for x in (q, k, v, do)]
    if dtype != np.float64:
        ref64 = [x.astype(np.float64) for x in (qc, kc, vc, doc_)]
    o_r, lse_r = flashcore.attention_forward(*ref64[:3], layout=layout, backend="reference",
                                             **opts)
    g_r = flashcore.attention_backward(ref64[3], *ref64[:3], o_r, lse_r, layout=layout,
                                       backend="reference", **opts)
    o, lse = flashcore.attention_forward(qc, kc, vc, layout=layout, backend=backend, **opts)
    name = np.dtype(dtype).name
    assert rel_err(o, o_r) < TOL_FWD[name]
    fin = np.isfinite(lse_r)
    assert np.array_equal(np.isfinite(lse), fin)
    assert np.abs(lse[fin] - lse_r[fin]).max() < 1e-5
    grads = flashcore.attention_backward(doc_, qc, kc, vc, o, lse, layout=layout,
                                         backend=backend, **opts)
    for g, r in zip(grads, g_r):
        assert rel_err(g, r) < TOL_BWD[name]


#: Each user function pair compiles its own kernels (~40 s): CI runs the pairs the other
#: tests share, nox the rest too.
_SLOW_PAIR = ("score_mod",)


@pytest.mark.parametrize("name,opts,dense_opts", [
    pytest.param(*c, marks=pytest.mark.slow) if c[0] in _SLOW_PAIR else c for c in CASES],
    ids=IDS)
def test_numba_cpu_float64(name, opts, dense_opts):
    q, k, v = inputs(np.random.default_rng(5))
    _check_backend(q, k, v, opts, np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,opts,dense_opts", [CASES[5], CASES[8]], ids=[IDS[5], IDS[8]])
def test_numba_cpu_low_precision_bnhd(name, opts, dense_opts, dtype):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = inputs(np.random.default_rng(6), Nq=150, Nk=170, D=16)
    opts = dict(opts)
    if "mod_args" in opts:
        opts["mod_args"] = (docs(2, 170, [50, 70, 50]),)
    _check_backend(q, k, v, opts, dt, layout="bnhd")


def test_rows_that_see_no_key():
    """A mask_mod can hide every key from rows anywhere: they get o = 0, lse = -inf and no
    gradient, as rows that see no key always have."""
    q, k, v = inputs(np.random.default_rng(7), Nq=45, Nk=45)
    doc = DOC.copy()
    doc[:, 5:9] = -1  # tokens of no document: their rows see nothing
    lonely = same_doc
    for backend in ("reference", "numba_cpu"):
        o, lse = flashcore.attention_forward(q, k, v, mask_mod=lonely, mod_args=(doc,),
                                             backend=backend)
        assert np.all(o[:, :, 5:9] == 0) and np.all(lse[:, :, 5:9] == -np.inf)
        dq, dk, dv = flashcore.attention_backward(np.ones_like(o), q, k, v, o, lse,
                                                  mask_mod=lonely, mod_args=(doc,),
                                                  backend=backend)
        assert np.all(dq[:, :, 5:9] == 0) and np.isfinite(dq).all()
        assert np.all(dk[:, :, 5:9] == 0) and np.all(dv[:, :, 5:9] == 0)


# --- tiles are skipped -------------------------------------------------------------------


def test_tiles_no_query_sees_are_never_read():
    """NaN in every key and value no query sees: any product over them (even one whose
    probabilities are 0) would turn o into NaN. Window: 64 queries at the end of 1024 keys
    see only the last ~80; documents: tile-aligned documents of 256 tokens."""
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, B=1, Hq=2, Hkv=1, Nq=64, Nk=1024, D=8)
    k[:, :, :896], v[:, :, :896] = np.nan, np.nan
    o = flashcore.attention(q, k, v, window=(16, 0), backend="numba_cpu")
    assert np.isfinite(o).all()
    ref = flashcore.attention(q, np.nan_to_num(k), np.nan_to_num(v), window=(16, 0),
                              backend="reference")
    assert rel_err(o, ref) < 1e-12

    q, k, v = inputs(rng, B=1, Hq=2, Hkv=1, Nq=512, Nk=512, D=8)
    doc = docs(1, 512, [256, 256])
    k[:, :, 256:], v[:, :, 256:] = np.nan, np.nan
    o = flashcore.attention(q, k, v, mask_mod=same_doc, mod_args=(doc,), backend="numba_cpu")
    assert np.isfinite(o[:, :, :256]).all()  # the first document never read the second


def test_block_mask():
    doc = docs(2, 300, [100, 140, 60])
    bm = flashcore.create_block_mask(same_doc, 2, None, 300, 300, mod_args=(doc,))
    assert bm.classes.shape == (2, 1, 3, 3)
    # the classes by brute force
    for b in range(2):
        for qt in range(3):
            for kt in range(3):
                seen = [[same_doc(b, 0, i, j, doc) for j in range(kt * 128, min(300, kt * 128
                                                                                + 128))]
                        for i in range(qt * 128, min(300, qt * 128 + 128))]
                n = sum(map(sum, seen))
                want = (_mods.EMPTY if n == 0 else
                        _mods.FULL if n == sum(map(len, seen)) else _mods.PARTIAL)
                assert bm.classes[b, 0, qt, kt] == want
    assert "BlockMask" in repr(bm)
    q, k, v = inputs(np.random.default_rng(9), B=2, Hq=2, Hkv=1, Nq=300, Nk=300)
    a = flashcore.attention(q, k, v, mask_mod=same_doc, mod_args=(doc,), backend="numba_cpu")
    b = flashcore.attention(q, k, v, block_mask=bm, mod_args=(doc,), backend="numba_cpu")
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="block_mask was made for"):
        flashcore.attention(q[:, :, :200], k, v, block_mask=bm, mod_args=(doc,))
    with pytest.raises(ValueError, match="another mask_mod"):
        flashcore.attention(q, k, v, block_mask=bm, mask_mod=lambda b, h, i, j, d: True,
                            mod_args=(doc,))


def test_classes_of_calls_without_block_mask_are_remembered_by_contents(monkeypatch):
    """A call without a BlockMask evaluates the mask once per contents of its arrays: the
    same ids again (another array, equal bits) reuse the classes; the caller's array
    written in place, or one differing only in a zero's sign, are evaluated anew."""
    from flashcore import _block_eval

    monkeypatch.setattr(_mods, "_CLASSES", {})
    runs = []
    real = _block_eval.classify

    def counting(*a):
        runs.append(1)
        return real(*a)

    monkeypatch.setattr(_block_eval, "classify", counting)
    doc = docs(1, 300, [100, 200])
    first = _mods.block_classes(same_doc, 1, 1, 300, 300, 128, (doc,), remember=True)
    again = _mods.block_classes(same_doc, 1, 1, 300, 300, 128, (doc.copy(),), remember=True)
    assert again is first and len(runs) == 1
    doc[0, 100:] = 0  # (in place: one document now)
    one = _mods.block_classes(same_doc, 1, 1, 300, 300, 128, (doc,), remember=True)
    assert len(runs) == 2 and (one == _mods.FULL).all() and not (first == _mods.FULL).all()

    def nonneg(b, h, i, j, x):
        return math.copysign(1.0, x[0]) > 0

    zeros = [np.zeros(1), -np.zeros(1)]
    got = [_mods.block_classes(nonneg, 1, 1, 10, 10, 128, (z,), remember=True) for z in zeros]
    assert len(runs) == 4 and got[0][0, 0, 0, 0] == _mods.FULL
    assert got[1][0, 0, 0, 0] == _mods.EMPTY
    # the copies kept are bounded in all (the oldest keys go first), and arrays above
    # _MAX_REMEMBERED are keyed by a digest (kept without a copy, found again)
    monkeypatch.setattr(_mods, "_CLASSES", {})
    monkeypatch.setattr(_mods, "_MAX_KEPT", 2 * doc.nbytes + 100)  # (two of the three)
    for n in (300, 301, 302):
        _mods.block_classes(same_doc, 1, 1, n, n, 128, (docs(1, n, [100, n - 100]),),
                            remember=True)
    assert len(_mods._CLASSES) == 2 and _mods._kept_bytes() <= 2 * doc.nbytes + 100
    monkeypatch.setattr(_mods, "_MAX_REMEMBERED", 100)
    before = len(runs)
    big = [_mods.block_classes(same_doc, 1, 1, 300, 300, 128, (doc.copy(),), remember=True)
           for _ in range(2)]
    assert big[0] is big[1] and len(runs) == before + 1


# --- bad inputs --------------------------------------------------------------------------

BAD = [
    ({"window": 5}, TypeError, "window must be a pair"),
    ({"window": (1, 2, 3)}, TypeError, "window must be a pair"),
    ({"window": (-1, 2)}, ValueError, r"window's left bound must be from 0 to 2\*\*31 - 1"),
    ({"window": (0, 2**63)}, ValueError, r"window's right bound must be from 0 to 2\*\*31"),
    ({"window": (1.5, 2)}, TypeError, "window's left bound must be an int"),
    ({"softcap": 0.0}, ValueError, "softcap must be a positive"),
    ({"softcap": "2"}, TypeError, "softcap must be a positive number"),
    ({"alibi_slopes": np.ones(3, np.float32)}, ValueError, r"alibi_slopes must have shape"),
    ({"alibi_slopes": np.ones(4, np.float64)}, TypeError, "alibi_slopes must be float32"),
    ({"alibi_slopes": [0.1] * 4}, TypeError, "alibi_slopes must be an array"),
    ({"score_mod": 3}, TypeError, "score_mod must be a Python function"),
    ({"mask_mod": "causal"}, TypeError, "mask_mod must be a Python function"),
    ({"mask_mod": same_doc, "mod_args": DOC}, TypeError, "mod_args must be a tuple"),
    ({"mask_mod": same_doc, "mod_args": ([1, 2],)}, TypeError, r"mod_args\[0\] must be"),
    ({"mod_args": (DOC,)}, ValueError, "without a score_mod or mask_mod"),
    ({"block_mask": "x"}, TypeError, "block_mask must be a BlockMask"),
]


@pytest.mark.parametrize("opts,err,msg", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_options(opts, err, msg):
    q, k, v = inputs(np.random.default_rng(10))
    for fn in (flashcore.attention, flashcore.attention_forward):
        with pytest.raises(err, match=msg):
            fn(q, k, v, **opts)


def test_mod_that_does_not_compile_names_itself_before_writing():
    q, k, v = inputs(np.random.default_rng(11))

    def broken(s, b, h, i, j):
        return s + undefined_name  # noqa: F821

    with pytest.raises(TypeError, match="score_mod 'test_mod_that.*broken' does not compile"):
        flashcore.attention(q, k, v, score_mod=broken, backend="numba_cpu")

    def wrong_arity(b, h, i):
        return True

    with pytest.raises(TypeError, match="mask_mod .* does not compile"):
        flashcore.attention(q, k, v, mask_mod=wrong_arity, backend="numba_cpu")


def _says_x(s, b, h, i, j):
    return "x"


def _always_raises(s, b, h, i, j):
    raise ValueError("no")


def _a_pair(s, b, h, i, j):
    return s, s


@pytest.mark.parametrize("mod", [_says_x, _always_raises, _a_pair])
def test_a_score_mod_that_returns_no_number_is_a_type_error(mod):
    """A score_mod that compiles but returns no number (a str, a tuple, nothing: it always
    raises) is a TypeError naming it, not Numba's TypingError from inside the kernels."""
    q, k, v = inputs(np.random.default_rng(12))
    with pytest.raises(TypeError, match=f"score_mod .*{mod.__name__}' must return a number"):
        flashcore.attention(q, k, v, score_mod=mod, backend="numba_cpu")


@pytest.mark.jax
def test_backends_that_cannot_decline_by_name():
    jnp = pytest.importorskip("jax.numpy")
    q, k, v = (jnp.asarray(x) for x in inputs(np.random.default_rng(12)))
    with pytest.raises(flashcore.BackendUnavailableError, match="window, softcap"):
        flashcore.attention(q, k, v, window=(1, 1), softcap=2.0, backend="jax")


def test_classes_only_for_the_indices_a_mask_reads():
    """A mask that never reads ``h`` (or ``b``) has its tile classes evaluated once for all
    heads (batch entries), and the kernels read them with stride 0; a mask that reads them,
    or whose code cannot be read, keeps one class table per head (batch entry)."""
    import numba

    def head_doc(b, h, i, j, doc):
        return doc[b, i] == doc[b, j] and (h + i) % 3 != 0

    def captures_h(b, h, i, j, doc):
        return (lambda: h)() == 0

    def stores_b_first(b, h, i, j, doc):
        b = 0
        return doc[b, i] == doc[b, j]

    def variadic(*a):
        return True

    cases = [(same_doc, (True, False)), (head_doc, (True, True)), (captures_h, (False, True)),
             (stores_b_first, (True, False)), (variadic, (True, True)),
             (numba.njit(same_doc), (True, False)), (lambda b, h, i, j, d: i >= j,
                                                     (False, False))]
    class Masks:
        def head_doc(self, b, h, i, j, doc):  # (as a bound method: self, then b)
            return h > 0

    cases.append((Masks().head_doc, (True, True)))
    for fn, want in cases:
        assert _mods.reads_batch_head(fn) == want, fn
    doc = docs(2, 300, [100, 140, 60])
    bm = flashcore.create_block_mask(same_doc, 2, 3, 300, 300, mod_args=(doc,))
    assert bm.shape == (2, 3, 300, 300) and bm.classes.shape == (2, 1, 3, 3)
    bm = flashcore.create_block_mask(head_doc, 2, 3, 300, 300, mod_args=(doc,))
    assert bm.classes.shape == (2, 3, 3, 3)
    q, k, v = inputs(np.random.default_rng(4), B=2, Hq=3, Hkv=1, Nq=300, Nk=300)
    for fn in (same_doc, head_doc):
        got = flashcore.attention(q, k, v, mask_mod=fn, mod_args=(doc,), backend="numba_cpu")
        want = flashcore.attention(q, k, v, mask_mod=fn, mod_args=(doc,),
                                   backend="reference")
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)  # (float64)


def test_varlen_classes_ask_each_sequence_inside_its_ends():
    """With ``lengths`` (a varlen call's rows and keys per sequence) each sequence's mask is
    asked only inside them: a mask reading packed ids through the offsets stays in bounds
    (a NumPy array here: an index past the end would raise in Python and read garbage in
    Numba), tiles past a sequence's end are EMPTY, one table per sequence even for a mask
    that never reads ``b``, and kept classes are keyed by the lengths too."""
    def packed_doc(b, h, i, j, ids, cu):
        return ids[cu[b] + i] == ids[cu[b] + j]

    lens = np.array([11, 19, 3])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = (np.arange(int(cu[-1])) // 4).astype(np.int64)

    def brute(fn, args, lens, nt=3, block=8):
        out = np.zeros((len(lens), 1, nt, nt), np.int8)
        for b, n in enumerate(lens):
            for qt in range(nt):
                for kt in range(nt):
                    seen = [fn(b, 0, i, j, *args) for i in range(qt * block, min(n, qt * block + block))
                            for j in range(kt * block, min(n, kt * block + block))]
                    out[b, 0, qt, kt] = (_mods.EMPTY if not any(seen) else
                                         _mods.FULL if all(seen) else _mods.PARTIAL)
        return out

    got = _mods.block_classes(packed_doc, 3, 2, 24, 24, 8, (ids, cu), lengths=(lens, lens))
    np.testing.assert_array_equal(got, brute(packed_doc, (ids, cu), lens))

    def near(b, h, i, j):  # (reads neither b nor h: still one table per sequence)
        return abs(i - j) < 4

    for order in ([11, 19, 3], [3, 19, 11]):
        got = _mods.block_classes(near, 3, 2, 24, 24, 8, (), remember=True,
                                  lengths=(np.array(order), np.array(order)))
        assert got.shape == (3, 1, 3, 3)
        np.testing.assert_array_equal(got, brute(near, (), order))


def test_create_block_mask_asks_the_gpu_where_the_mod_args_are(monkeypatch):
    """create_block_mask hands the evaluation to a backend's block_classes hook where its
    mod_args are on one CUDA device (``device`` None or that device), with the classes'
    shape for the indices the mask reads; elsewhere, or where the hook declines, the host
    evaluates. (torch CPU tensors stand for GPU ones here.)"""
    import types

    torch = pytest.importorskip("torch")
    from flashcore import _dispatch, _interop

    asked, declines = [], [True]

    def hook(mask_mod, shape, Nq, Nk, block, mod_args, library, device):
        asked.append((shape, library, device))
        return None if declines.pop() else np.full(shape, 7, np.int8)

    monkeypatch.setattr(_interop, "device_of", lambda a, lib: "cuda:0")
    monkeypatch.setattr(_dispatch, "load", lambda name: types.SimpleNamespace(block_classes=hook))
    doc = torch.from_numpy(docs(2, 300, [100, 140, 60]))
    host = flashcore.create_block_mask(same_doc, 2, 3, 300, 300, mod_args=(doc,)).classes
    assert asked == [((2, 1, 3, 3), "torch", "cuda:0")]  # (declined: the host's classes)
    assert set(np.unique(host)) <= {_mods.EMPTY, _mods.PARTIAL, _mods.FULL}
    declines.extend([False] * 5)
    for device, hooked in ((None, True), ("cuda", True), ("cuda:0", True), ("cpu", False),
                           ("cuda:1", False)):
        asked.clear()
        bm = flashcore.create_block_mask(same_doc, 2, 3, 300, 300, mod_args=(doc,),
                                         device=device)
        assert bool(asked) == hooked, device
        assert (bm.classes == 7).all() if hooked else np.array_equal(bm.classes, host)
    asked.clear()
    flashcore.create_block_mask(same_doc, 2, 3, 300, 300, mod_args=(doc.numpy(),))
    assert asked == []  # (NumPy arrays: on the host)


def test_create_block_mask_checks():
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        flashcore.create_block_mask(None, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="Nq must be an int >= 0"):
        flashcore.create_block_mask(same_doc, 1, 1, -1, 4)
    with pytest.raises(ValueError, match="H must be an int >= 1 or None"):
        flashcore.create_block_mask(same_doc, 1, 0, 4, 4)


def test_compile_caches_are_bounded_and_outlive_plan_clears():
    """One compiled kernel per user function, but closures made in a loop do not pile up;
    the caches of compiled code survive _memo.clear_all (which the tests call around each
    test) so kernels are not recompiled."""
    from flashcore import _memo, _mods

    def make(c):
        def mod(s, b, h, i, j):
            return s * c
        return mod

    first = make(1.0)
    kept = _mods.compiled(first)
    assert _mods.compiled(first) is kept
    _memo.clear_all()
    assert _mods.compiled(first) is kept
    for n in range(_mods._COMPILED.max_size + 5):  # (numba.njit compiles lazily: cheap)
        _mods.compiled(make(float(n)))
    assert len(_mods._COMPILED) <= _mods._COMPILED.max_size
