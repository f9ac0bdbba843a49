"""Host side: compiled kernels prepared once per (kernel, device), zero-copy hand-over of
the caller's buffers, and launches on the caller's stream.

Kernels take raw pointers and element strides, never array objects: a launch packs about
thirty 8-byte words and calls ``cuLaunchKernel`` (through cuda-python's binding, or
ctypes), which costs a few microseconds, where numba's ``kernel[grid, block](tensors...)``
path costs 50-75 µs (it exports each tensor through DLPack twice). Buffers are described by
:class:`View`: an address (on the GPU) or a flat NumPy array (under the simulator) plus
strides in elements in (B, H, N, D) order, whatever the layout of the caller's array.

Compiled kernels are kept in memory, keyed by the kernel and its tiling, and on disk
(numba's ``cache=True``), so a warm process pays no compile.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading

import numpy as np
from numba import cuda
from numba.cuda import types

from . import backward_kernels as _bwd
from . import forward_kernels as _fwd
from . import tiles as _tiles
from .convert import SIMULATOR

#: stored dtype name -> numba element type of the kernel's pointers (bf16 as raw bits)
_ELEM = {"float32": types.float32, "float16": types.float16, "bfloat16": types.uint16}
_I64 = types.int64
_F64 = types.float64
_FASTMATH = {"contract", "arcp", "nsz"}  # no "ninf": the softmax relies on -inf


# --- kernels compiled and prepared per device ---------------------------------------------

_CUDA_SUCCESS = 0


_LIBCUDA = None  # libcuda with its argument types, once loaded
#: cuLaunchKernel of cuda-python's Cython bindings (numba-cuda's own dependency), called
#: with plain ints: 1.1-2 µs less per launch than through ctypes on the lent H100/H200
#: hosts (tools/host_breakdown.py, rows interleaved); ctypes where the bindings are missing.
_BINDINGS_LAUNCH = None


@functools.cache
def _libcuda():
    global _LIBCUDA, _BINDINGS_LAUNCH
    lib = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    for name, args in [
        ("cuInit", [ctypes.c_uint]),
        ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp] * 3),
        ("cuStreamSynchronize", [vp]),
        ("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
        ("cuCtxPushCurrent_v2", [vp]),
        ("cuCtxPopCurrent_v2", [ctypes.POINTER(vp)]),
        ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
        ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
    ]:
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = ctypes.c_int
    lib.cuInit(0)  # (idempotent; a process may reach us before any library initialized CUDA)
    try:
        from cuda.bindings.driver import cuLaunchKernel

        _BINDINGS_LAUNCH = cuLaunchKernel
    except ImportError:  # (the ctypes function then launches)
        pass
    _LIBCUDA = lib
    return lib


@functools.cache
def _primary_context(device: int) -> int:
    """The primary context of GPU ``device`` (the one numba, torch, CuPy and JAX use)."""
    lib = _libcuda()
    dev = ctypes.c_int()
    ctx = ctypes.c_void_p()
    for err in (lib.cuDeviceGet(ctypes.byref(dev), device),
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"no primary context for GPU {device}: CUDA error {err}")
    return ctx.value


class _OnDevice:
    """Makes GPU ``device``'s primary context current for a launch, and restores the
    caller's afterwards. numba-cuda loads kernels context-independently (``CUkernel``), so a
    launch runs in whatever context is current: without this, a call on device-1 buffers
    while the thread's current context is device 0's would run on device 0."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, device):
        self.ctx = _primary_context(device)
        self.pushed = False

    def __enter__(self):
        lib = _libcuda()
        cur = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(cur))
        self.pushed = cur.value != self.ctx
        if self.pushed:
            err = lib.cuCtxPushCurrent_v2(self.ctx)
            if err != _CUDA_SUCCESS:
                raise RuntimeError(f"cuCtxPushCurrent failed with CUDA error {err}")
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _libcuda().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


