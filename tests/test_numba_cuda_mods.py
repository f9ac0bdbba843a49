"""The user's ``score_mod`` / ``mask_mod`` (with ``mod_args``) in the CUDA kernels (SIMT and
tensor-core; forward, dK/dV, dQ): under numba's CUDA simulator on small shapes, compiled
to PTX for sm_90 without a GPU, and on a GPU, each against the float64 reference with the
same functions.

The mods here are plain Python, as users write them: a relative-position bias read from a
table, document masking by per-token ids, a softcap written out, a prefix-LM mask; each
case also combines them with the built-in options (causal, window, softcap, ALiBi).
"""
from __future__ import annotations

import importlib.util
import math
import os
import zlib

import numpy as np
import pytest
from helpers import TOL_BWD, TOL_FWD, qkv, rand, rel_err, run_under_simulator

import flashcore

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
pytestmark = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")

CAP = 1.7


def rel_bias(s, b, h, i, j, table):
    """A learned relative-position bias (T5-like), one row per head."""
    return s + table[h, i - j + table.shape[1] // 2]


def capped(s, b, h, i, j):
    """The softcap, written as a score_mod."""
    return CAP * math.tanh(s / CAP)


def hypot_mod(s, b, h, i, j):
    """A smooth mod flashcore._derive does not differentiate (math.hypot): the kernels take
    its derivative by the finite difference."""
    return math.hypot(s, 1.0) - 1.0


def same_doc(b, h, i, j, doc):
    """Document masking of packed sequences: a query sees keys of its own document."""
    return doc[b, i] == doc[b, j]


def head_docs(b, h, i, j, doc):
    """Document masking whose documents differ per query head (so do its tile classes)."""
    return doc[b, h, i] == doc[b, h, j]


def prefix_lm(b, h, i, j, prefix):
    """Prefix-LM: bidirectional within the first prefix[b] tokens, causal after."""
    return j <= i or j < prefix[b]


def squared(s, b, h, i, j, doc):
    """A nonlinear mod that reads an array too (and takes every mod_args, as mods do)."""
    return s * s * 0.25 + (0.5 if doc[b, j] == 0 else 0.0)


def kink(s, b, h, i, j):
    """The identity, but for a slope that is infinite at s = 0 exactly: the score of a
    tile's padding (zero rows of Q or K) and of nothing else here. What a kernel computes
    past the ends or under a mask must not reach the gradients (0 x inf)."""
    return s + math.sqrt(abs(s)) * (s == 0.0)


def holes(b, h, i, j):
    """A mask_mod hiding every fifth key from every query (the "holes" cases zero those
    keys' K rows, so that each hidden score is exactly 0: ``kink``'s infinite slope)."""
    return j % 5 != 0


#: "hdocs": the two cuts between each query head's three documents (shifted by the batch
#: index): within a GQA group of two, each head sees block rows the other does not.
HEAD_CUTS = ((16, 32), (8, 24), (12, 28), (20, 35))

# (shapes; mods: "rel" bias table, "cap", "doc" ids, "prefix" lengths, "sq" nonlinear,
# "hdocs" documents per query head, "kink" an infinite slope at 0; built-ins: causal,
# window, softcap, alibi)
SIMT_CASES = [
    dict(B=1, Hq=2, Hkv=1, Nq=13, Nk=19, D=8, dtype="float32", causal=True, layout="bhnd",
         mods="rel"),
    dict(B=2, Hq=2, Hkv=2, Nq=12, Nk=12, D=16, dtype="float32", causal=False, layout="bnhd",
         mods="doc", softcap=1.3),
    dict(B=2, Hq=2, Hkv=1, Nq=11, Nk=11, D=4, dtype="float16", causal=False, layout="bhnd",
         mods="prefix", alibi=True),
    dict(B=1, Hq=1, Hkv=1, Nq=10, Nk=14, D=8, dtype="float32", causal=False, layout="bhnd",
         mods="sq", window=(4, 3)),
    # (cb: the tile classes' block, made small here so that the simulator sees every class
    # on few rows; the kernels on a GPU compile it as 128, as the cases marked slow run it)
    dict(B=1, Hq=1, Hkv=1, Nq=40, Nk=40, D=4, dtype="float32", causal=False, layout="bhnd",
         mods="blocks", split=18, cb=8, block_mask=True),
    pytest.param(dict(B=1, Hq=1, Hkv=1, Nq=300, Nk=300, D=4, dtype="float32", causal=False,
                      layout="bhnd", mods="blocks", split=140, block_mask=True),
                 marks=pytest.mark.slow),
    # GQA under a mask_mod: a dK/dV block's query range is the union of its group's heads'
    # (whole block rows are empty for some key blocks; the heads' classes differ, or with a
    # head-free BlockMask they share one)
    dict(B=2, Hq=4, Hkv=2, Nq=36, Nk=40, D=4, dtype="float32", causal=True, layout="bhnd",
         mods="hdocs", cuts=HEAD_CUTS, cb=8),
    dict(B=2, Hq=4, Hkv=2, Nq=40, Nk=40, D=4, dtype="float32", causal=False, layout="bnhd",
         mods="blocks", split=18, cb=8, block_mask=True),
    # (tails: Nq, Nk past a tile's end; causal: masked scores. fp16: the float32 twin, whose
    # NumPy scalars divide by zero as a GPU does, where the simulator's Python floats raise)
    dict(B=1, Hq=2, Hkv=1, Nq=21, Nk=27, D=8, dtype="float16", causal=True, layout="bhnd",
         mods="kink"),
    # (scores hidden by a mask_mod and exactly 0: the slope there must not reach dS)
    dict(B=1, Hq=2, Hkv=1, Nq=16, Nk=20, D=8, dtype="float16", causal=False, layout="bnhd",
         mods="kink+holes"),
]
TC_CASES = [
    dict(B=1, Hq=2, Hkv=1, Nq=40, Nk=52, D=32, dtype="bfloat16", causal=True, layout="bhnd",
         mods="cap"),
    dict(B=2, Hq=2, Hkv=1, Nq=37, Nk=37, D=32, dtype="float16", causal=False, layout="bnhd",
         mods="doc", window=(20, 9)),
    dict(B=1, Hq=2, Hkv=2, Nq=33, Nk=33, D=32, dtype="bfloat16", causal=False, layout="bhnd",
         mods="rel+prefix", softcap=2.0, alibi=True),
    dict(B=1, Hq=1, Hkv=1, Nq=70, Nk=70, D=32, dtype="float16", causal=True, layout="bhnd",
         mods="blocks", split=20, cb=16),
    pytest.param(dict(B=1, Hq=1, Hkv=1, Nq=290, Nk=290, D=32, dtype="float16", causal=True,
                      layout="bhnd", mods="blocks", split=140), marks=pytest.mark.slow),
    # (cb 8 below the 16-row steps: a narrowed query range starts on its step's grid)
    dict(B=1, Hq=4, Hkv=2, Nq=48, Nk=48, D=32, dtype="bfloat16", causal=False, layout="bhnd",
         mods="hdocs", cuts=HEAD_CUTS, cb=8, block_mask="heads"),
    dict(B=1, Hq=2, Hkv=1, Nq=40, Nk=70, D=32, dtype="float16", causal=True, layout="bhnd",
         mods="kink"),
    dict(B=1, Hq=2, Hkv=1, Nq=32, Nk=48, D=32, dtype="float16", causal=False, layout="bhnd",
         mods="kink+holes"),
]


def _case_id(c):
    if not isinstance(c, dict):  # (a pytest.param)
        c = c.values[0]
    return "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", "")


