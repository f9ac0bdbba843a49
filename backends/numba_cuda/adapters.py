"""One adapter per array library: buffer addresses and strides (zero-copy), output
allocation by the caller's library, and the stream to launch on.

Each framework is imported only inside its adapter, which is used only for arrays of that
framework (so it is already imported).
"""
from __future__ import annotations

import functools
import math
import sys
import threading
from dataclasses import replace

import numpy as np

from flashcore import _poison
from flashcore._interop import cuda_raw

from . import classes, launch, launch_args
from .device.convert import SIMULATOR
from .driver import copy_to_host, stream_capturing, synchronize


@functools.cache
def _device_index(device: str) -> int:
    """The GPU index of a case's device string ("cuda:1" -> 1; "cpu" under the simulator)."""
    return int(device.split(":")[1]) if ":" in device else 0


class _Adapter:
    """The passes, written once; subclasses say how to see, allocate and order buffers.

    Every call pays this code's host time (issue 3 bounds a tiny forward at 20 µs), so it
    looks up what it uses once per call and leaves per-array work to ``view``/``address``,
    which an adapter may write for its own arrays in as few steps as they allow."""

    synchronous = False  # JAX: wait for the kernels before handing buffers back
    fused_ok = True  # the backward may allocate a dQ accumulator (launch.fused_backward)
    allocates = True  # ``empty`` makes buffers of any shape (not lent ones, in order)
    stages_lengths = False  # host lengths by tensor_maps' ring (packed._lengths)

    def capturing(self, stream, dev):
        """Whether ``stream`` (of GPU ``dev``) is known to be captured into a CUDA graph."""
        return not SIMULATOR and stream_capturing(stream, unknown=False)

    def forward(self, q, k, v, case):
        if case.packed:  # varlen or a KV cache (packed.py)
            from . import packed

            return packed.forward(self, q, k, v, case)
        dev = _device_index(case.device)
        o = self.empty(q, None, None, dev)
        rows = case.batch * case.heads_q * case.seqlen_q
        keep = []
        # lse that nobody asked for goes to a scratch buffer where the adapter keeps one
        # (small calls, whose host time is mostly allocations); lse is then None
        lse = None
        lse_at = None if case.need_lse else self.scratch(q, rows, dev)
        if lse_at is None:
            lse = self.empty(q, (case.batch, case.heads_q, case.seqlen_q), "float32", dev)
        if rows == 0:
            return o, lse
        if lse_at is None:
            lse_at = self.address(lse, keep)
        stream = self.stream(q, dev)
        lay = case.layout
        view = self.view
        margs = self.mod_args(case, keep)
        launch.run_forward(case, dev, stream, view(q, lay, keep), view(k, lay, keep),
                           view(v, lay, keep), view(o, lay, keep), lse_at,
                           slopes=self.slopes(case, keep), margs=margs,
                           classes=self.tile_classes(case, q, keep, margs))
        if self.synchronous:
            synchronize(stream, dev)
        return o, lse

    def backward(self, do, q, k, v, o, lse, case):
        if case.packed:
            from . import packed

            return packed.backward(self, do, q, k, v, o, lse, case)
        dev = _device_index(case.device)
        B, Hq, Nq = case.batch, case.heads_q, case.seqlen_q
        dq = self.empty(q, None, None, dev)
        dk = self.empty(k, None, None, dev)
        dv = self.empty(v, None, None, dev)
        if B * Hq == 0:
            return dq, dk, dv
        delta = self.empty(q, (B, Hq, Nq), "float32", dev, poison=False)
        stream = self.stream(q, dev)
        keep = []
        acc = None  # dQ's accumulator in the non-deterministic mode (zeroed by the launch)
        if self.fused_ok and launch.fused_backward(case, dev):
            buf = self.empty(q, (B * Hq * Nq * case.head_dim,), "float32", dev, poison=False)
            keep.append(buf)
            acc = self.address(buf, keep)
        lay = case.layout
        view = self.view
        lse = self.as_float32(lse)
        margs = self.mod_args(case, keep)
        launch.run_backward(case, dev, stream, view(do, lay, keep), view(q, lay, keep),
                            view(k, lay, keep), view(v, lay, keep), view(o, lay, keep),
                            view(lse, None, keep), self.address(delta, keep),
                            view(dq, lay, keep), view(dk, lay, keep), view(dv, lay, keep),
                            slopes=self.slopes(case, keep), margs=margs,
                            classes=self.tile_classes(case, q, keep, margs), dq_acc=acc)
        if self.synchronous:
            synchronize(stream, dev)
        return dq, dk, dv

    def device_index(self, case):
        return _device_index(case.device)

    def int32(self, x, keep, plus=0):
        """The handle of a C-contiguous int32 copy of ``x`` + ``plus`` on its device (``x``
        itself where it is one and ``plus`` is 0): offsets, lengths, tables; kept in keep."""
        raise NotImplementedError

    def host_lengths(self, lengths, n_new, like, keep):
        """Handles of int32 copies on ``like``'s device of the host array ``lengths`` and of
        ``lengths + n_new``, kept in ``keep``, in stream order before the kernels."""
        a = self.upload(np.ascontiguousarray(lengths, dtype=np.int32), like)
        b = a if not n_new else self.upload(
            np.ascontiguousarray(lengths + n_new, dtype=np.int32), like)
        keep.extend((a, b))
        return self.address(a, keep), self.address(b, keep)

    def view(self, x, layout, keep):
        """(handle, strides in elements, (B, H, N, D) order for 4-d arrays)."""
        handle, strides = self.raw(x, keep)
        if layout is not None:
            strides = launch.bhnd(strides, layout)
        return handle, strides

    def slopes(self, case, keep):
        """The call's ALiBi slopes as the kernels take them, ``(handle, (batch stride,
        head stride))`` (a batch stride 0 for slopes of shape (Hq,)), or None."""
        x = case.alibi_slopes
        if x is None:
            return None
        handle, strides = self.raw(x, keep)
        return handle, (0, *strides) if len(strides) == 1 else strides

    def mod_args(self, case, keep):
        """The call's mod_args as the kernels take them (launch.mod_args: handles of C-
        contiguous copies where an array is not, and shapes), or None without any."""
        return self.mod_arrays(case.mod_args, keep)

    def mod_arrays(self, arrays, keep):
        """:meth:`mod_args` of the arrays ``arrays``."""
        if not arrays:
            return None
        views = []
        for a in arrays:
            a = self.contiguous(a)
            keep.append(a)
            views.append((self.address(a, keep), tuple(int(n) for n in a.shape)))
        return launch_args.mod_args(views)

    def contiguous(self, x):
        """``x``, or a C-contiguous copy of it (a mod_args array the kernels index flat)."""
        return x

    def tile_classes(self, case, like, keep, margs):
        """The mask_mod's tile classes as the kernels take them (:mod:`.classes`: a
        BlockMask's, or evaluated on the GPU by the call), or None without a mask_mod;
        ``margs`` is :meth:`mod_args`'s answer."""
        return classes.tile_classes(self, case, like, keep, margs)

    def upload(self, host, like):
        """A copy on ``like``'s device of the NumPy array ``host``."""
        raise NotImplementedError

    def host_copy(self, x, case):
        """A NumPy copy of the option array ``x`` (a mod_args array), for the host's
        evaluation of a mask_mod's tile classes."""
        from flashcore._interop import copy_to_host as to_host

        return (x.copy_to_host() if hasattr(x, "copy_to_host")  # (numba device arrays:
                else to_host(x, case.library))                # NumPy inputs on a GPU)

    def address(self, x, keep):
        """The handle of a contiguous buffer (lse, delta) the kernels index flat."""
        return self.raw(x, keep)[0]

    def max_splits(self):
        """The most split-KV ranges a KV-cache call may use here (None: any number): a
        framework that lends its buffers lends partials sized before the plan is made."""
        return None

    def scratch(self, like, n, dev):
        """The handle of a float32 buffer of at least ``n`` words on GPU ``dev`` that the
        kernels may write and nobody reads (an lse the caller did not ask for), kept for
        the process (None: none kept, or ``n`` > :data:`SCRATCH_WORDS`); kernels on any
        streams may write it: never read nor freed, it is no other tensor's memory."""
        return None


