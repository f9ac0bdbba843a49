"""What the wgmma kernels' GPU tests share (test_numba_cuda_hopper for the forward,
test_numba_cuda_hopper_bwd for the backward): the skip where there is no cc 9.0 GPU, the
shapes, compiling the variants a module runs once per machine under pytest-xdist, the
inputs on the GPU and a spy on the launches; and the user's mods of the backward's tests
(taking both of their mod_args: a bias table and per-token document ids)."""
from __future__ import annotations

import math
import os
import tempfile

import pytest

#: (B, Hq, Hkv, Nq, Nk, layout): tails (N not a multiple of 128), GQA 4:2, Nq != Nk both
#: ways (Nq > Nk causal: rows that see no key), several tiles, both layouts.
SHAPES = [(2, 4, 2, 300, 300, "bhnd"), (1, 4, 2, 200, 333, "bnhd"),
          (1, 2, 2, 333, 200, "bhnd"), (1, 2, 1, 1024, 1024, "bnhd"), (1, 1, 1, 1, 77, "bhnd")]

def rel_bias(s, b, h, i, j, table, doc):
    """A relative-position bias per query head (a score_mod reading an array)."""
    return s + table[h, i - j + table.shape[1] // 2]


def kink(s, b, h, i, j, table, doc):
    """The identity but for an infinite slope at s = 0 exactly (the padding's score)."""
    return s + math.sqrt(abs(s)) * (s == 0.0)


def same_doc(b, h, i, j, table, doc):
    """Document masking (a mask_mod reading per-token ids)."""
    return doc[b, i] == doc[b, j]


#: One lock for every module's compiles: one pool of compiling processes (each with a CUDA
#: context) on the machine at a time; a pool per xdist worker at once ran the GPU out of
#: memory for contexts.
LOCK = os.path.join(tempfile.gettempdir(), "flashcore-hopper-test.lock")


def hopper_gpu_or_skip(what):
    """torch, where a cc 9.0 GPU and the backend are there (else the test is skipped,
    saying that ``what`` needs one)."""
    from flashcore.backends import numba_cuda

    reason = numba_cuda.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip(f"{what} needs compute capability 9.0 (H100/H200)")
    return torch


def compile_once(todo, name):
    """Compile the variants ``todo`` in parallel processes (numba's disk cache) unless this
    machine already did for ``name``: under pytest-xdist every worker asks, one compiles
    while the others wait on :data:`LOCK`, then they load from the disk cache."""
    import fcntl

    from flashcore._warmup import compile_variants

    todo = sorted(todo, key=lambda v: v.tag)
    path = os.path.join(tempfile.gettempdir(), name)
    done = "\n".join(v.tag for v in todo)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path + ".done") as f:
                skip = f.read() == done
        except OSError:
            skip = False
        if not skip:
            compile_variants(todo, 0)
            with open(path + ".done", "w") as f:
                f.write(done)


def spy_launches(monkeypatch, fns=("launch_dkdv", "launch_dq"), name=lambda kern: kern.name):
    """The list that ``name(kernel)`` of every launch through ``launch.<fn>`` (numba_cuda's
    launch module) is appended to."""
    from flashcore.backends.numba_cuda import launch

    ran = []
    for fn in fns:
        real = getattr(launch, fn)

        def spy(kern, *a, real=real, **kw):
            ran.append(name(kern))
            return real(kern, *a, **kw)

        monkeypatch.setattr(launch, fn, spy)
    return ran


def no_persistent(monkeypatch):
    """Empty ``tilings.PERSISTENT_TABLES`` (PERSISTENT, WINDOW_PERSISTENT,
    VARLEN_PERSISTENT, MASK_MOD_PERSISTENT) for the test (in place: the names are re-exported from
    ``hopper/tilings.py``, whose ``choose_hopper`` reads its own, so setting the
    re-exported name would change nothing)."""
    from flashcore.backends.numba_cuda import tilings

    for table in tilings.PERSISTENT_TABLES:
        for key in list(table):
            monkeypatch.delitem(table, key)


def gpu_inputs(torch, shape, head_dim, dtype, seed):
    """q, k, v, do of ``shape`` (B, Hq, Hkv, Nq, Nk, layout), standard normal from a CUDA
    generator seeded with ``seed``, in ``dtype`` and the shape's layout."""
    B, Hq, Hkv, Nq, Nk, layout = shape
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def t(h, n):
        x = torch.randn((B, h, n, head_dim), device="cuda", generator=gen).to(tdt)
        return x if layout == "bhnd" else x.transpose(1, 2).contiguous()

    return t(Hq, Nq), t(Hkv, Nk), t(Hkv, Nk), t(Hq, Nq)


def compile_sm90a(v, sig):
    """The PTX of kernel variant ``v`` for sm_90a with the launch's options (fastmath,
    launch bounds), or the test skipped where the CUDA toolkit's NVVM is not importable."""
    from flashcore.backends.numba_cuda import driver, launch
    from numba import cuda

    try:
        ptx, _ = cuda.compile_ptx(launch.build(v), sig, cc=(9, 0, "a"),
                                  fastmath=driver.FASTMATH,
                                  **driver.jit_options(v.launch_bounds))
    except Exception as e:
        if "NVVM" in str(e) or "libnvvm" in str(e).lower():
            pytest.skip(f"the CUDA toolkit (NVVM) is not importable: {e}")
        raise
    return ptx