def _inputs(c):
    rng = np.random.default_rng(zlib.crc32(_case_id(c).encode()))
    q, k, v = qkv(rng, B=c["B"], Hq=c["Hq"], Hkv=c["Hkv"], Nq=c["Nq"], Nk=c["Nk"], D=c["D"],
                  dtype=c["dtype"], layout=c["layout"])
    do = rand(rng, (c["B"], c["Hq"], c["Nq"], c["D"]), c["dtype"], c["layout"])
    if "holes" in c["mods"]:  # (the hidden keys' rows zero: their scores exactly 0)
        keys = k[:, ::5] if c["layout"] == "bnhd" else k[:, :, ::5]
        keys[...] = 0
    return q, k, v, do, _mods(c, rng)


def _mods(c, rng):
    """(score_mod, mask_mod, mod_args) of the case, arrays made from ``rng``."""
    B, Hq, Nq, Nk = c["B"], c["Hq"], c["Nq"], c["Nk"]
    names = c["mods"].split("+")
    score_mod = mask_mod = None
    args = []
    if "rel" in names:
        score_mod = rel_bias
        args.append(rng.standard_normal((Hq, 2 * max(Nq, Nk) + 1)).astype(np.float32))
    if "cap" in names:
        score_mod = capped
    if "doc" in names:
        mask_mod = same_doc
        # three documents of uneven lengths per batch entry
        cuts = np.sort(rng.choice(np.arange(1, Nk), size=2, replace=False))
        doc = np.zeros((B, Nk), np.int32)
        for b in range(B):
            doc[b, cuts[0] + b:] += 1
            doc[b, cuts[1]:] += 1
        args.append(doc)
    if "blocks" in names:  # two documents, split at row c["split"]: blocks of tile classes
        mask_mod = same_doc  # that are empty, full and partial
        doc = np.zeros((B, Nk), np.int32)
        doc[:, c["split"]:] = 1
        args.append(doc)
    if "hdocs" in names:
        mask_mod = head_docs
        doc = np.zeros((B, Hq, Nk), np.int32)
        for b in range(B):
            for h in range(Hq):
                for cut in c["cuts"][h]:
                    doc[b, h, cut + b:] += 1
        args.append(doc)
    if "prefix" in names:
        mask_mod = prefix_lm
        args.append(np.arange(3, 3 + 4 * B, 4).astype(np.int64))
    if "hyp" in names:
        score_mod = hypot_mod
    if "kink" in names:
        score_mod = kink
    if "holes" in names:
        mask_mod = holes
    if "sq" in names:
        score_mod = squared
        args.append((rng.random((B, Nk)) < 0.5).astype(np.int32))
    if score_mod is not None and mask_mod is not None and args:  # each takes every mod_args
        s0, m0 = score_mod, mask_mod
        score_mod = _takes_all(s0, 0, len(args))
        mask_mod = _takes_all(m0, 1, len(args))
    return score_mod, mask_mod, tuple(args)