#: Words of the per-GPU lse scratch buffer (1 MiB): calls with more query rows allocate
#: their lse, whose allocation is then small beside the kernels' time.
SCRATCH_WORDS = 1 << 18


class BufferLauncher(_Adapter):
    """The passes on buffers a framework owns and lends (JAX's ``buffer_callback``): inputs
    are read through ``view(x, keep) -> (address, strides)``, outputs are ``outputs`` taken
    in order (o, lse; or dq, dk, dv, delta), kernels go on raw stream ``stream``."""

    fused_ok = allocates = False  # (the framework's buffers: no accumulator, no workspace)

    def __init__(self, view, outputs, stream):
        self._view = view
        self._outs = list(outputs)
        self._stream = stream

    def raw(self, x, keep):
        return self._view(x, keep)

    def address(self, x, keep):
        if hasattr(x, "__cuda_array_interface__"):  # an upload of ours (tile classes)
            return x.__cuda_array_interface__["data"][0]
        return self.raw(x, keep)[0]

    def upload(self, host, like):
        # A numba device array, kept by _UPLOADED (JAX cannot allocate from inside XLA's
        # callback); synchronous: done before the kernels that read it are queued.
        from numba import cuda

        return cuda.to_device(host)

    def host_copy(self, x, case):
        """A mod_args buffer copied to the host on XLA's stream: one synchronization per
        call that evaluates a mask_mod's tile classes without a block_mask."""
        return self.read(x, self.device_index(case))

    def read(self, x, device):
        """A NumPy copy of the lent buffer ``x`` made on XLA's stream, after the work
        queued there (the callback's inputs are ready only in stream order), waiting for
        it: a synchronization, which the packed calls' checks of their offsets and lengths
        pay once per index array."""
        keep = []
        ptr, _ = self.raw(x, keep)  # (XLA's buffers are dense and row-major)
        out = np.empty(tuple(x.shape), dtype=np.dtype(x.dtype))
        if out.nbytes:
            if SIMULATOR:  # (ptr: a flat view of host memory)
                return np.array(ptr[:out.size]).view(out.dtype).reshape(out.shape)
            copy_to_host(out.ctypes.data, ptr, out.nbytes, self._stream, device)
        return out

    def int32(self, x, keep, plus=0):
        """The address of a lent int32 index buffer; with ``plus``, of the buffer the
        framework lent for ``x + plus`` (``x.shifted(plus)``): no arithmetic can be
        queued on the device here without a kernel of its own."""
        if plus:
            x = x.shifted(plus)
        if np.dtype(x.dtype) != np.int32:
            raise TypeError(f"lent index buffers must be int32; got {np.dtype(x.dtype)}")
        return self.address(x, keep)

    def max_splits(self):
        """The splits the lent partials hold (their first axis): a KV-cache call's outputs
        after o and lse, when it has them; 1 (no split) without."""
        return int(self._outs[0].shape[0]) if len(self._outs) == 2 else 1

    def empty(self, like, shape, dtype, dev, poison=True):
        return self._outs.pop(0)

    def stream(self, like, dev):
        return self._stream

    def as_float32(self, lse):
        return lse


