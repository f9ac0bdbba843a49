"""The Numba-CUDA backend: FlashAttention-2 kernels written in Python with numba-cuda.

Serves GPU arrays of PyTorch, CuPy and JAX with no copy: kernels read the callers' buffers
through their strides and write into outputs allocated by the caller's own library, on the
caller's current stream (torch's or CuPy's current stream; for JAX, outside ``jit``, the
legacy default stream after the inputs are ready, synchronized before returning, since JAX
cannot be told about work on another stream). NumPy arrays are served only when the caller
names ``backend="numba_cuda"``: they are copied to the GPU and back (under the CUDA
simulator they are used in place).

The package reads in layers, imports running one way (ARCHITECTURE.md has the map):
device code (``device/``: conversions, intrinsics, the kernel prologue and the two seams;
``simt/`` and ``tensor_core/``: the kernel families), kernel variants as data
(``variant.py``, ``tilings.py``), the host side (``driver.py``: libcuda, contexts,
prepared launches; ``launch.py``: which variant serves a launch; ``adapters.py``: one
adapter per array library), and ``autotune.py``, a leaf nothing imports. numba.cuda is
imported on first use, not with this module.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

NAME = "numba_cuda"
#: Largest head dim the kernels are specialized for.
MAX_HEAD_DIM = 256
_DTYPES = ("float32", "float16", "bfloat16")
_GPU_LIBRARIES = ("torch", "cupy", "jax")
#: Oldest compute capability the kernels are built for.
MIN_CC = (7, 0)


@functools.cache
def unavailable_reason():
    """None when numba-cuda and a CUDA GPU are usable (or the CUDA simulator is on)."""
    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed: pip install 'flashcore[cuda]'"
    try:
        from numba import cuda
    except Exception as e:  # noqa: BLE001  (a broken install, e.g. NumPy too new for numba-cuda)
        return f"numba.cuda cannot be imported ({e}): pip install 'flashcore[cuda]'"
    if cuda.config.ENABLE_CUDASIM:
        return None
    try:
        if not cuda.is_available():
            return "no CUDA GPU found (numba.cuda.is_available() is False)"
        # (read from each device's attributes: no context is opened on any GPU)
        ccs = [tuple(gpu.compute_capability) for gpu in cuda.gpus]
    except Exception as e:  # noqa: BLE001  (any driver failure means: not usable here)
        return f"no usable CUDA GPU ({e})"
    if not any(cc >= MIN_CC for cc in ccs):
        return (f"the GPUs have compute capabilities {ccs}; numba_cuda needs "
                f"{MIN_CC[0]}.{MIN_CC[1]} or newer")
    return None


@functools.cache
def _device_reason(device: str):
    """None when GPU ``device`` ("cuda:N") can run the kernels, else why not. Each device
    is asked for itself: a host may mix GPUs of different compute capabilities."""
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        return None
    index = int(device.split(":")[1]) if ":" in device else 0
    try:
        cc = tuple(cuda.gpus[index].compute_capability)
    except Exception as e:  # noqa: BLE001
        return f"{device} is not a usable CUDA GPU ({e})"
    if cc < MIN_CC:
        return (f"{device} has compute capability {cc[0]}.{cc[1]}; numba_cuda needs "
                f"{MIN_CC[0]}.{MIN_CC[1]} or newer")
    return None


def _rocm_reason(library):
    """Why ``library``'s "cuda" arrays are not CUDA ones (a ROCm build), or None."""
    if library == "torch":
        hip = getattr(getattr(sys.modules.get("torch"), "version", None), "hip", None)
        if hip:
            return (f"this PyTorch is a ROCm build (HIP {hip}): its 'cuda' devices are AMD "
                    "GPUs, and numba_cuda's kernels run on NVIDIA GPUs only")
    elif library == "cupy":
        runtime = getattr(getattr(sys.modules.get("cupy"), "cuda", None), "runtime", None)
        if getattr(runtime, "is_hip", False):
            return ("this CuPy is a ROCm build: its devices are AMD GPUs, and numba_cuda's "
                    "kernels run on NVIDIA GPUs only")
    return None


#: mod_args dtypes the kernels take (bool arrays are read as their bytes)
_ARG_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
               "uint16", "uint32", "uint64", "bool")


def _mods_reason(case):
    """Why the kernels cannot take this call's score_mod / mask_mod and mod_args, or None."""
    m = case.mods
    if m is None or (m.score_mod is None and m.mask_mod is None):
        return None
    return _args_reason(case.mod_args)


def _args_reason(mod_args):
    """Why the kernels cannot take these mod_args, or None."""
    from flashcore._interop import dtype_name

    from .device.user_mods import MAX_ARGS, MAX_DIMS  # (imports numba.cuda)
    if len(mod_args) > MAX_ARGS:
        return (f"the CUDA kernels take at most {MAX_ARGS} mod_args; this call has "
                f"{len(mod_args)}")
    for n, a in enumerate(mod_args):
        if len(a.shape) > MAX_DIMS:
            return (f"the CUDA kernels take mod_args of at most {MAX_DIMS} dims; mod_args[{n}] "
                    f"has {len(a.shape)}")
        dt = dtype_name(a)
        if dt not in _ARG_DTYPES:
            return f"the CUDA kernels do not take mod_args[{n}] of dtype {dt}"
    return None