def _takes_all(fn, which, n):
    """``fn`` (reading mod_args[which]) as a mod that takes all ``n`` mod_args: what a user
    writes when one call has a score_mod and a mask_mod reading different arrays."""
    assert n == 2
    if fn is rel_bias:
        def rel_bias_all(s, b, h, i, j, table, prefix):
            return s + table[h, i - j + table.shape[1] // 2]
        return rel_bias_all

    if fn is same_doc:
        def same_doc_all(b, h, i, j, table, doc):
            return doc[b, i] == doc[b, j]
        return same_doc_all

    def prefix_lm_all(b, h, i, j, table, prefix):
        return j <= i or j < prefix[b]
    return prefix_lm_all


def _slopes(c):
    if not c.get("alibi"):
        return None
    return (2.0 ** (-8.0 * np.arange(1, c["Hq"] + 1) / c["Hq"])).astype(np.float32)


_BLOCK_MASKS: dict = {}


def _opts(c, mods):
    score_mod, mask_mod, args = mods
    bm = None
    if c.get("block_mask"):  # one BlockMask per case, as a model makes one per mask
        key = _case_id(c)
        if key not in _BLOCK_MASKS:
            heads = c["Hq"] if c["block_mask"] == "heads" else None
            _BLOCK_MASKS[key] = flashcore.create_block_mask(mask_mod, c["B"], heads, c["Nq"],
                                                            c["Nk"], mod_args=args)
        bm = _BLOCK_MASKS[key]
        assert 0 < bm.sparsity() < 1, bm
    return dict(causal=c["causal"], layout=c["layout"], window=c.get("window"),
                softcap=c.get("softcap"), alibi_slopes=_slopes(c), score_mod=score_mod,
                mask_mod=mask_mod, mod_args=args, block_mask=bm)


def _reference(q, k, v, do, c, mods):
    x64 = [np.asarray(x, dtype=np.float64) for x in (q, k, v, do)]
    o, lse = flashcore.attention_forward(*x64[:3], backend="reference", **_opts(c, mods))
    grads = flashcore.attention_backward(x64[3], *x64[:3], o, lse, backend="reference",
                                         **_opts(c, mods))
    return o, lse, grads


def _check(q, k, v, do, c, mods, o, lse, grads):
    ro, rl, rg = _reference(q, k, v, do, c, mods)
    o = np.asarray(o, dtype=np.float64)
    assert rel_err(o, ro) < TOL_FWD[c["dtype"]], rel_err(o, ro)
    fin = np.isfinite(rl)
    lse = np.asarray(lse)
    assert np.array_equal(np.isfinite(lse), fin)
    tol_lse = 1e-4 if c["dtype"] == "float32" else 1e-3
    assert np.abs(lse[fin] - rl[fin]).max() < tol_lse
    for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
        e = rel_err(np.asarray(g, dtype=np.float64), r)
        assert e < TOL_BWD[c["dtype"]], f"{name}: {e}"


def _run(c, monkeypatch):
    if "cb" in c:  # (simulator only: the block is a compile-time constant on a GPU)
        from flashcore.backends.numba_cuda.device import seams

        from flashcore import _mods

        monkeypatch.setattr(seams, "CLASS_BLOCK", c["cb"])
        monkeypatch.setattr(_mods, "BLOCK", c["cb"])
    q, k, v, do, mods = _inputs(c)
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **_opts(c, mods))
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda",
                                         **_opts(c, mods))
    _check(q, k, v, do, c, mods, o, lse, grads)


if not SIM:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("family", ["simt", "tensor_core"])
    def test_mods_under_simulator(family, request):
        """Runs the cases below in a subprocess with the simulator on."""
        run_under_simulator(request, __file__, f"sim_{family}",
                            tensor_cores=family != "simt")

else:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", SIMT_CASES, ids=_case_id)
    def test_sim_simt(c, monkeypatch):
        _run(c, monkeypatch)

    @pytest.mark.cudasim
    @pytest.mark.parametrize("c", TC_CASES, ids=_case_id)
    def test_sim_tensor_core(c, monkeypatch):
        from flashcore.backends.numba_cuda import launch

        served = []
        real = launch._serves  # (what each call takes, kept per kind of call or not)
        monkeypatch.setattr(launch, "_serves",
                            lambda *a: served.append(real(*a)[0]) or real(*a))
        _run(c, monkeypatch)
        assert served == [True, True]