def _torch():
    """The torch module (imported by the caller already: its tensors are here)."""
    return sys.modules["torch"]


#: GPU index -> the torch lse scratch buffer of _Adapter.scratch (kept for the process)
_TORCH_SCRATCH: dict = {}
_SCRATCH_LOCK = threading.Lock()  # one allocation per GPU, also when threads race to it


class _Torch(_Adapter):
    def raw(self, x, keep):
        return x.data_ptr(), x.stride()

    def view(self, x, layout, keep):  # (raw and bhnd in one step: it runs per array)
        s = x.stride()
        if layout == "bnhd":
            s = (s[0], s[2], s[1], s[3])
        return x.data_ptr(), s

    def address(self, x, keep):
        return x.data_ptr()

    def contiguous(self, x):
        return x.contiguous()

    def int32(self, x, keep, plus=0):
        torch = _torch()
        y = x.to(torch.int32)
        if plus:
            y = y + plus
        y = y.contiguous()
        keep.append(y)
        return y.data_ptr()

    def upload(self, host, like):
        return _torch().from_numpy(host).to(like.device)

    stages_lengths = True

    def capturing(self, stream, dev):  # (torch's answer, cheap, is the current device's)
        cuda = _torch().cuda
        return (cuda.is_current_stream_capturing() if cuda.current_device() == dev
                else stream_capturing(stream, unknown=False))

    def host_lengths(self, lengths, n_new, like, keep):
        """Both arrays in one pinned tensor from torch's caching host allocator, copied
        with ``non_blocking=True`` on the current stream: the host does not wait, and the
        allocator hands that block out again only once the copy has read it."""
        torch = _torch()
        B = lengths.shape[0]
        stage = torch.empty(2 * B, dtype=torch.int32, pin_memory=True)
        stage.numpy()[:] = np.concatenate((lengths, lengths + n_new))
        dev = stage.to(like.device, non_blocking=True)
        keep.append(dev)
        return dev.data_ptr(), dev.data_ptr() + 4 * B

    def scratch(self, like, n, dev):
        if n > SCRATCH_WORDS:
            return None
        buf = _TORCH_SCRATCH.get(dev)
        if buf is None:
            with _SCRATCH_LOCK:
                buf = _TORCH_SCRATCH.get(dev)
                if buf is None:
                    torch = _torch()
                    buf = _TORCH_SCRATCH[dev] = torch.empty(
                        SCRATCH_WORDS, dtype=torch.float32, device=like.device)
        return buf.data_ptr()

    def empty(self, like, shape, dtype, dev, poison=True):
        """A buffer like ``like`` (``shape`` None: its shape, dtype and strides, the
        fastest allocation torch has), or of ``shape`` and ``dtype`` on its device."""
        if shape is None:
            out = _torch().empty_like(like)
        else:  # (new_empty: same device, no device argument to parse)
            out = like.new_empty(shape, dtype=getattr(_torch(), dtype))
        if poison and _poison.ENABLED:
            out.fill_(math.nan)
        return out

    def stream(self, like, dev):
        torch = _torch()
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

    def contiguous(self, x):
        import cupy
        with x.device:  # (on x's GPU, not the current one)
            return cupy.ascontiguousarray(x)

    def int32(self, x, keep, plus=0):
        import cupy

        with x.device:
            y = cupy.ascontiguousarray(x.astype(cupy.int32) + plus)
        keep.append(y)
        return y.data.ptr

    def upload(self, host, like):
        import cupy

        with like.device:
            return cupy.asarray(host)

    def empty(self, like, shape, dtype, dev, poison=True):
        import cupy

        with cupy.cuda.Device(dev):
            out = cupy.empty(like.shape if shape is None else shape,
                             dtype=like.dtype if dtype is None else dtype)
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

    def forward(self, q, k, v, case):
        if case.kvcache is not None and case.kvcache.n_new:
            raise TypeError("JAX arrays are immutable: their caches cannot be appended to in "
                            "place; flashcore.attention_with_kvcache returns the updated "
                            "caches instead")
        return super().forward(q, k, v, case)

    def raw(self, x, keep):
        x.block_until_ready()
        return cuda_raw(x, keep)

    def int32(self, x, keep, plus=0):
        import jax.numpy as jnp

        y = jnp.asarray(x, dtype=jnp.int32)
        if plus:
            y = y + plus
        keep.append(y)
        return self.raw(y, keep)[0]

    def empty(self, like, shape, dtype, dev, poison=True):
        import jax.numpy as jnp

        (device,) = like.devices()
        dt = like.dtype if dtype is None else dtype
        shape = like.shape if shape is None else shape
        if poison and _poison.ENABLED:
            out = jnp.full(shape, jnp.nan, dtype=dt, device=device)
        else:
            out = jnp.empty(shape, dtype=dt, device=device)
        return out.block_until_ready()

    def stream(self, like, dev):
        return 0

    def upload(self, host, like):
        import jax

        (device,) = like.devices()
        return jax.device_put(host, device).block_until_ready()

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
    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def int32(self, x, keep, plus=0):
        y = np.ascontiguousarray(np.asarray(x, dtype=np.int32) + np.int32(plus))
        return self.raw(y, keep)[0]

    def upload(self, host, like):
        return host

    def raw(self, x, keep):
        flat, strides = launch.host_flat(x)
        keep.append(flat)
        return flat, strides

    def empty(self, like, shape, dtype, dev, poison=True):
        out = np.empty(like.shape if shape is None else shape,
                       dtype=like.dtype if dtype is None else dtype)
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
        if case.alibi_slopes is not None:
            case = replace(case, alibi_slopes=self._to_device(case.alibi_slopes)[0])
        if case.mod_args:
            case = replace(case, mod_args=tuple(self._to_device(a)[0] for a in case.mod_args))
        dtype = ins[1][1] if direction == "backward" else ins[0][1]  # q's dtype
        outs = getattr(_Adapter, direction)(_NumbaDevice(), *arrays, case)
        synchronize(0, _device_index(case.device))
        n = 1 if direction == "forward" else 3  # outputs in q's dtype (lse is float32)
        return tuple(x.copy_to_host().view(dtype) if i < n else x.copy_to_host()
                     for i, x in enumerate(outs))


class _NumbaDevice(_Adapter):
    """numba device arrays, for NumPy inputs copied to the GPU (bf16 as uint16 bits)."""

    def upload(self, host, like):
        from numba import cuda

        return cuda.to_device(host)

    def raw(self, x, keep):
        item = x.dtype.itemsize
        return x.__cuda_array_interface__["data"][0], tuple(s // item for s in x.strides)

    def empty(self, like, shape, dtype, dev, poison=True):
        from numba import cuda

        dt = like.dtype if dtype is None else np.dtype(dtype)
        shape = like.shape if shape is None else shape
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
