"""The CUDA driver side of the numba_cuda backend: libcuda, primary contexts, and kernels
compiled once per (variant, device) and launched raw on the caller's stream.

Kernels take raw pointers and element strides, never array objects: a launch packs about
thirty 8-byte words and calls ``cuLaunchKernel`` (through cuda-python's binding, or
ctypes), which costs a few microseconds, where numba's ``kernel[grid, block](tensors...)``
path costs 50-75 µs (it exports each tensor through DLPack twice).

Compiled kernels are kept in memory (:func:`prepared`, keyed by the kernel's variant and
the device) and on disk (numba's ``cache=True``), so a warm process pays no compile.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import struct
import threading

from numba import cuda
from numba.cuda import types

from .device.constants import FASTMATH
from .device.convert import SIMULATOR
from .tilings import STATIC_SMEM_LIMIT

_F64 = types.float64

_CUDA_SUCCESS = 0


_LIBCUDA = None  # libcuda with its argument types, once loaded
#: cuLaunchKernel of cuda-python's Cython bindings (numba-cuda's own dependency), called
#: with plain ints: 1.1-2 µs less per launch than through ctypes on the lent H100/H200
#: hosts (tools/host_breakdown.py, rows interleaved); ctypes where the bindings are missing.
_BINDINGS_LAUNCH = None


@functools.cache
def _libcuda():
    """libcuda, with the argument and result types of every entry point the backend calls
    set here, once (the table below)."""
    global _LIBCUDA, _BINDINGS_LAUNCH
    lib = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    for name, args in [
        ("cuInit", [ctypes.c_uint]),
        ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp] * 3),
        ("cuStreamSynchronize", [vp]),
        ("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
        ("cuCtxPushCurrent_v2", [vp]),
        ("cuCtxPopCurrent_v2", [ctypes.POINTER(vp)]),
        ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
        ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
        ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
        ("cuMemcpyDtoHAsync_v2", [vp, ctypes.c_uint64, ctypes.c_size_t, vp]),
        ("cuStreamIsCapturing", [vp, ctypes.POINTER(ctypes.c_int)]),
        # the tensor maps (tensor_maps.py): their encoding, and each device's ring of slots
        ("cuTensorMapEncodeTiled", [vp, ctypes.c_int, ctypes.c_uint32, vp, u64p, u64p, u32p,
                                    u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int]),
        ("cuMemAlloc_v2", [u64p, ctypes.c_size_t]),
        ("cuMemHostAlloc", [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint]),
        ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, ctypes.c_size_t, vp]),
        ("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
        ("cuEventRecord", [vp, vp]),
        ("cuEventSynchronize", [vp]),
    ]:
        f = getattr(lib, name, None)
        if f is None:  # (an older driver: the call that needs it reports its absence)
            continue
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


def error_text(err) -> str:
    """``"CUDA_ERROR_ILLEGAL_ADDRESS (700)"``: a CUresult's name (cuGetErrorName) and
    number; the number alone where the driver has no name for it."""
    err = int(err)
    name = ctypes.c_char_p()
    try:
        ok = (_LIBCUDA or _libcuda()).cuGetErrorName(err, ctypes.byref(name)) == _CUDA_SUCCESS
    except Exception:  # noqa: BLE001  (an error message must not raise another error)
        ok = False
    return f"{name.value.decode()} ({err})" if ok and name.value else f"CUDA error {err}"


@functools.cache
def _primary_context(device: int) -> int:
    """The primary context of GPU ``device`` (the one numba, torch, CuPy and JAX use)."""
    lib = _libcuda()
    dev = ctypes.c_int()
    ctx = ctypes.c_void_p()
    for err in (lib.cuDeviceGet(ctypes.byref(dev), device),
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"no primary context for GPU {device}: {error_text(err)}")
    return ctx.value


class _OnDevice:
    """Makes GPU ``device``'s primary context current for a launch, and restores the
    caller's afterwards. numba-cuda loads kernels context-independently (``CUkernel``), so a
    launch runs in whatever context is current: without this, a call on device-1 buffers
    while the thread's current context is device 0's would run on device 0."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, device, ctx=None):
        self.ctx = ctx or _primary_context(device)  # (``ctx``: the primary context, known)
        self.pushed = False

    def __enter__(self):
        lib = _libcuda()
        cur = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(cur))
        self.pushed = cur.value != self.ctx
        if self.pushed:
            err = lib.cuCtxPushCurrent_v2(self.ctx)
            if err != _CUDA_SUCCESS:
                raise RuntimeError(f"cuCtxPushCurrent failed: {error_text(err)}")
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

    def __init__(self, pyfunc, sig, threads, smem_words, device, launch_bounds=None,
                 cache_key=None):
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
        # on disk where the caller gives a key (:class:`VariantCache`), else in memory only
        self._dispatcher = cuda.jit(pyfunc, cache=cache_key is not None, fastmath=FASTMATH,
                                    **jit_options(launch_bounds))
        if cache_key is not None:
            self._dispatcher._cache = variant_cache(pyfunc, cache_key)
        with cuda.gpus[device], compile_notice(self.name, device):
            self.kernel = self._dispatcher.compile(sig)
            cufunc = self.kernel._codelibrary.get_cufunc()
            from numba.cuda.cudadrv.driver import binding, driver

            attrs = binding.CUfunction_attribute
            if self.smem > STATIC_SMEM_LIMIT:
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
        """Launch on ``grid`` (x, y) or (x, y, z) on raw stream handle ``stream`` (of this
        kernel's device); ``args`` are ints (addresses, sizes, strides) and, last, the float
        scale where the kernel takes one."""
        gz = grid[2] if len(grid) > 2 else 1
        if grid[0] == 0 or grid[1] == 0 or gz == 0:
            return
        if SIMULATOR:
            self._dispatcher[grid, self.threads, 0, self.smem](*args)
            return
        lib = _LIBCUDA or _libcuda()
        # (the buffers are shared; cuLaunchKernel copies the arguments before returning).
        # The context check is _OnDevice's, written out: it runs on every launch. Whatever
        # raises after the push (bad arguments to pack, the binding) still pops it.
        with self._lock:
            lib.cuCtxGetCurrent(self._cur_ref)
            pushed = self._cur.value != self._ctx
            if pushed:
                err = lib.cuCtxPushCurrent_v2(self._ctx)
                if err != _CUDA_SUCCESS:
                    raise RuntimeError(f"cuCtxPushCurrent failed: {error_text(err)}")
            try:
                struct.pack_into(self._fmt, self._buf, 0, *args)
                if _BINDINGS_LAUNCH is not None:
                    err = _BINDINGS_LAUNCH(self.handle, grid[0], grid[1], gz, self.threads, 1,
                                           1, self.smem, stream, self._params, 0)[0]
                else:
                    err = lib.cuLaunchKernel(self.handle, grid[0], grid[1], gz, self.threads,
                                             1, 1, self.smem, stream, self._ptrs, None)
            finally:
                if pushed:
                    lib.cuCtxPopCurrent_v2(self._cur_ref)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel({self.name}) failed: {error_text(err)}")