def _classes_on_the_device(mask_mod, mod_args, B, Hq, Nq, Nk, dtype, monkeypatch):
    """The tile classes a numba_cuda call without a BlockMask evaluates (the simulator's
    kernel, on NumPy inputs), the host's (``_mods.block_classes``) for the same mask, and
    whether the call copied a mod_args array to the host."""
    from flashcore.backends.numba_cuda import adapters

    from flashcore import _mods
    from flashcore._checks import make_case

    q = np.zeros((B, Hq, Nq, 8), dtype)
    k = np.zeros((B, 1, Nk, 8), dtype)
    opts = {"window": None, "softcap": None, "alibi_slopes": None, "score_mod": None,
            "mask_mod": mask_mod, "mod_args": mod_args, "block_mask": None}
    case = make_case(q, k, k, causal=False, scale=None, layout="bhnd", explicit=True,
                     options=opts)
    ad = adapters.ADAPTERS["numpy"]
    copied = []
    monkeypatch.setattr(type(ad), "host_copy", lambda self, x, c: copied.append(x) or x,
                        raising=False)
    keep = []
    at, sb, sh, sq = ad.tile_classes(case, q, keep, ad.mod_args(case, keep))
    host = _mods.block_classes(mask_mod, B, Hq, Nq, Nk, _mods.BLOCK,
                               tuple(np.ascontiguousarray(a) for a in mod_args))
    got = np.asarray(at[:host.size]).reshape(host.shape)
    assert (sb, sh, sq) == (0 if host.shape[0] == 1 else host[0].size,
                            0 if host.shape[1] == 1 else host[0, 0].size, host.shape[3])
    return got, host, copied


if SIM:

    @pytest.mark.cudasim
    @pytest.mark.parametrize("dtype,block", [(np.float32, 8), (np.float16, 8),
                                             (np.float16, 16)])
    def test_sim_simt_tile_classes_evaluated_on_the_device(dtype, block, monkeypatch):
        """A call without a BlockMask evaluates its mask_mod's classes with the kernels'
        own device function, on the device (no host copy of its mod_args), to the classes
        the host computes: tails past a tile, every class, masks that read ``h`` or not,
        and a mask without mod_args. (Blocks of 8 or 16 rows: the simulator runs each
        element; at 16, a thread's rows take several steps.)"""
        from flashcore.backends.numba_cuda.device import seams

        from flashcore import _mods

        monkeypatch.setattr(seams, "CLASS_BLOCK", block)
        monkeypatch.setattr(_mods, "BLOCK", block)
        rng = np.random.default_rng(5)
        doc = np.repeat(np.arange(4, dtype=np.int32), [7, 12, 3, 11])[None].repeat(2, 0)
        doc[1] = np.roll(doc[1], 5)
        hdoc = np.sort(rng.integers(0, 3, (2, 3, 33)), axis=-1).astype(np.int64)
        cases = [(same_doc, (doc,), (2, 1)), (head_docs, (hdoc,), (2, 3)),
                 (holes, (), (1, 1)), (prefix_lm, (np.array([5, 20], np.int32),), (2, 1))]
        for mask_mod, args, shape in cases:
            got, host, copied = _classes_on_the_device(mask_mod, args, 2, 3, 33, 33, dtype,
                                                       monkeypatch)
            assert host.shape[:2] == shape
            np.testing.assert_array_equal(got, host, err_msg=mask_mod.__name__)
            assert copied == []
        seen = _classes_on_the_device(same_doc, (doc,), 2, 3, 33, 33, dtype, monkeypatch)[0]
        assert set(seen.ravel().tolist()) == {_mods.EMPTY, _mods.PARTIAL, _mods.FULL}

    @pytest.mark.cudasim
    def test_sim_simt_large_tile_classes_kept_by_contents(monkeypatch):
        """Past DEVICE_EVALS evaluations a call keeps its classes by its mod_args' contents:
        new contents are evaluated on the device (once), equal contents are not again."""
        from flashcore.backends.numba_cuda import classes
        from flashcore.backends.numba_cuda.device import seams

        from flashcore import _mods

        monkeypatch.setattr(seams, "CLASS_BLOCK", 8)
        monkeypatch.setattr(_mods, "BLOCK", 8)
        monkeypatch.setattr(classes, "DEVICE_EVALS", 0)
        monkeypatch.setattr(_mods, "_CLASSES", {})
        launched = []
        real = classes.launch_classify
        monkeypatch.setattr(classes, "launch_classify",
                            lambda *a: launched.append(1) or real(*a))
        hdoc = np.sort(np.random.default_rng(6).integers(0, 3, (2, 3, 33)), axis=-1)
        for n, arr in enumerate((hdoc, hdoc.copy(), hdoc[:, ::-1].copy())):
            got, host, copied = _classes_on_the_device(head_docs, (arr,), 2, 3, 33, 33,
                                                       np.float16, monkeypatch)
            np.testing.assert_array_equal(got, host)
            assert len(copied) == 1 + (n != 1)  # (the ids; the classes of a miss)
        assert len(launched) == 2  # (the first and the third contents)


if SIM:

    @pytest.mark.cudasim
    def test_sim_simt_block_classes_hook(monkeypatch):
        """numba_cuda's block_classes hook (create_block_mask's GPU evaluation) gives the
        host's classes, and declines what its kernels cannot take."""
        from flashcore.backends import numba_cuda
        from flashcore.backends.numba_cuda.device import seams

        from flashcore import _mods

        monkeypatch.setattr(seams, "CLASS_BLOCK", 8)
        doc = np.repeat(np.arange(4, dtype=np.int32), [7, 12, 3, 11])[None].repeat(2, 0)
        doc[1] = np.roll(doc[1], 5)
        want = _mods.block_classes(same_doc, 2, 1, 33, 30, 8, (doc,))
        got = numba_cuda.block_classes(same_doc, want.shape, 33, 30, 8, (doc,), "numpy", "cpu")
        np.testing.assert_array_equal(got, want)
        assert numba_cuda.block_classes(same_doc, want.shape, 33, 30, 8, (), "numpy",
                                        "cpu") is None
        deep = np.zeros((1,) * 5, np.int32)
        assert numba_cuda.block_classes(same_doc, want.shape, 33, 30, 8, (deep,), "numpy",
                                        "cpu") is None