class Prepared:
    """One kernel compiled for one signature and loaded on one device, launched raw: the
    arguments are packed into a buffer made once (``struct.pack_into``) whose words a fixed
    pointer array addresses, then handed to ``cuLaunchKernel`` (in the device's primary
    context), which copies them."""

    __slots__ = (
        "_buf",
        "_ctx",
        "_cur",
        "_cur_ref",
        "_dispatcher",
        "_fmt",
        "_lock",
        "_params",
        "_ptrs",
        "device",
        "handle",
        "kernel",
        "name",
        "smem",
        "threads",
    )

    def __init__(self, pyfunc, sig, threads, smem_words, device, launch_bounds=None):
        self.name = pyfunc.__name__
        self.threads = threads
        self.smem = 4 * smem_words
        self.device = device
        if SIMULATOR:
            self._dispatcher = cuda.jit(pyfunc)
            self.kernel = self.handle = None
            return
        # every parameter is an 8-byte word: pointers and int64 as "q", the scale as "d"
        self._fmt = "<" + "".join("d" if t == _F64 else "q" for t in sig)
        n = len(sig)
        self._buf = (ctypes.c_int64 * n)()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        self._params = ctypes.addressof(self._ptrs)  # (the bindings take the address)
        self._lock = threading.Lock()
        self._ctx = _primary_context(device)
        self._cur = ctypes.c_void_p()
        self._cur_ref = ctypes.byref(self._cur)
        self._dispatcher = cuda.jit(pyfunc, cache=True, fastmath=_FASTMATH,
                                    **jit_options(launch_bounds))
        with cuda.gpus[device]:
            self.kernel = self._dispatcher.compile(sig)
            cufunc = self.kernel._codelibrary.get_cufunc()
            from numba.cuda.cudadrv.driver import binding, driver

            attrs = binding.CUfunction_attribute
            if self.smem > _tiles.STATIC_SMEM_LIMIT:
                driver.cuKernelSetAttribute(
                    attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem,
                    cufunc.handle, device)
            if launch_bounds:  # registers capped (several blocks per SM, or 512 threads):
                # all the carveout to shared memory, so that the blocks it allows fit
                driver.cuKernelSetAttribute(
                    attrs.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100,
                    cufunc.handle, device)
            self.handle = int(cufunc.handle)

    def __call__(self, grid, stream, args):
        """Launch on ``grid`` (x, y) on raw stream handle ``stream`` (of this kernel's
        device); ``args`` are ints (addresses, sizes, strides) and, last, the float scale
        where the kernel takes one."""
        if grid[0] == 0 or grid[1] == 0:
            return
        if SIMULATOR:
            self._dispatcher[grid, self.threads, 0, self.smem](*args)
            return
        lib = _LIBCUDA or _libcuda()
        # (the buffers are shared; cuLaunchKernel copies the arguments before returning).
        # The context check is _OnDevice's, written out: it runs on every launch.
        with self._lock:
            lib.cuCtxGetCurrent(self._cur_ref)
            pushed = self._cur.value != self._ctx
            if pushed:
                err = lib.cuCtxPushCurrent_v2(self._ctx)
                if err != _CUDA_SUCCESS:
                    raise RuntimeError(f"cuCtxPushCurrent failed with CUDA error {err}")
            struct.pack_into(self._fmt, self._buf, 0, *args)
            if _BINDINGS_LAUNCH is not None:
                err = _BINDINGS_LAUNCH(self.handle, grid[0], grid[1], 1, self.threads, 1, 1,
                                       self.smem, stream, self._params, 0)[0]
            else:
                err = lib.cuLaunchKernel(self.handle, grid[0], grid[1], 1, self.threads, 1,
                                         1, self.smem, stream, self._ptrs, None)
            if pushed:
                lib.cuCtxPopCurrent_v2(self._cur_ref)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel({self.name}) failed with CUDA error {err}")


def jit_options(launch_bounds):
    """``cuda.jit`` options of a kernel compiled for ``launch_bounds`` (None: none)."""
    return {"launch_bounds": launch_bounds} if launch_bounds else {}


def synchronize(stream: int, device: int = 0):
    """Wait for ``stream`` of GPU ``device`` (0: that device's legacy default stream)."""
    if not SIMULATOR:
        with _OnDevice(device):
            err = _libcuda().cuStreamSynchronize(stream)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamSynchronize failed with CUDA error {err}")


def _ptr(elem):
    return types.CPointer(elem)


_lock = threading.Lock()
_PREPARED: dict = {}


def _prepared(key, build):
    p = _PREPARED.get(key)
    if p is None:
        with _lock:
            p = _PREPARED.get(key)
            if p is None:
                p = _PREPARED[key] = build()
    return p


