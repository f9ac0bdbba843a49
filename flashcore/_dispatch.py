"""The backend registry: an explicit table of names, the "auto" order, and selection.

Every backend is a module that answers one small contract:

``unavailable_reason() -> str | None``
    None when the backend can run on this machine, else why not (missing extra, no GPU).
``supports(case) -> str | None``
    None when it can serve this :class:`~flashcore._case.Case`, else the reason.
``forward(q, k, v, case) -> (o, lse)``
``backward(do, q, k, v, o, lse, case) -> (dq, dk, dv)``
    Arrays in and out belong to the caller's library and device; ``o`` has q's layout
    and dtype, ``lse`` is ``(B, Hq, Nq)`` of ``_rules.lse_dtype`` (float64 for float64
    inputs, else float32).
    Packed calls use the same two functions: with ``case.varlen`` q, k, v are packed
    ``(total, H, D)`` and lse is ``(Hq, total_q)``; with ``case.kvcache`` k and v are the
    cache, the forward first appends ``case.kvcache.k_new``/``v_new`` to it in place, and
    there is no backward (see :class:`~flashcore._case.Varlen`, :class:`~flashcore._case.KVCache`).
    A backend that serves neither declines ``case.packed`` in ``supports``.
``buffer_launcher(view, outputs, stream)`` (optional)
    For a framework that owns the buffers and the stream (JAX's ``buffer_callback`` under
    ``jit``): an object with the same ``forward``/``backward`` that reads arrays through
    ``view(x, keep) -> (address, strides)`` and writes into ``outputs``. Backends without
    it cannot run inside ``jax.jit`` on a GPU.

``block_classes(mask_mod, shape, Nq, Nk, block, mod_args, library, device)`` (optional)
    A mask_mod's int8 tile classes of ``shape`` evaluated where its ``mod_args`` live (a
    GPU), as a NumPy array, or None where the backend cannot; ``create_block_mask`` asks
    numba_cuda's and otherwise evaluates on the host.

Modules are imported only when first asked, so ``import flashcore`` pulls in no framework.
"""
from __future__ import annotations

import functools
import importlib

from ._errors import BackendUnavailableError

#: name -> (module, pip extra that provides what it needs)
REGISTRY = {
    "numba_cuda": ("flashcore.backends.numba_cuda", "cuda"),
    "numba_cpu": ("flashcore.backends.numba_cpu", None),
    "torch": ("flashcore.backends.torch_sdpa", "torch"),
    "jax": ("flashcore.backends.jax_dpa", "jax"),
    "reference": ("flashcore.reference", None),
}

#: The order "auto" tries: flashcore's own kernels first (numba_cuda serves GPU arrays,
#: numba_cpu host arrays), then the framework kernels for cases ours decline, then the
#: reference, which materializes the score matrix and so declines large inputs unless named.
AUTO_ORDER = ("numba_cuda", "numba_cpu", "torch", "jax", "reference")


@functools.cache
def load(name: str):
    """Import a backend module; raise BackendUnavailableError if it cannot be imported."""
    module, extra = REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # a dependency is missing
        hint = f'; install it with pip install "flashcore[{extra}]"' if extra else ""
        raise BackendUnavailableError(f"backend {name!r} cannot be imported ({e}){hint}") from e
    if name == "numba_cpu":  # before its cache=True kernels are defined (first call)
        from . import _numba_cache

        _numba_cache.install()
    return mod


def unavailable_reason(name: str) -> str | None:
    try:
        mod = load(name)
    except BackendUnavailableError as e:
        return str(e)
    return mod.unavailable_reason()


def available_backends() -> dict:
    """``{name: None if usable here, else the reason why not}`` for every backend."""
    return {name: unavailable_reason(name) for name in REGISTRY}


def select(case, backend: str):
    """The backend module that serves ``case``: the one named, or the first in AUTO_ORDER."""
    if backend == "auto":
        reasons = {}
        for name in AUTO_ORDER:
            # supports() first: it is cheap, while probing availability may load a GPU runtime.
            try:
                why = load(name).supports(case) or load(name).unavailable_reason()
            except BackendUnavailableError as e:
                why = str(e)
            if why is None:
                return load(name)
            reasons[name] = why
        lines = "\n".join(f"  {n}: {r}" for n, r in reasons.items())
        raise BackendUnavailableError(f"no backend can serve this call:\n{lines}")
    if not isinstance(backend, str) or backend not in REGISTRY:
        raise ValueError(f"{backend=} is not one of {('auto', *REGISTRY)}")
    why = unavailable_reason(backend)
    if why is not None:
        raise BackendUnavailableError(f"backend {backend!r} is unavailable here: {why}")
    mod = load(backend)
    why = mod.supports(case)
    if why is not None:
        raise BackendUnavailableError(f"backend {backend!r} cannot serve this call: {why}")
    return mod