@pytest.mark.gpu
def test_create_block_mask_on_gpu(monkeypatch):
    """create_block_mask with mod_args on a GPU evaluates the mask there (numba_cuda's
    hook), to the classes the host gives for the same ids, and an attention call with it
    matches the call without a BlockMask."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from flashcore.backends import numba_cuda

    from flashcore import _mods

    asked = []
    real = numba_cuda.block_classes
    monkeypatch.setattr(numba_cuda, "block_classes", lambda *a: asked.append(1) or real(*a))
    doc = np.repeat(np.arange(5, dtype=np.int32), [300, 700, 128, 900, 372])[None]
    doc = np.concatenate([doc, np.roll(doc, 77, axis=1)])
    tdoc = torch.from_numpy(doc).cuda()
    for fn, H in ((same_doc, None), (head_docs, 3)):
        ids = tdoc if fn is same_doc else tdoc[:, None].repeat(1, 3, 1).contiguous()
        bm = flashcore.create_block_mask(fn, 2, H, 2400, 2400, mod_args=(ids,))
        host = _mods.block_classes(fn, 2, H or 1, 2400, 2400, _mods.BLOCK,
                                   (ids.cpu().numpy(),))
        np.testing.assert_array_equal(bm.classes, host)
    assert len(asked) == 2
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 3, 2400, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    a = flashcore.attention(q, k, v, block_mask=bm, mod_args=(ids,))
    b = flashcore.attention(q, k, v, mask_mod=head_docs, mod_args=(ids,))
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_classes_kept_by_contents_on_gpu(monkeypatch):
    """The classes kept by mod_args' contents (``DEVICE_EVALS`` lowered to 0) are those
    the GPU evaluated, copied to the host after its kernel: for JAX arrays (a stream of
    its own for the copy) and torch ones, the outputs equal those of the classes evaluated
    per call, and the kept classes the host's."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    if not torch.cuda.is_available() or not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no CUDA GPU for torch and JAX")
    import jax.numpy as jnp
    from flashcore.backends.numba_cuda import classes

    from flashcore import _mods

    B, H, N, D = 1, 4, 2048, 64
    ids = (np.arange(N) // 300).astype(np.int32)[None]
    rng = np.random.default_rng(8)
    host = [rng.standard_normal((B, H, N, D)).astype(np.float16) for _ in range(3)]
    want = _mods.block_classes(head_docs, B, H, N, N, _mods.BLOCK,
                               (ids[:, None].repeat(H, 1),))
    for lib in ("jax", "torch"):
        if lib == "jax":
            q, k, v = (jnp.asarray(x) for x in host)
            args = (jnp.asarray(ids[:, None].repeat(H, 1)),)
        else:
            q, k, v = (torch.from_numpy(x).cuda() for x in host)
            args = (torch.from_numpy(ids[:, None].repeat(H, 1)).cuda(),)
        outs = []
        for evals in (1 << 30, 0):
            monkeypatch.setattr(classes, "DEVICE_EVALS", evals)
            monkeypatch.setattr(_mods, "_CLASSES", {})
            o, _ = flashcore.attention_forward(q, k, v, mask_mod=head_docs, mod_args=args,
                                               backend="numba_cuda")
            outs.append(np.asarray(o.cpu() if lib == "torch" else o).astype(np.float32))
        ((_, kept),) = next(iter(_mods._CLASSES.values()))[:1]
        np.testing.assert_array_equal(kept, want, err_msg=lib)
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=lib)


def test_numba_cuda_takes_user_mods(monkeypatch):
    """numba_cuda serves score_mod / mask_mod with mod_args from NumPy, torch and CuPy
    arrays, and declines, naming why, what its kernels do not take (on any host: the
    GPU's availability is taken as given)."""
    from flashcore import _dispatch
    from flashcore._checks import make_case

    q = np.zeros((1, 2, 8, 16), np.float32)
    impl = _dispatch.load("numba_cuda")
    monkeypatch.setattr(impl, "unavailable_reason", lambda: None)
    monkeypatch.setattr(impl, "_device_reason", lambda device: None)

    def case(**opts):
        options = {"window": None, "softcap": None, "alibi_slopes": None, "score_mod": None,
                   "mask_mod": None, "mod_args": (), "block_mask": None, **opts}
        return make_case(q, q, q, causal=False, scale=None, layout="bhnd", explicit=True,
                         options=options)

    doc = np.zeros((1, 8), np.int32)
    assert impl.supports(case(score_mod=capped)) is None
    assert impl.supports(case(mask_mod=same_doc, mod_args=(doc,), window=(2, 2))) is None
    many = tuple(np.zeros(3, np.float32) for _ in range(5))
    assert "at most 4 mod_args" in impl.supports(case(score_mod=capped, mod_args=many))
    deep = np.zeros((1, 1, 1, 1, 2), np.float32)
    assert "at most 4 dims" in impl.supports(case(score_mod=capped, mod_args=(deep,)))