def device_cc(device: int) -> tuple:
    if SIMULATOR:
        return (0, 0)
    return _cc(device)


@functools.cache
def _cc(device):
    return tuple(cuda.gpus[device].compute_capability)


@functools.cache
def device_name(device: int) -> str:
    """The GPU's name (keys the autotuner's cache)."""
    name = cuda.gpus[device].name
    return name.decode() if isinstance(name, bytes) else str(name)


def kernel_tiles(head_dim, dtype, causal, device, override=None):
    return _tiles.choose(head_dim, dtype, causal, device_cc(device), simulator=SIMULATOR,
                         override=override)


def signature(kernel: str, dtype: str) -> tuple:
    """Argument types of a kernel: pointers (inputs and outputs in the stored dtype, lse and
    delta float32), then int64 sizes and strides, then the float64 scale."""
    e = _ptr(_ELEM[dtype])
    f32 = _ptr(types.float32)
    return {
        "attn_forward": (e, e, e, e, f32) + (_I64,) * 21 + (_F64,),
        "attn_backward_preprocess": (e, e, f32) + (_I64,) * 10,
        "attn_backward_dkdv": (e, e, e, e, f32, f32, e, e) + (_I64,) * 33 + (_F64,),
        "attn_backward_dq": (e, e, e, e, f32, f32, e) + (_I64,) * 28 + (_F64,),
    }[kernel]


def kernel_variants(head_dim: int, dtype: str, causal: bool, kt, aligned: bool = True):
    """``(name, python function, signature, shared-memory words, threads, launch bounds)``
    of every kernel one case launches (``aligned``: its streamed arrays have 16-byte aligned
    rows, :func:`rows_aligned`); the PTX tests compile exactly these."""
    return [
        ("attn_forward", _fwd.make_attn_forward(head_dim, kt.forward, causal,
                                                _tiles.streams(kt.forward, dtype, aligned)),
         signature("attn_forward", dtype),
         _tiles.forward_smem_words(kt.forward, head_dim, dtype, aligned), kt.forward.threads,
         kt.forward.launch_bounds),
        ("attn_backward_preprocess",
         _bwd.make_attn_backward_preprocess(head_dim, kt.preprocess_threads),
         signature("attn_backward_preprocess", dtype), 0, kt.preprocess_threads, None),
        ("attn_backward_dkdv", _bwd.make_attn_backward_dkdv(
            head_dim, kt.dkdv, causal, _tiles.streams(kt.dkdv, dtype, aligned)),
         signature("attn_backward_dkdv", dtype),
         _tiles.dkdv_smem_words(kt.dkdv, head_dim, dtype, aligned), kt.dkdv.threads,
         kt.dkdv.launch_bounds),
        ("attn_backward_dq", _bwd.make_attn_backward_dq(
            head_dim, kt.dq, causal, _tiles.streams(kt.dq, dtype, aligned)),
         signature("attn_backward_dq", dtype),
         _tiles.dq_smem_words(kt.dq, head_dim, dtype, aligned), kt.dq.threads,
         kt.dq.launch_bounds),
    ]


def forward_kernel(head_dim, dtype, causal, device, t, aligned=True):
    def build():
        fn = _fwd.make_attn_forward(head_dim, t, causal, _tiles.streams(t, dtype, aligned))
        return Prepared(fn, signature("attn_forward", dtype), t.threads,
                        _tiles.forward_smem_words(t, head_dim, dtype, aligned), device,
                        t.launch_bounds)
    return _prepared(("fwd", head_dim, dtype, causal, device, t, aligned), build)


def preprocess_kernel(head_dim, dtype, device, threads):
    def build():
        fn = _bwd.make_attn_backward_preprocess(head_dim, threads)
        return Prepared(fn, signature("attn_backward_preprocess", dtype), threads, 0, device)
    return _prepared(("pre", head_dim, dtype, device, threads), build)


def dkdv_kernel(head_dim, dtype, causal, device, t, aligned=True):
    def build():
        fn = _bwd.make_attn_backward_dkdv(head_dim, t, causal,
                                          _tiles.streams(t, dtype, aligned))
        return Prepared(fn, signature("attn_backward_dkdv", dtype), t.threads,
                        _tiles.dkdv_smem_words(t, head_dim, dtype, aligned), device,
                        t.launch_bounds)
    return _prepared(("dkdv", head_dim, dtype, causal, device, t, aligned), build)


