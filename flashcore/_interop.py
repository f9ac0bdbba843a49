"""Which library and device arrays come from, and zero-copy hand-over between libraries.

Nothing here imports a framework to answer a question about an array: array-api-compat
recognises torch, JAX and CuPy arrays only if those libraries are already imported.
The one place that copies between host and device is named for it (:func:`copy_to_host`).
"""
from __future__ import annotations

import ctypes

import numpy as np

_LIBRARY_BY_TYPE: dict = {}
_DTYPE_NAMES: dict = {}


def library_of(x) -> str | None:
    """Short name of the library that owns array ``x`` ("numpy", "torch", "jax", "cupy", ...),
    or None if ``x`` is no array. Cached by type: this runs on every call's hot path."""
    t = type(x)
    lib = _LIBRARY_BY_TYPE.get(t, False)
    if lib is False:
        lib = _LIBRARY_BY_TYPE[t] = _library_of(x) if is_array(x) else None
    return lib


def _library_of(x) -> str:
    import array_api_compat as aac

    if aac.is_numpy_array(x):
        return "numpy"
    if aac.is_torch_array(x):
        return "torch"
    if aac.is_jax_array(x):
        return "jax"
    if aac.is_cupy_array(x):
        return "cupy"
    return type(x).__module__.split(".")[0]


def is_array(x) -> bool:
    import array_api_compat as aac

    return aac.is_array_api_obj(x)


def device_of(x, library: str) -> str:
    """Device of ``x`` as a string: ``"cpu"`` or ``"cuda:N"``."""
    if library == "numpy":
        return "cpu"
    if library == "torch":
        d = x.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"
    if library == "cupy":
        return f"cuda:{x.device.id}"
    if library == "jax":
        devs = x.devices()
        if len(devs) != 1:
            raise ValueError(f"JAX arrays sharded over several devices are not supported: {devs=}")
        (d,) = devs
        return "cpu" if d.platform == "cpu" else f"cuda:{d.id}"
    import array_api_compat as aac

    d = aac.device(x)
    s = str(d)
    return "cpu" if s.lower() in ("cpu", "cpu_device") else s


def dtype_name(x) -> str:
    """Name of ``x``'s dtype ("float32", "bfloat16", ...), whatever library owns it."""
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(dt)
    try:
        _DTYPE_NAMES[dt] = name
    except TypeError:  # an unhashable dtype object
        pass
    return name


def _dtype_name(dt) -> str:
    name = str(dt)
    for prefix in ("torch.", "dtype("):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.strip("')\"")


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name; bfloat16 is ml_dtypes' (NumPy has none)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def namespace(x):
    import array_api_compat as aac

    return aac.array_namespace(x)


# --- host views ---------------------------------------------------------------------------


def host_view(x, library: str) -> np.ndarray:
    """A NumPy view of a CPU array's memory, with no copy (bfloat16 as ml_dtypes.bfloat16).

    Strides are kept: a transposed or sliced torch tensor stays a strided view.
    """
    if library == "numpy":
        return x
    if library == "torch":
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes

            return t.view(_torch().int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if library == "jax":
        # On the CPU, np.asarray of a JAX array shares its buffer (read-only).
        return np.asarray(x)
    return np.from_dlpack(x)


def from_host(a: np.ndarray, library: str, like=None):
    """Hand a NumPy array to ``library`` (zero-copy where the library allows it)."""
    if library == "numpy":
        return a
    if library == "torch":
        torch = _torch()
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if library == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    xp = namespace(like) if like is not None else None
    if xp is not None and hasattr(xp, "from_dlpack"):
        return xp.from_dlpack(a)
    return a


def copy_to_host(x, library: str) -> np.ndarray:
    """A host copy of any array (the only function here that copies device memory)."""
    if library == "cupy":
        return x.get()
    if library == "torch":
        t = x.detach().cpu()
        return host_view(t, "torch")
    if library == "jax":
        return np.asarray(x)
    return np.asarray(x)


def _torch():
    import torch

    return torch


# --- raw buffers (for backends that launch on addresses) -----------------------------------


def contiguous_strides(shape):
    """Element strides of a dense row-major array of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def cuda_raw(x, keep):
    """(address, strides in elements) of a GPU array: from ``__cuda_array_interface__``, or
    where the array has none for its dtype (bfloat16 in JAX), from its DLPack capsule."""
    try:
        cai = x.__cuda_array_interface__
    except Exception:  # noqa: BLE001  (no typestr for bf16: each library raises its own)
        return dlpack_raw(x, keep)
    strides = cai.get("strides")
    if strides is None:
        return cai["data"][0], contiguous_strides(tuple(x.shape))
    item = np.dtype(x.dtype).itemsize
    return cai["data"][0], tuple(s // item for s in strides)


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def dlpack_raw(x, keep):
    """Address and strides from an unconsumed DLPack capsule (kept alive in ``keep`` until
    the kernels are done, which the JAX path waits for)."""
    capsule = x.__dlpack__(stream=None)
    keep.append(capsule)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        strides = contiguous_strides(shape)
    return t.data + t.byte_offset, strides