def test_float32_twin_keeps_scores_in_float32():
    """The mod the kernels call computes in float32: float constants, float closure cells
    and float globals become float32, and (16-bit variants) math.tanh the approximate
    instruction; the user's function itself is left as it was."""
    from flashcore.backends.numba_cuda.device import user_mods

    cap = 3.0

    def closure(s, b, h, i, j):
        return cap * math.tanh(s / cap) + 0.5

    for fn in (closure, capped):
        twin = user_mods.float32_twin(fn, approx=False)
        out = twin(np.float32(0.3), 0, 0, 1, 2)
        assert isinstance(out, np.float32), type(out)
        assert abs(float(out) - fn(0.3, 0, 0, 1, 2)) < 1e-6
    assert type(closure(np.float32(0.3), 0, 0, 1, 2)) is not np.float32
    assert CAP == 1.7 and type(capped.__globals__["CAP"]) is float


@pytest.mark.skipif(SIM, reason="compiles PTX for a real architecture")
@pytest.mark.parametrize("dtype,head_dim", [
    ("bfloat16", 128), pytest.param("float32", 64, marks=pytest.mark.slow)])
def test_user_mod_variants_compile_to_ptx(dtype, head_dim, monkeypatch):
    """Every kernel of a case class with a score_mod, a mask_mod and a mod_args array
    compiles for sm_90 without a GPU, with the parameters the launch packs; the mod's
    arithmetic stays float32, forward and backward (no float64 tanh: the twin's tanh is the
    approximate instruction at 16 bits)."""
    import re
    import types as pytypes

    import numba.cuda.dispatcher as nd
    from flashcore.backends.numba_cuda import classes, driver, launch
    from flashcore.backends.numba_cuda.variant import UserMods
    from numba import cuda

    monkeypatch.setattr(nd, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    user = UserMods(_takes_all(rel_bias, 0, 2), _takes_all(prefix_lm, 1, 2),
                    (("float32", 2), ("int64", 1)))
    for v in launch.case_variants(head_dim, dtype, True, (9, 0), user=user):
        if v.kernel == "preprocess":
            continue
        assert user.label in v.tag
        sig = launch.signature(v.entry, v.dtype, user.args)
        ptx, _ = cuda.compile_ptx(launch.build(v), sig, cc=(9, 0), fastmath=driver.FASTMATH,
                                  **driver.jit_options(v.launch_bounds))
        entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
        assert len(re.findall(r"\.param\s+\.(\w+)", entry.group(1))) == len(sig)
        # (the backward's derivative too: the forward-mode twin stays in float32)
        assert "cvt.f64.f32" not in ptx or dtype == "float32", v.tag
    # the classification of the mask_mod's tiles (a call without a BlockMask)
    v = classes.classify_variant(user.mask_mod, user.args, dtype, 128)
    sig = launch.signature(v.entry, v.dtype, user.args)
    ptx, _ = cuda.compile_ptx(launch.build(v), sig, cc=(9, 0), fastmath=driver.FASTMATH)
    entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
    assert len(re.findall(r"\.param\s+\.(\w+)", entry.group(1))) == len(sig)
    assert "bar.red.or" in ptx and "bar.red.and" in ptx


def _torch_case(c, torch):
    q, k, v, do, mods = _inputs(c)
    dt = getattr(torch, c["dtype"])
    to = lambda x: torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda().to(dt)  # noqa: E731
    score_mod, mask_mod, args = mods
    targs = tuple(torch.from_numpy(a).cuda() for a in args)
    slopes = _slopes(c)
    opts = dict(_opts(c, mods), mod_args=targs,
                alibi_slopes=None if slopes is None else torch.from_numpy(slopes).cuda())
    return (to(q), to(k), to(v), to(do)), (q, k, v, do), mods, opts


GPU_CASES = [
    dict(B=2, Hq=4, Hkv=2, Nq=700, Nk=700, D=128, dtype="bfloat16", causal=True,
         layout="bnhd", mods="cap"),
    dict(B=2, Hq=4, Hkv=4, Nq=600, Nk=600, D=64, dtype="float16", causal=False,
         layout="bhnd", mods="doc", window=(200, 100)),
    dict(B=1, Hq=4, Hkv=2, Nq=500, Nk=650, D=128, dtype="bfloat16", causal=False,
         layout="bhnd", mods="rel+prefix", softcap=20.0, alibi=True),
    dict(B=2, Hq=2, Hkv=1, Nq=400, Nk=400, D=64, dtype="float32", causal=True,
         layout="bhnd", mods="rel"),
    dict(B=2, Hq=2, Hkv=2, Nq=300, Nk=450, D=64, dtype="float32", causal=False,
         layout="bnhd", mods="sq"),
    dict(B=1, Hq=2, Hkv=2, Nq=500, Nk=500, D=96, dtype="float16", causal=True,
         layout="bhnd", mods="doc"),
    # the finite-difference derivative, where the forward-mode twin cannot be written
    dict(B=1, Hq=2, Hkv=1, Nq=300, Nk=300, D=64, dtype="bfloat16", causal=True,
         layout="bhnd", mods="hyp"),
    dict(B=1, Hq=2, Hkv=1, Nq=200, Nk=260, D=64, dtype="float32", causal=False,
         layout="bhnd", mods="hyp"),
    # documents per query head (a GQA group's heads leave different tiles empty: the
    # dK/dV kernel's steps of each head), and two documents with empty, full and partial
    # tiles; causal, a score_mod beside it (on an H100/H200 the wgmma backward)
    dict(B=1, Hq=4, Hkv=2, Nq=640, Nk=640, D=64, dtype="bfloat16", causal=False,
         layout="bhnd", mods="hdocs", cuts=((200, 400), (100, 300), (300, 520), (150, 450))),
    dict(B=2, Hq=2, Hkv=1, Nq=520, Nk=520, D=128, dtype="float16", causal=True,
         layout="bnhd", mods="blocks+rel", split=384),
    # head dim 256: the wgmma dK/dV kernel's two blocks per key tile, each half the columns
    dict(B=1, Hq=2, Hkv=1, Nq=300, Nk=330, D=256, dtype="bfloat16", causal=True,
         layout="bhnd", mods="doc"),
    # an infinite slope at the padding's score 0 (rows and keys past a tile's end; causal):
    # wgmma at D=128 on an H100/H200, mma.sync elsewhere, and SIMT fp32
    dict(B=1, Hq=2, Hkv=1, Nq=300, Nk=333, D=128, dtype="bfloat16", causal=True,
         layout="bhnd", mods="kink"),
    dict(B=1, Hq=2, Hkv=1, Nq=77, Nk=90, D=64, dtype="float32", causal=True,
         layout="bhnd", mods="kink"),
]


def _gpu_and_backward_launches(monkeypatch):
    """``(torch, ran)`` on a CUDA GPU (else the test skipped), with the default kernel
    choice (no FLASHCORE_HOPPER, _HOPPER_BWD or _DETERMINISTIC) and ``ran`` the names of
    the dK/dV and dQ kernels launched."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from flashcore.backends.numba_cuda import launch
    from hopper_helpers import spy_launches

    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV, launch.DETERMINISTIC_ENV):
        monkeypatch.delenv(name, raising=False)
    return torch, spy_launches(monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=_case_id)
def test_user_mods_on_gpu(c, monkeypatch):
    """Forward and backward with the user's mods on torch CUDA tensors (tensor cores for
    fp16/bf16, CUDA cores for fp32; on an H100/H200 the wgmma backward at head dims 64, 128
    and 256) against the float64 reference."""
    torch, ran = _gpu_and_backward_launches(monkeypatch)
    (q, k, v, do), host, mods, opts = _torch_case(c, torch)
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **opts)
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
    hopper = (torch.cuda.get_device_capability() == (9, 0) and c["dtype"] != "float32"
              and c["D"] in (64, 128, 256))
    assert (ran == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"]) == hopper, ran
    torch.cuda.synchronize()
    hq, hk, hv, hdo = (x.float().cpu().numpy() for x in (q, k, v, do))
    _check(hq, hk, hv, hdo, c, mods, o.float().cpu().numpy(), lse.cpu().numpy(),
           [g.float().cpu().numpy() for g in grads])


def thirds(b, h, i, j):
    """A mask_mod of no arrays: every third (query, key) pair hidden."""
    return (i + j) % 3 != 0


def doc_and_bias(s, b, h, i, j, docs, bias):
    """A per-sequence bias table read by a score_mod (``bias[b, h]``)."""
    return s + bias[b, h]


def same_sequence_doc(b, h, i, j, docs, bias):
    """Documents inside each packed sequence (ids per sequence row)."""
    return docs[b, i] == docs[b, j]


#: (sequence offsets, heads q/kv, D, dtype, mods) of the varlen GPU test: a mask_mod of
#: no arrays (every tile partial), and documents inside the sequences (empty, full and
#: partial tiles per sequence) with a per-sequence bias at D=128
VARLEN_MODS = {"thirds": ([0, 70, 70, 260, 300], (4, 2), 64, "float16"),
               "docs": ([0, 40, 340, 900], (4, 1), 128, "bfloat16"),
               # (causal at D=128: tilings.HOPPER_BWD_USER_VARLEN's dQ tiling)
               "docs-causal": ([0, 40, 340, 900], (4, 1), 128, "bfloat16"),
               # (the mask_mod alone, with the bulk copies: on an H100/H200 the persistent
               # forward, tilings.MASK_MOD_PERSISTENT)
               "docs-mask-persistent": ([0, 40, 340, 900, 1500], (4, 2), 128, "bfloat16")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARLEN_MODS))
def test_varlen_user_mods_on_gpu(monkeypatch, name):
    """Packed sequences with a score_mod and a mask_mod on torch CUDA tensors, forward and
    backward, against the float64 reference; on an H100/H200 their backward runs the
    wgmma kernels (tile classes per sequence), elsewhere the mma.sync ones."""
    torch, ran = _gpu_and_backward_launches(monkeypatch)
    persistent = name.endswith("persistent")
    if persistent:
        from flashcore.backends.numba_cuda import tilings
        from hopper_helpers import spy_launches

        monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (a small call: the copies)
        fwd = spy_launches(monkeypatch, ("launch_forward",),
                           name=lambda kern: kern._dispatcher.py_func.__qualname__)
    rng = np.random.default_rng(11)
    offsets, (hq, hkv), D, dtype = VARLEN_MODS[name]
    cu = np.array(offsets, np.int32)
    total = int(cu[-1])
    dt = getattr(torch, dtype)
    host = [rng.standard_normal((total, h, D)).astype(np.float32) for h in (hq, hkv, hkv, hq)]
    q, k, v, do = (torch.from_numpy(x).cuda().to(dt) for x in host)
    if name == "thirds":
        opts, args = dict(causal=True, score_mod=capped, mask_mod=thirds), ()
    else:
        longest = int(np.diff(cu).max())
        steps = np.arange(1, 2 * len(cu) - 1, 2)[:len(cu) - 1, None]  # (1, 3, 5, ...)
        docs = (np.arange(longest)[None, :] * steps // 400).astype(np.int32)
        bias = rng.standard_normal((len(cu) - 1, hq)).astype(np.float32)
        args = (docs, bias)
        opts = dict(causal=name != "docs", score_mod=None if persistent else doc_and_bias,
                    mask_mod=same_sequence_doc)
    cut = torch.from_numpy(cu).cuda()
    dev_args = tuple(torch.from_numpy(a).cuda() for a in args)
    o, lse = flashcore.attention_varlen_forward(q, k, v, cut, cut, backend="numba_cuda",
                                                mod_args=dev_args, **opts)
    grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cut, cut,
                                                backend="numba_cuda", mod_args=dev_args, **opts)
    kind = "wgmma" if torch.cuda.get_device_capability() == (9, 0) else "tc"
    assert ran == [f"attn_backward_dkdv_{kind}", f"attn_backward_dq_{kind}"], ran
    if persistent and kind == "wgmma":
        assert f"_{tilings.MASK_MOD_PERSISTENT[D].tag}_" in fwd[-1], fwd
    x64 = [x.double().cpu().numpy() for x in (q, k, v, do)]
    ro, rl = flashcore.attention_varlen_forward(*x64[:3], cu, cu, backend="reference",
                                                mod_args=args, **opts)
    refs = flashcore.attention_varlen_backward(x64[3], *x64[:3], ro, rl, cu, cu,
                                               backend="reference", mod_args=args, **opts)
    assert rel_err(o.double().cpu().numpy(), ro) < TOL_FWD[dtype]
    for gname, g, r in zip(("dq", "dk", "dv"), grads, refs):
        e = rel_err(g.double().cpu().numpy(), r)
        assert e < TOL_BWD[dtype], f"{gname}: {e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_softcap_as_score_mod_matches_builtin_on_gpu(dtype):
    """A softcap written as a score_mod gives what the built-in softcap gives (the same
    kernels otherwise; both approximate tanh at 16 bits), forward and backward."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    q, k, v, do = (torch.randn(2, 4, 512, 128, device="cuda", generator=g).mul(1.5).to(dt)
                   for _ in range(4))
    out = []
    for opts in (dict(softcap=CAP), dict(score_mod=capped)):
        o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cuda",
                                             **opts)
        grads = flashcore.attention_backward(do, q, k, v, o, lse, causal=True,
                                             backend="numba_cuda", **opts)
        out.append([o, *grads])
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), *out):
        e = rel_err(a.float().cpu().numpy(), b.float().cpu().numpy())
        assert e < tol, f"{name}: {e}"