def dq_kernel(head_dim, dtype, causal, device, t, aligned=True):
    def build():
        fn = _bwd.make_attn_backward_dq(head_dim, t, causal, _tiles.streams(t, dtype, aligned))
        return Prepared(fn, signature("attn_backward_dq", dtype), t.threads,
                        _tiles.dq_smem_words(t, head_dim, dtype, aligned), device,
                        t.launch_bounds)
    return _prepared(("dq", head_dim, dtype, causal, device, t, aligned), build)


def rows_aligned(view, sizes, elems=4) -> bool:
    """Whether every row of a (handle, strides) view of a (B, H, N, D) array (``sizes``: B,
    H, N) is contiguous and starts 16 bytes aligned, ``elems`` elements making 16 bytes
    (strides of dims of size 1 never move an address)."""
    handle, (sb, sh, sn, sd) = view
    nb, nh, nn = sizes
    # (written out, not looped: it runs for every fp32 and tensor-core launch)
    return (sd == 1 and (nb < 2 or sb % elems == 0) and (nh < 2 or sh % elems == 0)
            and (nn < 2 or sn % elems == 0) and (SIMULATOR or int(handle) % 16 == 0))


# --- the passes ----------------------------------------------------------------------------


_FWD_PLANS: dict = {}
_BWD_PLANS: dict = {}
_PRE_PLANS: dict = {}


def _forward_plan(case, device, tiles, aligned=True):
    """(kernel, block_m) for a case's (head dim, dtype, causal, device, row alignment),
    looked up by a tuple of plain values, cheap to hash on every call."""
    key = (case.head_dim, case.dtype, case.causal, device, tiles, aligned)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        t = kernel_tiles(case.head_dim, case.dtype, case.causal, device, tiles).forward
        plan = _FWD_PLANS[key] = (
            forward_kernel(case.head_dim, case.dtype, case.causal, device, t, aligned),
            t.block_m)
    return plan


def _backward_plan(case, device, tiles, aligned=True):
    key = (case.head_dim, case.dtype, case.causal, device, tiles, aligned)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        kt = kernel_tiles(case.head_dim, case.dtype, case.causal, device, tiles)
        args = (case.head_dim, case.dtype, case.causal, device)
        plan = _BWD_PLANS[key] = (dkdv_kernel(*args, kt.dkdv, aligned), kt.dkdv.block_m,
                                  dq_kernel(*args, kt.dq, aligned), kt.dq.block_m)
    return plan


def _fp32_rows_aligned(case, q, k, v, do=None) -> bool:
    """For fp32 calls, whether the arrays a kernel may stream (K and V; in the backward Q and
    dO too) have 16-byte aligned rows (:func:`rows_aligned`); True for other dtypes, whose
    tiles always go through registers."""
    if case.dtype != "float32":
        return True
    skv = (case.batch, case.heads_kv, case.seqlen_k)
    if not (rows_aligned(k, skv) and rows_aligned(v, skv)):
        return False
    sq = (case.batch, case.heads_q, case.seqlen_q)
    return do is None or (rows_aligned(q, sq) and rows_aligned(do, sq))


def _preprocess_plan(case, device, tiles):
    key = (case.head_dim, case.dtype, device, tiles)
    plan = _PRE_PLANS.get(key)
    if plan is None:
        kt = kernel_tiles(case.head_dim, case.dtype, case.causal, device, tiles)
        plan = _PRE_PLANS[key] = (
            preprocess_kernel(case.head_dim, case.dtype, device, kt.preprocess_threads),
            kt.preprocess_threads)
    return plan


_LAUNCH_TC = None


def _tc():
    """launch_tc (imported on first use: it imports this module), kept in a global so that
    a launch pays no import statement."""
    global _LAUNCH_TC
    if _LAUNCH_TC is None:
        from . import launch_tc

        _LAUNCH_TC = launch_tc
    return _LAUNCH_TC


