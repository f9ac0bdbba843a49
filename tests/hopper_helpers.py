"""What the wgmma kernels' GPU tests share (test_numba_cuda_hopper for the forward,
test_numba_cuda_hopper_bwd for the backward): the skip where there is no cc 9.0 GPU, the
shapes, compiling the variants a module runs once per machine under pytest-xdist, the
inputs on the GPU and a spy on the launches."""
from __future__ import annotations

import os
import tempfile

import pytest

#: (B, Hq, Hkv, Nq, Nk, layout): tails (N not a multiple of 128), GQA 4:2, Nq != Nk both
#: ways (Nq > Nk causal: rows that see no key), several tiles, both layouts.
SHAPES = [(2, 4, 2, 300, 300, "bhnd"), (1, 4, 2, 200, 333, "bnhd"),
          (1, 2, 2, 333, 200, "bhnd"), (1, 2, 1, 1024, 1024, "bnhd"), (1, 1, 1, 1, 77, "bhnd")]

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


def lazy_keys(k, layout):
    """Keys (NumPy, bhnd or bnhd) scaled 5x from key 200 and 5.5x from key 400, so that under
    lazy rescaling (``HopperTiles.lazy``) some warps' maxima grow past 2^8 after their first
    key tile and others' do not (:func:`lazy_steps`)."""
    import numpy as np

    axis = 2 if layout == "bhnd" else 1
    n = np.arange(k.shape[axis])
    jump = np.where(n < 200, 1.0, np.where(n < 400, 5.0, 5.5)).astype(np.float32)
    shape = [1] * k.ndim
    shape[axis] = -1
    return (k.astype(np.float32) * jump.reshape(shape)).astype(k.dtype)


def lazy_steps(q, k, BN, causal, layout="bhnd"):
    """``(grow, keep)``: how many (warp, key tile) steps after a warp's first tile would
    rescale under lazy rescaling and how many would keep their maxima: per warp of 16 query
    rows (Hq a multiple of Hkv), whether some row's running max of ``q kᵀ scale log2 e``
    (float64, bottom-right causal) grows by more than ``hopper/forward.LAZY_LOG2``."""
    import numpy as np
    from flashcore.backends.numba_cuda.hopper.forward import LAZY_LOG2

    q, k = (np.asarray(x).astype(np.float64) for x in (q, k))
    if layout == "bnhd":
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    B, Hq, Nq, D = q.shape
    Nk, group = k.shape[2], Hq // k.shape[1]
    s = np.einsum("bhnd,bhmd->bhnm", q, np.repeat(k, group, axis=1)) * D ** -0.5
    s *= np.log2(np.e)
    if causal:
        s[..., np.arange(Nk)[None, :] > np.arange(Nq)[:, None] + Nk - Nq] = -np.inf
    grow = keep = 0
    for w0 in range(0, Nq, 16):
        m = np.full((B, Hq, min(16, Nq - w0)), -np.inf)
        for n0 in range(0, Nk, BN):
            new = np.maximum(m, s[:, :, w0:w0 + 16, n0:n0 + BN].max(axis=-1))
            with np.errstate(invalid="ignore"):
                g = ((new - m) > LAZY_LOG2).any(axis=-1)  # per (b, h) warp
            first = np.isinf(m).all(axis=-1)
            grow += int((g & ~first).sum())
            keep += int((~g & ~first).sum())
            m = np.where(g[..., None], new, m)
    return grow, keep
