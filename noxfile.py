"""One nox session per backend, plus lint and bench.

Each session installs flashcore with only the extras it needs and selects its tests by pytest
marker (markers are declared in pyproject.toml). The sessions that need no GPU are what CI
runs::

    nox -s tests-numpy tests-cudasim tests-cuda-compile tests-torch tests-jax lint

Framework pins can be overridden from the environment (``FLASHCORE_TORCH``, say
``FLASHCORE_TORCH="torch==2.13.0"``): an unpinned torch makes pip resolve the newest one,
which is a download of several GB.
"""
from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests-numpy", "tests-cudasim", "tests-cuda-compile", "tests-torch",
                        "tests-jax", "lint"]
nox.options.reuse_existing_virtualenvs = True

#: Explicit pins for the frameworks (see the module docstring).
TORCH = os.environ.get("FLASHCORE_TORCH", "torch==2.13.0")
JAX = os.environ.get("FLASHCORE_JAX", "jax")
JAX_GPU = os.environ.get("FLASHCORE_JAX_GPU", "jax[cuda13]")
#: Tests of these markers need something a session must install on purpose.
FRAMEWORK_MARKERS = "gpu or cudasim or torch or jax or cupy"


def _pytest(session, marker, *, env=None):
    session.run("pytest", "-m", marker, *session.posargs, env=env or {})


@nox.session(name="tests-numpy")
def tests_numpy(session):
    """NumPy arrays on the CPU: front end, reference, numba_cpu, CLI.

    Usage: ``nox -s tests-numpy [-- PYTEST_ARGS]``
    """
    session.install("-e", ".[test]")
    _pytest(session, f"not ({FRAMEWORK_MARKERS})")


@nox.session(name="tests-cudasim")
def tests_cudasim(session):
    """The CUDA kernels under numba's CUDA simulator (no GPU needed; slow, so small sizes).

    Usage: ``nox -s tests-cudasim [-- PYTEST_ARGS]``
    """
    session.install("-e", ".[cudasim,test]")
    _pytest(session, "cudasim and not gpu", env={"NUMBA_ENABLE_CUDASIM": "1"})


@nox.session(name="tests-cuda-compile")
def tests_cuda_compile(session):
    """numba_cuda on a host without a GPU: every kernel variant compiled to PTX for sm_80
    and sm_90 (NVVM and ptxas from numba-cuda's toolkit wheels; no driver), and the host
    side (launch, autotuner tables). CI's command runs a few PTX cases of each kind and
    leaves the rest, marked slow, to this session.

    Usage: ``nox -s tests-cuda-compile [-- PYTEST_ARGS]``
    """
    session.install("-e", ".[cuda,test]")
    files = sorted(str(p) for p in Path("tests").glob("test_numba_cuda_*.py"))
    session.run("pytest", "-m", f"not ({FRAMEWORK_MARKERS})", *files,
                *session.posargs)


@nox.session(name="tests-torch")
def tests_torch(session):
    """PyTorch on the CPU: autograd, torch.compile, opcheck, the "torch" backend.

    Usage: ``nox -s tests-torch [-- PYTEST_ARGS]``  (``FLASHCORE_TORCH`` overrides the pin)
    """
    session.install(TORCH)
    session.install("-e", ".[test]", TORCH)  # the pin again, so pip keeps that torch
    _pytest(session, "torch and not gpu")


@nox.session(name="tests-jax")
def tests_jax(session):
    """JAX on the CPU: custom_vjp, jit, vmap, the "jax" backend.

    Usage: ``nox -s tests-jax [-- PYTEST_ARGS]``  (``FLASHCORE_JAX`` overrides the pin)
    """
    session.install("-e", ".[jax,test]", JAX)
    _pytest(session, "jax and not gpu")


@nox.session(name="tests-distributed")
def tests_distributed(session):
    """Ring attention: torch.distributed with gloo in 2-4 CPU processes, JAX shard_map on
    4 forced host devices (on a GPU host, ``tools/gpu_session.sh`` runs the NCCL case).

    Usage: ``nox -s tests-distributed [-- PYTEST_ARGS]``
    """
    session.install(TORCH)
    session.install("-e", ".[jax,test]", TORCH, JAX)
    _pytest(session, "distributed and not gpu")


@nox.session(name="tests-cupy")
def tests_cupy(session):
    """CuPy arrays on a CUDA GPU (the numba_cuda backend on CuPy's current stream).

    Usage: ``nox -s tests-cupy [-- PYTEST_ARGS]``  (needs an NVIDIA GPU and driver)
    """
    session.install("-e", ".[cuda,cupy,test]")
    _pytest(session, "cupy")


@nox.session(name="tests-gpu")
def tests_gpu(session):
    """Everything marked ``gpu``: numba_cuda kernels, torch CUDA streams and devices, JAX's
    buffer_callback under jit, CuPy. Installs the CUDA builds of the frameworks.

    Usage: ``nox -s tests-gpu [-- PYTEST_ARGS]``  (needs an NVIDIA GPU and driver;
    ``FLASHCORE_TORCH`` / ``FLASHCORE_JAX_GPU`` override the framework pins)
    """
    session.install("-e", ".[cuda,cupy,test]", TORCH, JAX_GPU)
    _pytest(session, "gpu")


@nox.session
def lint(session):
    """ruff over the whole repository.

    Usage: ``nox -s lint [-- RUFF_ARGS]``
    """
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def bench(session):
    """Benchmarks: the side-by-side sweep (``python -m flashcore bench``), the wrapper
    overhead of the PyTorch and JAX glue (tools/bench_wrappers.py), and asv if asked.

    Usage: ``nox -s bench [-- sweep|wrappers|asv ...]`` (default: sweep and wrappers)
    """
    session.install("-e", ".[bench,jax]", TORCH)
    what = session.posargs or ["sweep", "wrappers"]
    if "sweep" in what:
        session.run("python", "-m", "flashcore", "bench")
    if "wrappers" in what:
        session.run("python", "tools/bench_wrappers.py")
    if "asv" in what:
        session.run("asv", "run", "--config", "asv_bench/asv.conf.json", "--python=same",
                    "--quick")