def launch_forward(kern, bm, case, stream, q, k, v, o, lse):
    """One forward launch of ``kern`` (``bm`` query rows per block; the SIMT and the
    tensor-core forwards take the same arguments). q, k, v, o are (handle, strides4) pairs;
    lse is a handle of a contiguous float32 (B, Hq, Nq) buffer."""
    kern(((case.seqlen_q + bm - 1) // bm, case.batch * case.heads_q), stream,
         (q[0], k[0], v[0], o[0], lse, case.seqlen_q, case.seqlen_k, case.heads_q,
          case.heads_q // case.heads_kv, case.seqlen_k - case.seqlen_q, *q[1], *k[1], *v[1],
          *o[1], float(case.scale)))


def launch_dkdv(kern, bm, case, stream, q, k, v, do, lse, delta, dk, dv):
    """One dK/dV launch (``bm`` keys per block); lse has three strides, delta is a handle."""
    B, Hq, Hkv, Nq, Nk = case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k
    kern(((Nk + bm - 1) // bm, B * Hkv), stream,
         (q[0], k[0], v[0], do[0], lse[0], delta, dk[0], dv[0], Nq, Nk, Hq, Hkv, Hq // Hkv,
          Nk - Nq, *q[1], *k[1], *v[1], *do[1], *dk[1], *dv[1], *lse[1], float(case.scale)))


def launch_dq(kern, bm, case, stream, q, k, v, do, lse, delta, dq):
    """One dQ launch (``bm`` queries per block)."""
    B, Hq, Hkv, Nq, Nk = case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k
    kern(((Nq + bm - 1) // bm, B * Hq), stream,
         (q[0], k[0], v[0], do[0], lse[0], delta, dq[0], Nq, Nk, Hq, Hq // Hkv, Nk - Nq,
          *q[1], *k[1], *v[1], *do[1], *dq[1], *lse[1], float(case.scale)))


def run_forward(case, device, stream, q, k, v, o, lse, tiles=None):
    """Launch the forward: the tensor-core kernel where launch_tc serves the case, else the
    SIMT kernel (always the SIMT kernel with an explicit ``tiles``); arguments as in
    :func:`launch_forward`."""
    tc = _tc()
    if tiles is None and tc.serves(case, device, q, k, v):
        kern, bm = tc.forward_plan(case, device)
    else:
        kern, bm = _forward_plan(case, device, tiles, _fp32_rows_aligned(case, q, k, v))
    launch_forward(kern, bm, case, stream, q, k, v, o, lse)


def run_backward(case, device, stream, do, q, k, v, o, lse, delta, dq, dk, dv, tiles=None):
    """Launch the preprocess kernel, then the dK/dV and dQ kernels (tensor-core ones where
    launch_tc serves the case, as in run_forward). Arrays are (handle, strides) pairs; lse
    has three strides; delta is a handle of a contiguous float32 (B, Hq, Nq) scratch buffer."""
    pre, pt = _preprocess_plan(case, device, tiles)
    tc = _tc()
    if tiles is None and tc.serves(case, device, q, k, v, do):
        dkdv, dkdv_bm, dqk, dq_bm = tc.backward_plan(case, device)
    else:
        dkdv, dkdv_bm, dqk, dq_bm = _backward_plan(case, device, tiles,
                                                   _fp32_rows_aligned(case, q, k, v, do))
    Nq, Hq = case.seqlen_q, case.heads_q
    pre(((Nq + pt - 1) // pt, case.batch * Hq), stream,
        (o[0], do[0], delta, Nq, Hq, *o[1], *do[1]))
    launch_dkdv(dkdv, dkdv_bm, case, stream, q, k, v, do, lse, delta, dk, dv)
    launch_dq(dqk, dq_bm, case, stream, q, k, v, do, lse, delta, dq)


def bhnd(strides, layout):
    """Strides of a (B, H, N, D) or (B, N, H, D) array, in (B, H, N, D) order."""
    s0, s1, s2, s3 = strides
    return (s0, s1, s2, s3) if layout == "bhnd" else (s0, s2, s1, s3)


def host_flat(x: np.ndarray):
    """A flat NumPy view over the memory of ``x`` (simulator launches index it like a
    pointer) and ``x``'s strides in elements; bf16 is viewed as its uint16 bits."""
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    item = x.itemsize
    if any(s < 0 for s in x.strides) or any(s % item for s in x.strides):
        x = np.ascontiguousarray(x)
    strides = tuple(s // item for s in x.strides)
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, strides)) if x.size else 0
    flat = np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(item,))
    return flat, strides
