"""One adapter per array library: buffer addresses and strides (zero-copy), output
allocation by the caller's library, and the stream to launch on.

Each framework is imported only inside its adapter, which is used only for arrays of that
framework (so it is already imported).
"""
from __future__ import annotations

import math

import numpy as np

from flashcore import _poison
from flashcore._interop import cuda_raw

from . import launch
from .convert import SIMULATOR


def _device_index(case) -> int:
    d = case.device
    return int(d.split(":")[1]) if ":" in d else 0


class _Adapter:
    """The passes, written once; subclasses say how to see, allocate and order buffers."""

    synchronous = False  # JAX: wait for the kernels before handing buffers back

    def forward(self, q, k, v, case):
        dev = _device_index(case)
        B, Hq, Nq = case.batch, case.heads_q, case.seqlen_q
        o = self.empty(q, tuple(q.shape), None, dev)
        lse = self.empty(q, (B, Hq, Nq), "float32", dev)
        if B * Hq * Nq == 0:
            return o, lse
        stream = self.stream(q, dev)
        keep = []
        lay = case.layout
        launch.run_forward(case, dev, stream, self.view(q, lay, keep), self.view(k, lay, keep),
                           self.view(v, lay, keep), self.view(o, lay, keep),
                           self.view(lse, None, keep)[0])
        return self.finish(stream, keep, o, lse, device=dev)

    def backward(self, do, q, k, v, o, lse, case):
        dev = _device_index(case)
        B, Hq, Nq = case.batch, case.heads_q, case.seqlen_q
        dq = self.empty(q, tuple(q.shape), None, dev)
        dk = self.empty(k, tuple(k.shape), None, dev)
        dv = self.empty(v, tuple(v.shape), None, dev)
        if B * Hq == 0:
            return dq, dk, dv
        delta = self.empty(q, (B, Hq, Nq), "float32", dev, poison=False)
        stream = self.stream(q, dev)
        keep = []
        lay = case.layout
        lse = self.as_float32(lse)
        launch.run_backward(case, dev, stream, self.view(do, lay, keep), self.view(q, lay, keep),
                            self.view(k, lay, keep), self.view(v, lay, keep),
                            self.view(o, lay, keep), self.view(lse, None, keep),
                            self.view(delta, None, keep)[0], self.view(dq, lay, keep),
                            self.view(dk, lay, keep), self.view(dv, lay, keep))
        return self.finish(stream, keep, dq, dk, dv, device=dev)

    def finish(self, stream, keep, *outs, device=0):
        if self.synchronous:
            launch.synchronize(stream, device)
        return outs

    def view(self, x, layout, keep):
        """(handle, strides in elements, (B, H, N, D) order for 4-d arrays)."""
        handle, strides = self.raw(x, keep)
        if layout is not None:
            strides = launch.bhnd(strides, layout)
        return handle, strides


class BufferLauncher(_Adapter):
    """The passes on buffers a framework owns and lends (JAX's ``buffer_callback``): inputs
    are read through ``view(x, keep) -> (address, strides)``, outputs are ``outputs`` taken
    in order (o, lse; or dq, dk, dv, delta), kernels go on raw stream ``stream``."""

    def __init__(self, view, outputs, stream):
        self._view = view
        self._outs = list(outputs)
        self._stream = stream

    def raw(self, x, keep):
        return self._view(x, keep)

    def empty(self, like, shape, dtype, dev, poison=True):
        return self._outs.pop(0)

    def stream(self, like, dev):
        return self._stream

    def as_float32(self, lse):
        return lse


class _Torch(_Adapter):
    def raw(self, x, keep):
        return x.data_ptr(), x.stride()

    def empty(self, like, shape, dtype, dev, poison=True):
        import torch

        if dtype is None and tuple(like.shape) == shape:
            out = torch.empty_like(like)  # (the fastest allocation; strides come with it)
        else:  # (new_empty: same device, no device argument to parse)
            out = like.new_empty(shape, dtype=like.dtype if dtype is None else
                                 getattr(torch, dtype))
        if poison and _poison.ENABLED:
            out.fill_(math.nan)
        return out

    def stream(self, like, dev):
        import torch

        try:  # the raw handle of the current stream, without building a Stream object
            return torch._C._cuda_getCurrentRawStream(dev)
        except AttributeError:
            return torch.cuda.current_stream(like.device).cuda_stream

    def as_float32(self, lse):
        import torch

        return lse if lse.dtype == torch.float32 else lse.float()