@functools.cache
def _variant_cache_class():
    from numba.cuda.dispatcher import CUDACache

    class VariantCache(CUDACache):
        """numba-cuda's disk cache of one kernel variant, its entries keyed by ``key`` (the
        variant and flashcore's kernel sources, :func:`sources_digest`) where numba's own
        key hashes a pickle of the kernel's closure. Those closures hold device functions,
        whose pickles differ from process to process (hash-ordered sets, ids), so most
        entries were never found again: in a warm process 38 of 50 variants compiled
        again (H100 host, tools/compile_times.py). And an edit in a device function's
        module (not the kernel's own file, whose timestamp the index checks) did not
        reach numba's key."""

        def __init__(self, py_func, key):
            self._flashcore_key = key
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            import numba_cuda

            key = (sig, codegen.magic_tuple(), numba_cuda.__version__,
                   ("flashcore", self._flashcore_key))
            launch = getattr(self, "_launch_config_key", None)
            return key if launch is None else key + (("launch_config", launch),)

    return VariantCache


def variant_cache(pyfunc, key: str):
    """A disk cache for kernel ``pyfunc`` keyed by ``key`` (see VariantCache)."""
    return _variant_cache_class()(pyfunc, key)


@functools.cache
def sources_digest() -> str:
    """sha256 of the numba_cuda backend's Python sources (the kernels and every device
    function they inline), once per process: part of each kernel's disk-cache key."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


#: Seconds a kernel build may take before the one-line notice: loading from numba's disk
#: cache takes milliseconds, a compile 3-17 s (notes/ci_and_disk_cache_2026-11-26.md).
NOTICE_AFTER_S = 2.0
_log = logging.getLogger("flashcore")
_notice_lock = threading.Lock()
_noticed = False


@contextlib.contextmanager
def compile_notice(name: str, device: int):
    """Around a kernel build: once per process, when a build runs past NOTICE_AFTER_S (a
    compile, not a cache load), log one line saying what is compiled and where it is cached.
    At WARNING, so it reaches stderr without any logging set up (logging's last resort)."""
    if _noticed:
        yield
        return
    timer = threading.Timer(NOTICE_AFTER_S, _notice, (name, device))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _notice(name, device):
    global _noticed
    with _notice_lock:
        if _noticed:
            return
        _noticed = True
    _log.warning(
        "flashcore: compiling CUDA kernel %s for GPU %d on its first use (up to ~20 s per "
        "kernel variant, once: cached in %s); `python -m flashcore warmup` compiles them "
        "ahead",
        name, device, cache_location())


def cache_location() -> str:
    """Where numba keeps compiled kernels, in words."""
    from numba.core import config

    if config.CACHE_DIR:
        return f"NUMBA_CACHE_DIR={config.CACHE_DIR}"
    return ("numba's cache, __pycache__ beside flashcore's kernels (or the user cache "
            "directory where that is read-only; NUMBA_CACHE_DIR chooses another)")


def jit_options(launch_bounds):
    """``cuda.jit`` options of a kernel compiled for ``launch_bounds`` (None: none)."""
    return {"launch_bounds": launch_bounds} if launch_bounds else {}


def copy_to_host(dst: int, src: int, nbytes: int, stream: int, device: int):
    """Copy ``nbytes`` from GPU ``device``'s address ``src`` to host address ``dst`` in
    order on ``stream`` (after the work queued there), and wait for it."""
    with _OnDevice(device):
        lib = _libcuda()
        err = lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream)
        if err == _CUDA_SUCCESS:
            err = lib.cuStreamSynchronize(stream)
    if err != _CUDA_SUCCESS:
        raise RuntimeError(f"copying {nbytes} bytes to the host failed: {error_text(err)}")