def test_mods_here_take_the_derivative_they_are_meant_to():
    """hypot_mod covers the finite difference, the others the forward-mode twin."""
    from flashcore._derive import value_and_slope

    assert value_and_slope(hypot_mod) is None
    for fn in (rel_bias, capped, squared):
        assert value_and_slope(fn) is not None, fn.__name__


def test_float32_twin_turns_divisions_by_constants_into_products():
    """At 16 bits the twin multiplies by a constant's float32 reciprocal instead of dividing
    (a MUFU op per score fewer), the constant written out, in a closure cell or a global
    (``CAP``: its load's inline caches become NOPs); divisions by anything else stay, and the values agree to
    float32 rounding."""
    import dis

    from flashcore.backends.numba_cuda.device.user_mods import float32_twin

    def make(cap):
        def mod(s, b, h, i, j):
            return (s / 7.0 + (s / 3.0 if i > j else s) + s / cap - 1.0 / s - s / b
                    + s / CAP - abs(s / CAP))
        return mod

    fn = make(5.0)
    divisions = lambda f: sum(x.opname == "BINARY_OP" and x.argrepr == "/"  # noqa: E731
                              for x in dis.get_instructions(f))
    assert divisions(fn) == 7
    assert divisions(float32_twin(fn, True)) == 2  # 1.0 / s and s / b
    assert divisions(float32_twin(fn, False)) == 7
    for s in (1.5, -2.25, 1e3):
        for i, j in ((1, 0), (0, 1)):
            want = fn(s, 2, 0, i, j)
            got = float32_twin(fn, True)(np.float32(s), 2, 0, i, j)
            assert got == pytest.approx(want, rel=4e-7, abs=4e-7 * abs(s))