class _CuPy(_Adapter):
    def raw(self, x, keep):
        item = x.itemsize
        return x.data.ptr, tuple(s // item for s in x.strides)

    def empty(self, like, shape, dtype, dev, poison=True):
        import cupy

        with cupy.cuda.Device(dev):
            out = cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
            if poison and _poison.ENABLED:
                out.fill(math.nan)
        return out

    def stream(self, like, dev):
        import cupy

        with cupy.cuda.Device(dev):
            return cupy.cuda.get_current_stream().ptr

    def as_float32(self, lse):
        return lse if lse.dtype == np.float32 else lse.astype(np.float32)


class _Jax(_Adapter):
    """JAX outside ``jit``: the inputs are made ready, their buffers are read through
    ``__cuda_array_interface__``, the outputs are fresh JAX buffers (``jnp.empty``) written
    in place, and the kernels run on the legacy default stream, synchronized before the
    outputs are returned (JAX cannot be told to wait for work on another stream)."""

    synchronous = True

    def raw(self, x, keep):
        x.block_until_ready()
        return cuda_raw(x, keep)

    def empty(self, like, shape, dtype, dev, poison=True):
        import jax.numpy as jnp

        (device,) = like.devices()
        dt = like.dtype if dtype is None else dtype
        if poison and _poison.ENABLED:
            out = jnp.full(shape, jnp.nan, dtype=dt, device=device)
        else:
            out = jnp.empty(shape, dtype=dt, device=device)
        return out.block_until_ready()

    def stream(self, like, dev):
        return 0

    def as_float32(self, lse):
        import jax.numpy as jnp

        return lse if lse.dtype == jnp.float32 else lse.astype(jnp.float32)


class _NumPy(_Adapter):
    """NumPy arrays, served only when the caller names the backend: on a GPU they are copied
    to the device and the results back; under the CUDA simulator they are used in place."""

    def forward(self, q, k, v, case):
        if SIMULATOR:
            return super().forward(q, k, v, case)
        dq, dk, dv = (self._to_device(x) for x in (q, k, v))
        return self._run_on_device("forward", (dq, dk, dv), case)

    def backward(self, do, q, k, v, o, lse, case):
        lse = np.asarray(lse, dtype=np.float32)
        if SIMULATOR:
            return super().backward(do, q, k, v, o, lse, case)
        ins = tuple(self._to_device(x) for x in (do, q, k, v, o, lse))
        return self._run_on_device("backward", ins, case)

    # The simulator path: flat views of host memory stand for device pointers.
    def raw(self, x, keep):
        flat, strides = launch.host_flat(x)
        keep.append(flat)
        return flat, strides

    def empty(self, like, shape, dtype, dev, poison=True):
        out = np.empty(shape, dtype=like.dtype if dtype is None else dtype)
        if poison and _poison.ENABLED:
            out.fill(np.nan)
        return out

    def stream(self, like, dev):
        return 0

    def as_float32(self, lse):
        return np.asarray(lse, dtype=np.float32)

    # The GPU path: numba device arrays, the only copies this backend makes.
    def _to_device(self, x):
        from numba import cuda

        host = np.ascontiguousarray(x)
        dtype = host.dtype
        if dtype.name == "bfloat16":
            host = host.view(np.uint16)
        return cuda.to_device(host), dtype

    def _run_on_device(self, direction, ins, case):
        arrays = [a for a, _ in ins]
        dtype = ins[1][1] if direction == "backward" else ins[0][1]  # q's dtype
        outs = getattr(_Adapter, direction)(_NumbaDevice(), *arrays, case)
        launch.synchronize(0, _device_index(case))
        n = 1 if direction == "forward" else 3  # outputs in q's dtype (lse is float32)
        return tuple(x.copy_to_host().view(dtype) if i < n else x.copy_to_host()
                     for i, x in enumerate(outs))


class _NumbaDevice(_Adapter):
    """numba device arrays, for NumPy inputs copied to the GPU (bf16 as uint16 bits)."""

    def raw(self, x, keep):
        item = x.dtype.itemsize
        return x.__cuda_array_interface__["data"][0], tuple(s // item for s in x.strides)

    def empty(self, like, shape, dtype, dev, poison=True):
        from numba import cuda

        dt = like.dtype if dtype is None else np.dtype(dtype)
        if poison and _poison.ENABLED:
            fill = np.full(shape, np.nan, dtype=np.float32)
            if dt == np.uint16:
                fill = np.full(shape, 0x7FC0, dtype=np.uint16)
            return cuda.to_device(fill.astype(dt) if dt != np.uint16 else fill)
        return cuda.device_array(shape, dtype=dt)

    def stream(self, like, dev):
        return 0

    def as_float32(self, lse):
        return lse


ADAPTERS = {"torch": _Torch(), "cupy": _CuPy(), "jax": _Jax(), "numpy": _NumPy()}