def stream_capturing(stream: int, unknown: bool = True) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (``cuStreamIsCapturing``);
    ``unknown`` where the driver cannot say (an implicit capture of the legacy stream, no
    context): True for a caller that then takes the path that is safe under capture."""
    status = ctypes.c_int(-1)
    try:
        err = (_LIBCUDA or _libcuda()).cuStreamIsCapturing(stream, ctypes.byref(status))
    except Exception:  # noqa: BLE001
        return unknown
    return unknown if err != _CUDA_SUCCESS else status.value != 0


def synchronize(stream: int, device: int = 0):
    """Wait for ``stream`` of GPU ``device`` (0: that device's legacy default stream)."""
    if not SIMULATOR:
        with _OnDevice(device):
            err = _libcuda().cuStreamSynchronize(stream)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamSynchronize failed: {error_text(err)}")



_lock = threading.Lock()  # guards _BUILDING only: held for a dict lookup, never a build
_PREPARED: dict = {}
_BUILDING: dict = {}  # key -> the lock of that key's build (while one may be under way)


def prepared(key, build):
    """The :class:`Prepared` kernel stored under ``key``, built by ``build()`` on first use
    (once, also when threads ask at the same time). Each key has its own lock: a thread
    waits only for the build of the kernel it needs, not behind every build queued before
    it. Numba still runs one compiler at a time per process (its global compiler lock), so
    builds of different kernels overlap only outside it (loading, the disk cache, the
    module load on each GPU); compiling many variants at once takes separate processes."""
    p = _PREPARED.get(key)
    if p is not None:
        return p
    with _lock:
        key_lock = _BUILDING.setdefault(key, threading.Lock())
    with key_lock:
        p = _PREPARED.get(key)
        if p is None:
            p = _PREPARED[key] = build()  # (raises: nothing kept; the next caller retries)
    with _lock:
        _BUILDING.pop(key, None)
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


@functools.cache
def sm_count(device: int) -> int:
    """The GPU's multiprocessors (split-KV's heuristic fills them); 4 in the simulator."""
    if SIMULATOR:
        return 4
    with cuda.gpus[device]:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
