"""Every CUDA kernel variant compiles to PTX for sm_80 and sm_90, without a GPU.

``numba.cuda.compile_ptx`` needs only NVVM (the toolkit wheels of ``numba-cuda[cu13]``).
A variant is one (kernel, head-dim tiling class, dtype, causal) as ``launch.simt_variants``
builds it for a launch. Besides compiling, each check reads the PTX for what the host side
and the speed rely on: the parameter list the raw launch packs, and no local memory (the
register tiles must stay in registers).
"""
from __future__ import annotations

import os
import re
import types as pytypes

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0"):
    pytest.skip("compile_ptx needs the real numba.cuda, not the CUDA simulator",
                allow_module_level=True)

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


def _toolkit_reason():
    try:
        def probe(x):
            x[0] = 1.0

        from numba.cuda import types

        cuda.compile_ptx(probe, (types.float32[:],), cc=(9, 0))
    except Exception as e:  # noqa: BLE001  (NVVM missing: the toolkit wheels are not installed)
        return f"the CUDA toolkit (NVVM) is not importable: {type(e).__name__}: {e}"
    return None


_REASON = _toolkit_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

from flashcore.backends.numba_cuda import driver, launch
from flashcore.backends.numba_cuda import tilings as tiles
from ptx_addresses import narrowed_addresses

#: One head dim per tiling class of tilings.choose_simt, plus dims that are not a multiple of the
#: thread columns (padded head-dim columns).
CLASS_DIMS = (64, 128, 256)
ODD_DIMS = (5, 100)
DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture
def target_cc(monkeypatch, request):
    """Device helpers (``@overload``s) are compiled while their caller is typed, and numba
    asks the current GPU for its compute capability then; without a GPU, answer with the
    target's."""
    import numba.cuda.dispatcher as nd

    cc = request.param
    monkeypatch.setattr(nd, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=cc))
    return cc


def _check(cc, head_dim, dtype, causal, only=None):
    kt = tiles.choose_simt(head_dim, dtype, causal, cc)
    for v in launch.simt_variants(head_dim, dtype, causal, kt):
        name, sig, smem_words, threads, bounds = (v.entry, launch.signature(v.entry, dtype),
                                                  v.smem_words, v.threads, v.launch_bounds)
        if only is not None and name not in only:
            continue
        ptx, _ = cuda.compile_ptx(launch.build(v), sig, cc=cc, fastmath=driver.FASTMATH,
                                  **driver.jit_options(bounds))
        arch = f"sm_{cc[0]}{cc[1]}"
        assert f".target {arch}" in ptx, f"{name}: not compiled for {arch}"
        entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
        assert entry, f"{name}: no kernel entry in the PTX"
        params = re.findall(r"\.param\s+\.(\w+)", entry.group(1))
        assert len(params) == len(sig), f"{name}: {len(params)} PTX parameters for {len(sig)}"
        assert all(p in ("u64", "b64", "s64", "f64") for p in params), (
            f"{name}: the raw launch packs 8-byte words; PTX has {set(params)}")
        assert "ld.local" not in ptx and "st.local" not in ptx, (
            f"{name} ({head_dim=}, {dtype}, {causal=}) spills register tiles to local memory")
        assert not narrowed_addresses(ptx), (
            f"{name} ({head_dim=}, {dtype}, {causal=}) computes global addresses in 32 bits: "
            f"{narrowed_addresses(ptx)[:3]}")
        assert smem_words * 4 <= tiles.SMEM_LIMIT[cc], (
            f"{name}: {smem_words * 4} bytes of shared memory, over {arch}'s")
        assert threads <= 1024
        if v.kernel == "preprocess" and head_dim % v.tiles.elements(dtype) == 0:
            assert re.search(r"ld\.global\.v4\.(u32|f32)", ptx), (
                f"{name} ({head_dim=}, {dtype}): no 16-byte loads of O and dO")
        if bounds:  # compiled for several blocks per SM: they must fit side by side
            assert re.search(rf"\.minnctapersm\s+{bounds[1]}\b", ptx), f"{name}: no bounds"
            assert tiles.blocks_fit(smem_words, bounds[1], cc), (
                f"{name}: {bounds[1]} blocks of {smem_words * 4} bytes do not fit an SM")


