"""The array libraries the bench runs on: importing each lazily, whether it can reach a
device here, and how to wait for its results.

Every framework is imported inside a function, the first time a contender or a probe needs
it, so ``import flashcore.bench`` pulls in no framework.
"""
from __future__ import annotations

import importlib.util
import os

LIBRARIES = ("numpy", "torch", "jax", "cupy")


def import_torch():
    import torch

    return torch


def import_jax():
    # JAX would otherwise grab 75% of GPU memory at start-up, starving every other contender.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    return jax


def has_module(name: str) -> bool:
    """Whether ``name`` is installed, answered without importing it."""
    return importlib.util.find_spec(name) is not None


def library_reason(library: str, device: str) -> str | None:
    """None if ``library`` is installed and reaches ``device`` ("cpu" or "cuda:N"), else why
    not."""
    if library != "numpy" and not has_module(library):
        return f"{library} is not installed"
    if device == "cpu":
        return None
    if library == "torch":
        torch = import_torch()
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA GPU"
        return None
    if library == "jax":
        jax = import_jax()
        try:
            jax.devices("gpu")
        except RuntimeError:
            return "JAX sees no GPU"
        return None
    if library == "cupy":
        try:
            import cupy

            return None if cupy.cuda.runtime.getDeviceCount() > 0 else "CuPy sees no GPU"
        except Exception as e:  # CUDA driver missing
            return f"CuPy cannot reach a GPU ({type(e).__name__})"
    return f"no GPU support for {library}"


def gpu_library() -> str | None:
    """The library GPU inputs of flashcore's CUDA backend are made in (PyTorch, else CuPy),
    or None where neither reaches a GPU."""
    if has_module("torch") and library_reason("torch", "cuda:0") is None:
        return "torch"
    if has_module("cupy") and library_reason("cupy", "cuda:0") is None:
        return "cupy"
    return None


def sync_for(library: str, device: str):
    """A ``sync(outputs)`` that waits until ``library`` has computed ``outputs`` on
    ``device``, or None where results are ready when the call returns."""
    if device == "cpu":
        if library == "jax":  # JAX dispatches asynchronously on the CPU too
            return lambda out: import_jax().block_until_ready(out)
        return None
    if library == "torch":
        torch = import_torch()
        return lambda out: torch.cuda.synchronize(torch.device(device))
    if library == "jax":
        return lambda out: import_jax().block_until_ready(out)
    if library == "cupy":
        import cupy

        return lambda out: cupy.cuda.get_current_stream().synchronize()
    return None


def timer_for(library: str, device: str) -> str:
    """"cuda_event" for PyTorch on a GPU (device time, no host jitter), else "perf_counter"."""
    return "cuda_event" if (library == "torch" and device != "cpu") else "perf_counter"


def gpu_memory_for(library: str, device: str) -> str | None:
    """Whose allocator reports the peak device memory of a run, where one can."""
    if device == "cpu":
        return None
    return {"torch": "torch", "jax": "jax"}.get(library)


def gpu_free_bytes(device: str) -> int | None:
    """Free memory on a CUDA ``device`` as PyTorch sees it, or None where it cannot tell."""
    try:
        torch = import_torch()
        return torch.cuda.mem_get_info(torch.device(device))[0]
    except Exception:  # no torch, or no CUDA through torch
        return None


def array_device(x):
    import array_api_compat

    return array_api_compat.device(x)