def supports(case):
    """None when this backend can serve ``case``, else why not."""
    if case.packed:
        if case.library == "jax" and not case.on_gpu:  # (before the mods' numba.cuda import)
            return f"jax arrays on {case.device} are not on a CUDA GPU"
        if case.library == "numpy" and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "0":
            return ("the CUDA kernels serve varlen and KV-cache calls on torch, CuPy and "
                    "JAX GPU arrays (NumPy arrays only under the CUDA simulator)")
    why = _mods_reason(case)
    if why is not None:
        return why
    if case.dtype not in _DTYPES:
        return (f"dtype {case.dtype} is not computed by numba_cuda (it computes float32, "
                "float16 and bfloat16 with fp32 accumulation); use backend='reference'")
    if not 1 <= case.head_dim <= MAX_HEAD_DIM:
        return f"head dim {case.head_dim} is outside 1..{MAX_HEAD_DIM}"
    if case.library == "numpy":
        if not case.explicit:
            return ("NumPy arrays live on the host; numba_cuda copies them to the GPU only "
                    "when named explicitly (backend='numba_cuda')")
        why = unavailable_reason() or _device_reason("cuda:0")  # (they are copied to GPU 0)
        if why is not None:
            return why
    elif case.library in _GPU_LIBRARIES:
        if not case.on_gpu:
            return f"{case.library} arrays on {case.device} are not on a CUDA GPU"
        why = _rocm_reason(case.library) or unavailable_reason() or _device_reason(case.device)
        if why is not None:
            return why
    else:
        return f"arrays of {case.library!r} are not supported (torch, cupy, jax or numpy)"
    if case.batch * max(case.heads_q, case.heads_kv) > 65535:
        return (f"batch * heads = {case.batch * case.heads_q} exceeds the CUDA grid limit "
                "65535")
    return None


def forward(q, k, v, case):
    """``(o, lse)``: o in q's library, layout and dtype; lse float32 ``(B, Hq, Nq)``, or
    None where ``case.need_lse`` is False and the kernel wrote it to a scratch buffer
    (small torch calls: one allocation less).

    fp16/bf16 at head dims 32, 64, 96, 128 and 256 run on tensor cores (tensor_core/) unless
    ``FLASHCORE_TENSOR_CORES=0``; every other case, and any the tensor-core kernels
    decline (unaligned rows, GPUs older than sm_80), runs the SIMT kernels."""
    return _adapter(case.library).forward(q, k, v, case)


def backward(do, q, k, v, o, lse, case):
    """``(dq, dk, dv)`` in the inputs' library, layout and dtype (tensor cores as in
    :func:`forward`)."""
    return _adapter(case.library).backward(do, q, k, v, o, lse, case)


def buffer_launcher(view, outputs, stream):
    """Optional contract hook for a framework that owns the buffers (JAX's
    ``buffer_callback`` under ``jit``): an object whose ``forward(q, k, v, case)`` and
    ``backward(do, q, k, v, o, lse, case)`` read their arrays through ``view(x, keep) ->
    (address, strides in elements)``, write into ``outputs`` (o, lse; or dq, dk, dv and a
    float32 (B, Hq, Nq) scratch buffer), and launch on raw stream ``stream``.

    Packed calls (``case.packed``) take the same object: varlen outputs are o, lse
    ``(Hq, total_q)`` (backward: dq, dk, dv and a float32 ``(Hq, max(1, total_q))``
    scratch); a KV-cache call's are o, lse, then optionally two float32 split-KV partial
    buffers ``(S, B*Hq*Nq, D)`` and ``(S, B*Hq*Nq)`` that bound its splits to ``S``, and it
    appends into the k_cache and v_cache it is given. Index arrays must be int32 buffers;
    ``cache_seqlens + n_new`` is ``cache_seqlens.shifted(n_new)``, a buffer the framework
    computed. ``read(x, device)`` copies a lent buffer to the host on ``stream`` (after the
    work queued there: the offsets and lengths the host checks need)."""
    from .adapters import BufferLauncher

    return BufferLauncher(view, outputs, stream)


def block_classes(mask_mod, shape, Nq, Nk, block, mod_args, library, device):
    """Optional contract hook: the int8 tile classes of ``shape`` (``(B or 1, H or 1, query
    tiles, key tiles)``, tiles of ``block`` rows) of ``mask_mod`` evaluated on GPU
    ``device`` ("cuda:N") where its ``mod_args`` (arrays of ``library``, at least one)
    live, as a NumPy array; None where this backend cannot evaluate them there (the caller
    then evaluates them on the host). flashcore.create_block_mask asks it."""
    if not mod_args or unavailable_reason() is not None:
        return None
    from numba import cuda

    sim = cuda.config.ENABLE_CUDASIM  # (NumPy arrays stand for GPU ones there)
    if ((library not in _GPU_LIBRARIES and not (sim and library == "numpy"))
            or _device_reason(device) is not None or _rocm_reason(library) is not None
            or _args_reason(mod_args) is not None):
        return None
    from . import classes
    from .adapters import _device_index

    return classes.on_device(_adapter(library), mask_mod, shape, Nq, Nk, block, mod_args,
                             library, _device_index(device))


_ADAPTERS = None  # adapters.ADAPTERS, once imported (numba.cuda comes with it)


def _adapter(library):
    global _ADAPTERS
    if _ADAPTERS is None:
        from .adapters import ADAPTERS

        _ADAPTERS = ADAPTERS
    return _ADAPTERS[library]