#: The (head dim, dtype, causal) combinations CI compiles for sm_90: each tiling class with
#: both causal modes and two dtypes, each dtype with both causal modes. The other twelve are
#: marked slow (``nox -s tests-cuda-compile`` runs them all).
CI_SM90 = {(64, "float32", False), (64, "bfloat16", True), (128, "float16", False),
           (128, "float32", True), (256, "bfloat16", False), (256, "float16", True)}
#: sm_80 in CI: the two larger classes (sm_80's shared memory is the smaller), one causal
#: mode each.
CI_SM80 = {(128, False), (256, True)}
#: Padded head dims in CI: 100 (padded inside the 128 class); 5 is slow.
CI_ODD = {100}


def _maybe_slow(values, in_ci, id_):
    return pytest.param(*values, id=id_, marks=() if in_ci else pytest.mark.slow)


def _causal_id(causal):
    return "causal" if causal else "full"


@pytest.mark.parametrize("target_cc", [(9, 0)], indirect=True, ids=["sm90"])
@pytest.mark.parametrize("head_dim,dtype,causal", [
    _maybe_slow((d, t, c), (d, t, c) in CI_SM90, f"D{d}-{t}-{_causal_id(c)}")
    for d in CLASS_DIMS for t in DTYPES for c in (False, True)])
def test_ptx_sm90(target_cc, head_dim, dtype, causal):
    # the preprocess kernel does not depend on causality: compile it once
    only = None if not causal else ("attn_forward", "attn_backward_dkdv", "attn_backward_dq")
    _check(target_cc, head_dim, dtype, causal, only)


@pytest.mark.parametrize("target_cc", [(8, 0)], indirect=True, ids=["sm80"])
@pytest.mark.parametrize("head_dim,causal", [
    _maybe_slow((d, c), (d, c) in CI_SM80, f"D{d}-{_causal_id(c)}")
    for d in CLASS_DIMS for c in (False, True)])
def test_ptx_sm80(target_cc, head_dim, causal):
    # sm_80 gets the same tilings as sm_90 and the dtype changes only the loads and stores
    # (covered above): one dtype per class keeps this file within CI's time on two cores
    only = None if not causal else ("attn_forward", "attn_backward_dkdv", "attn_backward_dq")
    _check(target_cc, head_dim, "bfloat16", causal, only)


@pytest.mark.parametrize("target_cc", [(9, 0)], indirect=True, ids=["sm90"])
@pytest.mark.parametrize("head_dim", [_maybe_slow((d,), d in CI_ODD, f"D{d}")
                                      for d in ODD_DIMS])
def test_ptx_padded_head_dims(target_cc, head_dim):
    _check(target_cc, head_dim, "float16", True)


def test_the_address_check_finds_32_bit_indexing():
    # The check itself: the same store indexed in 64 bits passes, in 32 bits it is found.
    import numba
    from numba.cuda import types

    def narrow(p, row, stride):  # (numba widens int32 * int32 to int64: cast it back)
        p[numba.int32(numba.int32(row) * numba.int32(stride)) + cuda.threadIdx.x] = 1.0

    def wide(p, row, stride):
        p[row * stride + cuda.threadIdx.x] = 1.0

    def divided(p, n, heads):  # LLVM divides in 32 bits when the operands fit: exact
        p[(n // heads) * n + n % heads] = 1.0

    sig = (types.CPointer(types.float32), types.int64, types.int64)
    found = {f.__name__: narrowed_addresses(cuda.compile_ptx(f, sig, cc=(9, 0))[0])
             for f in (narrow, wide, divided)}
    assert found["narrow"] and "st.global" in found["narrow"][0]
    assert found["wide"] == [] and found["divided"] == []
