"""The benchmark runner: flashcore's backends and the peers a user would pick instead, side by side.

One runner serves three front ends: the main job of ``python -m flashcore``, the sweep of
``python -m flashcore bench`` and the asv suite under ``asv_bench/``. Nothing here imports a
framework at module import time; each contender imports its library when it is prepared.

Vocabulary
----------
Config
    One problem size: batch, heads, sequence length (queries = keys), head dim, dtype, causal.
Contender
    One way to compute attention: a flashcore backend called through the public API
    (``"flashcore:numba_cpu"``), or a peer (``"torch_sdpa"``, ``"torch_sdpa_flash"``,
    ``"jax_xla"``, ``"numpy_naive"``, ...). ``prepare(config, direction)`` makes the inputs and
    returns a :class:`Prepared` whose ``run()`` computes once and waits for the device.
direction
    ``"fwd"`` (forward) or ``"fwdbwd"`` (forward then backward with a fixed output gradient).

How things are measured
-----------------------
Time
    Median of ``repeat`` runs after one warm-up run (which also compiles). CPU runs are timed
    with ``time.perf_counter``; CUDA runs of PyTorch-based contenders with CUDA events around
    the call followed by ``torch.cuda.synchronize()``; JAX runs with ``perf_counter`` around
    the call and ``block_until_ready``.
FLOPs
    The convention of the FlashAttention papers: forward ``4·B·H·Nq·Nk·D`` (two matmuls),
    backward 2.5× that (five matmuls), halved when causal; the same nominal count for every
    contender, so GFLOP/s compare times (a naive causal kernel does the full work anyway).
Bytes
    A model of the memory traffic, used for the roofline: the compulsory traffic (read q, k, v,
    write o and lse; backward also reads o, do, lse and writes dq, dk, dv) for kernels that
    keep scores on chip, plus the traffic of writing and reading the ``Nq × Nk`` score and
    probability matrices for contenders that materialize them.
Peak extra host memory
    The growth of the process's resident set during one run, outputs included, inputs
    excluded. On Linux the kernel's high-water mark is reset through ``/proc/self/clear_refs``
    and read from ``VmHWM`` after freed heap memory has been handed back with ``malloc_trim``;
    this sees every allocation (NumPy, Numba's NRT, BLAS, PyTorch, XLA), unlike
    ``tracemalloc``, which sees only Python's allocator. Elsewhere a background thread samples
    the resident set every millisecond (a lower bound for very short peaks).
Peak extra GPU memory
    ``torch.cuda.max_memory_allocated()`` above the allocation before the run (after
    ``reset_peak_memory_stats``), for contenders whose arrays are PyTorch tensors; for JAX the
    device's ``peak_bytes_in_use`` when the run raised it, else unknown.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

SCHEMA = "flashcore-bench/1"
DIRECTIONS = ("fwd", "fwdbwd")
DIRECTION_LABEL = {"fwd": "forward", "fwdbwd": "forward+backward"}
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: A contender that materializes the score matrix is skipped when its estimated extra memory
#: exceeds this fraction of the memory available on its device.
MEMORY_GUARD = 0.5


# --- problem sizes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One problem size: q, k, v of shape ``(batch, heads, seqlen, head_dim)`` ("bhnd")."""

    batch: int = 1
    heads: int = 8
    seqlen: int = 4096
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False

    def __post_init__(self):
        for name in ("batch", "heads", "seqlen", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")

    @property
    def shape(self):
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    @property
    def itemsize(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[self.dtype]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def flops(self, direction: str) -> float:
        """Nominal FLOPs: forward 4·B·H·N²·D, backward 2.5× forward, halved when causal."""
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        if self.causal:
            f /= 2
        return f if direction == "fwd" else 3.5 * f

    def scores(self) -> int:
        """Elements of the score matrix, ``B·H·N²``."""
        return self.batch * self.heads * self.seqlen * self.seqlen

    def io_bytes(self, direction: str, materializes: bool = False) -> float:
        """Modelled memory traffic (see the module docstring)."""
        x = self.batch * self.heads * self.seqlen * self.head_dim * self.itemsize  # one tensor
        lse = 4 * self.batch * self.heads * self.seqlen
        fwd = 4 * x + lse  # read q, k, v; write o and lse
        # backward: read q, k, v, o, do, lse; write dq, dk, dv
        total = fwd if direction == "fwd" else fwd + 8 * x + lse
        if materializes:
            s = self.scores() * max(self.itemsize, 4) * (0.5 if self.causal else 1.0)
            # forward: write S, read S, write P, read P;
            # backward: read P, write and read dP, write and read dS
            total += 4 * s if direction == "fwd" else 9 * s
        return float(total)

    def label(self) -> str:
        c = "causal" if self.causal else "non-causal"
        return (f"B={self.batch} H={self.heads} N={self.seqlen} D={self.head_dim} "
                f"{self.dtype} {c}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- inputs ------------------------------------------------------------------------------


def host_inputs(config: Config, seed: int = 0, with_grad: bool = True):
    """Seeded standard-normal ``q, k, v`` (and ``do``) as NumPy arrays in ``config.dtype``,
    shape ``(B, H, N, D)``; bfloat16 as ``ml_dtypes.bfloat16``."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(config.dtype) if config.dtype != "bfloat16" else _bf16()
    n = 4 if with_grad else 3
    return tuple(rng.standard_normal(config.shape, dtype=np.float32).astype(dt, copy=False)
                 for _ in range(n))


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_library(a: np.ndarray, library: str, device: str = "cpu", layout: str = "bhnd"):
    """Hand a host array (given in bhnd) to ``library`` on ``device``, in ``layout``."""
    if layout == "bnhd":
        a = np.ascontiguousarray(np.swapaxes(a, 1, 2))
    if library == "numpy":
        return a
    if library == "torch":
        torch = _import_torch()
        if a.dtype.name == "bfloat16":
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a)
        return t.to(device) if device != "cpu" else t
    if library == "jax":
        jax = _import_jax()
        plat = "gpu" if device.startswith("cuda") else "cpu"
        idx = int(device.split(":")[1]) if ":" in device else 0
        return jax.device_put(a, jax.devices(plat)[idx])
    if library == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.split(":")[1]) if ":" in device else 0):
            return cupy.asarray(a)
    raise ValueError(f"library={library!r} is not one of ('numpy', 'torch', 'jax', 'cupy')")


def _import_torch():
    import torch

    return torch


def _import_jax():
    # JAX would otherwise grab 75% of GPU memory at start-up, starving every other contender.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    return jax


# --- memory ------------------------------------------------------------------------------


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return None


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap():
    """Return freed heap memory to the OS, so that reusing it later counts as growth."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_peak_method() -> str:
    if _hwm_bytes() is not None and _reset_hwm():
        return "VmHWM"
    return "sampler" if _rss_bytes() is not None else "none"


class _Sampler:
    """Samples the resident set in a background thread (the fallback where VmHWM is missing)."""

    def __init__(self, period=1e-3):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes() or 0)
            time.sleep(self.period)

    def __enter__(self):
        self.peak = _rss_bytes() or 0
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes() or 0)


def peak_extra_host_bytes(fn) -> tuple[int | None, str]:
    """Run ``fn()`` once; return (growth of the resident set at its peak in bytes, method)."""
    _trim_heap()
    method = host_peak_method()
    base = _rss_bytes()
    if method == "VmHWM":
        _reset_hwm()
        base = _rss_bytes()
        out = fn()
        peak = _hwm_bytes()
        del out
        return max(0, peak - base), method
    if method == "sampler":
        with _Sampler() as s:
            out = fn()
        del out
        return max(0, s.peak - base), method
    out = fn()
    return None, method


# --- timing ------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A contender made ready for one config and direction.

    ``call()`` computes once and returns its outputs (possibly still running on a device);
    ``sync(out)`` waits for them. ``run()`` does both and is what gets timed.
    """

    call: object
    sync: object = None
    timer: str = "perf_counter"  # or "cuda_event" (PyTorch on CUDA)
    gpu_memory: str | None = None  # "torch" or "jax:<device>" where GPU memory can be read
    device: str = "cpu"
    outputs: object = None  # what the warm-up returned (for checks)

    def run(self):
        out = self.call()
        if self.sync is not None:
            self.sync(out)
        return out


def time_runs(prep: Prepared, repeat: int = 5, warmup: int = 1, budget_s: float | None = None):
    """Seconds of ``repeat`` runs after ``warmup`` untimed runs. With ``budget_s``, stop early
    (after at least 3 runs) once the timed runs add up to more than that."""
    for _ in range(warmup):
        prep.outputs = prep.run()
    times = []
    if prep.timer == "cuda_event":
        torch = _import_torch()
        dev = torch.device(prep.device)

        def once():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            start.record()
            prep.call()
            end.record()
            torch.cuda.synchronize(dev)
            return start.elapsed_time(end) / 1e3
    else:
        def once():
            t0 = time.perf_counter()
            prep.run()
            return time.perf_counter() - t0
    while len(times) < repeat:
        times.append(once())
        if budget_s is not None and len(times) >= 3 and sum(times) > budget_s:
            break
    return times


def gpu_peak_extra_bytes(prep: Prepared) -> int | None:
    """Peak extra device memory of one run, where the device's allocator can tell it."""
    if prep.gpu_memory == "torch":
        torch = _import_torch()
        dev = torch.device(prep.device)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        out = prep.run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del out
        return max(0, peak - base)
    if prep.gpu_memory and prep.gpu_memory.startswith("jax"):
        jax = _import_jax()
        idx = int(prep.device.split(":")[1]) if ":" in prep.device else 0
        d = jax.devices("gpu")[idx]
        before = d.memory_stats() or {}
        out = prep.run()
        after = d.memory_stats() or {}
        del out
        if after.get("peak_bytes_in_use", 0) > before.get("peak_bytes_in_use", 0):
            return max(0, after["peak_bytes_in_use"] - before.get("bytes_in_use", 0))
        return None  # the run stayed under an earlier peak: not measurable this way
    return None


# --- contenders --------------------------------------------------------------------------


class Contender:
    """One way to compute attention. Subclasses set the fields and implement ``_prepare``."""

    name = ""
    kind = "peer"  # "flashcore" or "peer"
    library = "numpy"
    device = "cpu"
    materializes = False  # builds the Nq × Nk score matrix
    description = ""

    def unavailable_reason(self, config: Config | None = None) -> str | None:
        """None if this contender can run ``config`` here, else why not."""
        why = _library_reason(self.library, self.device)
        if why is None and config is not None and self.materializes:
            why = _memory_guard(self, config)
        return why

    def prepare(self, config: Config, direction: str, seed: int = 0, host=None) -> Prepared:
        """Make inputs (``host``: the arrays of :func:`host_inputs`, if already made) and
        return the ready-to-run call."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
        if host is None:
            host = host_inputs(config, seed)
        prep = self._prepare(config, direction, host)
        prep.device = self.device
        return prep

    def _prepare(self, config, direction, host) -> Prepared:
        raise NotImplementedError

    def estimated_extra_bytes(self, config: Config, direction: str = "fwdbwd") -> float:
        """Rough extra memory of a materializing run (score-sized temporaries)."""
        s = config.scores() * max(config.itemsize, 4)
        return (3 if direction == "fwd" else 6) * s

    def info(self) -> dict:
        return {"name": self.name, "kind": self.kind, "library": self.library,
                "device": self.device, "materializes": self.materializes,
                "description": self.description}

    def __repr__(self):
        return f"<contender {self.name}>"


def _memory_guard(contender, config) -> str | None:
    need = contender.estimated_extra_bytes(config)
    if contender.device == "cpu":
        have = available_host_memory()
    else:
        have = _gpu_free_bytes(contender.device)
    if have is not None and need > MEMORY_GUARD * have:
        return (f"it materializes the {config.seqlen}x{config.seqlen} score matrices "
                f"(about {need / 2**30:.1f} GiB) and {have / 2**30:.1f} GiB are free")
    return None


def _gpu_free_bytes(device):
    try:
        torch = _import_torch()
        return torch.cuda.mem_get_info(torch.device(device))[0]
    except Exception:  # no torch, or no CUDA through torch
        return None


def backend_reason(name: str) -> str | None:
    """``flashcore._dispatch.unavailable_reason(name)``, with a backend that fails to answer
    (a module still being written, a broken install) reported as a reason, not raised."""
    from flashcore import _dispatch

    try:
        return _dispatch.unavailable_reason(name)
    except Exception as e:  # the backend does not answer its contract: it cannot run here
        return f"backend {name!r} does not answer (it raised {_first_line(e)})"


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _library_reason(library: str, device: str) -> str | None:
    if library != "numpy" and not _has_module(library):
        return f"{library} is not installed"
    if device == "cpu":
        return None
    if library == "torch":
        torch = _import_torch()
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA GPU"
        return None
    if library == "jax":
        jax = _import_jax()
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


def _sync_for(library, device):
    if device == "cpu":
        if library == "jax":
            return lambda out: _import_jax().block_until_ready(out)
        return None
    if library == "torch":
        torch = _import_torch()
        return lambda out: torch.cuda.synchronize(torch.device(device))
    if library == "jax":
        return lambda out: _import_jax().block_until_ready(out)
    if library == "cupy":
        import cupy

        return lambda out: cupy.cuda.get_current_stream().synchronize()
    return None


def _timer_for(library, device):
    return "cuda_event" if (library == "torch" and device != "cpu") else "perf_counter"


def _gpu_memory_for(library, device):
    if device == "cpu":
        return None
    return {"torch": "torch", "jax": "jax"}.get(library)


class FlashcoreContender(Contender):
    """A flashcore backend called through the public API (``attention_forward`` and, for
    fwd+bwd, ``attention_backward``) on arrays of the library that backend serves."""

    kind = "flashcore"

    def __init__(self, backend: str, library: str, device: str = "cpu"):
        self.backend, self.library, self.device = backend, library, device
        self.name = f"flashcore:{backend}" + ("" if device == "cpu" else "@gpu")
        self.materializes = backend == "reference"
        self.description = f"flashcore backend {backend!r} on {library} arrays ({device})"

    def unavailable_reason(self, config=None):
        why = _library_reason(self.library, self.device)
        if why is not None:
            return why
        why = backend_reason(self.backend)
        if why is not None:
            return why
        if config is not None and self.materializes:
            return _memory_guard(self, config)
        return None

    def estimated_extra_bytes(self, config, direction="fwdbwd"):
        s = config.scores() * 8  # the reference computes in float64
        return (3 if direction == "fwd" else 6) * s

    def _prepare(self, config, direction, host):
        import flashcore

        q, k, v, do = (to_library(a, self.library, self.device) for a in host)
        opts = dict(causal=config.causal, backend=self.backend)
        if direction == "fwd":
            def call():
                return flashcore.attention_forward(q, k, v, **opts)
        else:
            def call():
                o, lse = flashcore.attention_forward(q, k, v, **opts)
                return flashcore.attention_backward(do, q, k, v, o, lse, **opts)
        return Prepared(call, _sync_for(self.library, self.device),
                        _timer_for(self.library, self.device),
                        _gpu_memory_for(self.library, self.device))


#: torch.nn.attention.SDPBackend member per peer name suffix
_SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


class TorchSdpa(Contender):
    """``torch.nn.functional.scaled_dot_product_attention``; ``kernel`` pins one of its
    backends through ``torch.nn.attention.sdpa_kernel`` (None lets PyTorch choose)."""

    library = "torch"

    def __init__(self, kernel: str | None = None, device: str = "cpu"):
        self.kernel, self.device = kernel, device
        self.name = "torch_sdpa" + (f"_{kernel}" if kernel else "") + (
            "" if device == "cpu" else "@gpu")
        self.materializes = kernel == "math"
        self.description = (f"torch SDPA ({kernel or 'default choice'}) on {device}")

    def _prepare(self, config, direction, host):
        torch = _import_torch()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q, k, v, do = (to_library(a, "torch", self.device) for a in host)
        causal = config.causal
        if self.kernel:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = lambda: sdpa_kernel(getattr(SDPBackend, _SDPA_KERNELS[self.kernel]))  # noqa: E731
        else:
            ctx = contextlib.nullcontext
        if direction == "fwd":
            def call():
                with torch.no_grad(), ctx():
                    return sdpa(q, k, v, is_causal=causal)
        else:
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def call():
                with ctx():
                    o = sdpa(qg, kg, vg, is_causal=causal)
                    return torch.autograd.grad(o, (qg, kg, vg), do)
        return Prepared(call, _sync_for("torch", self.device), _timer_for("torch", self.device),
                        _gpu_memory_for("torch", self.device))


class JaxDpa(Contender):
    """``jax.nn.dot_product_attention`` with ``implementation`` "xla" or "cudnn", jitted,
    on ``(B, N, H, D)`` arrays (JAX's own layout)."""

    library = "jax"

    def __init__(self, implementation: str = "xla", device: str = "cpu"):
        self.implementation, self.device = implementation, device
        self.name = f"jax_{implementation}" + ("" if device == "cpu" else "@gpu")
        self.materializes = implementation == "xla"
        self.description = f"jax.nn.dot_product_attention(implementation={implementation!r})"

    def unavailable_reason(self, config=None):
        if self.implementation == "cudnn" and self.device == "cpu":
            return "cuDNN needs a GPU"
        if config is not None and config.dtype == "float64":
            return "JAX computes float64 only with jax_enable_x64, which the bench leaves off"
        if config is not None and self.implementation == "cudnn" and config.dtype not in (
                "float16", "bfloat16"):
            return "JAX's cuDNN attention takes float16 and bfloat16 only"
        return super().unavailable_reason(config)

    def _prepare(self, config, direction, host):
        jax = _import_jax()
        q, k, v, do = (to_library(a, "jax", self.device, layout="bnhd") for a in host)
        impl, causal = self.implementation, config.causal

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

        if direction == "fwd":
            fj = jax.jit(f)

            def call():
                return fj(q, k, v)
        else:
            fbj = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))

            def call():
                return fbj(q, k, v, do)
        return Prepared(call, _sync_for("jax", self.device), "perf_counter",
                        _gpu_memory_for("jax", self.device))


class Naive(Contender):
    """softmax(Q Kᵀ · scale) V written plainly with the library's own array functions
    (Array API), materializing the scores; fwd+bwd adds the textbook backward. float16 and
    bfloat16 inputs are computed in float32 (NumPy has no fast half-precision matmul)."""

    materializes = True

    def __init__(self, library: str = "numpy", device: str = "cpu"):
        self.library, self.device = library, device
        self.name = f"{library}_naive" + ("" if device == "cpu" else "@gpu")
        self.description = f"naive softmax(QK^T)V in {library} ({device})"

    def _prepare(self, config, direction, host):
        if self.library == "numpy" and config.dtype in ("float16", "bfloat16"):
            host = tuple(a.astype(np.float32) for a in host)
        q, k, v, do = (to_library(a, self.library, self.device) for a in host)
        import array_api_compat

        xp = array_api_compat.array_namespace(q)
        scale, causal = config.scale, config.causal
        if direction == "fwd":
            def call():
                return naive_forward(xp, q, k, v, scale, causal)[0]
        else:
            def call():
                o, p = naive_forward(xp, q, k, v, scale, causal)
                return naive_backward(xp, do, q, k, v, o, p, scale)
        return Prepared(call, _sync_for(self.library, self.device),
                        _timer_for(self.library, self.device),
                        _gpu_memory_for(self.library, self.device))


def naive_forward(xp, q, k, v, scale, causal):
    """``(o, p)``: output and probabilities of softmax(q kᵀ · scale) v, bottom-right causal.

    Written as a careful user would: augmented assignments, which update NumPy, PyTorch and
    CuPy arrays in place (and rebind JAX's), so only the score matrix itself is allocated."""
    s = xp.matmul(q * scale, xp.matrix_transpose(k))
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        dev = array_device(q)
        i = xp.reshape(xp.arange(nq, device=dev), (nq, 1))
        j = xp.reshape(xp.arange(nk, device=dev), (1, nk))
        s = _fill_where(xp, s, j > i + (nk - nq), -math.inf)
    s -= xp.max(s, axis=-1, keepdims=True)
    p = _exp_inplace(xp, s)
    p /= xp.sum(p, axis=-1, keepdims=True)
    return xp.matmul(p, v), p


def naive_backward(xp, do, q, k, v, o, p, scale):
    """``(dq, dk, dv)`` from the saved probabilities ``p``."""
    t = xp.matrix_transpose
    dv = xp.matmul(t(p), do)
    ds = xp.matmul(do, t(v))  # dP, turned into dS = P * (dP - rowsum(dO * O)) in place
    ds -= xp.sum(do * o, axis=-1, keepdims=True)
    ds *= p
    dq = xp.matmul(ds, k * scale)
    dk = xp.matmul(t(ds), q * scale)
    return dq, dk, dv


def _exp_inplace(xp, s):
    if isinstance(s, np.ndarray):
        return np.exp(s, out=s)
    if hasattr(s, "exp_"):  # torch
        return s.exp_()
    return xp.exp(s)


def _fill_where(xp, s, mask, value):
    """``s`` with ``value`` where ``mask`` (broadcast) is true; in place where the library can."""
    if isinstance(s, np.ndarray):
        np.copyto(s, value, where=np.broadcast_to(mask, s.shape))
        return s
    if hasattr(s, "masked_fill_"):  # torch
        return s.masked_fill_(mask, value)
    return xp.where(mask, xp.asarray(value, dtype=s.dtype, device=array_device(s)), s)


def array_device(x):
    import array_api_compat

    return array_api_compat.device(x)


def _gpu_library():
    """The library GPU inputs of flashcore's CUDA backend are made in (PyTorch, else CuPy)."""
    if _has_module("torch") and _library_reason("torch", "cuda:0") is None:
        return "torch"
    if _has_module("cupy") and _library_reason("cupy", "cuda:0") is None:
        return "cupy"
    return None


def contenders(device: str = "auto") -> list[Contender]:
    """Every contender this runner knows, for ``device`` ("cpu", "cuda", or "auto": the GPU
    contenders where a GPU is visible, else the CPU ones). Availability is not checked here."""
    if device == "auto":
        device = "cuda" if _gpu_library() is not None else "cpu"
    if device == "cpu":
        return [
            FlashcoreContender("numba_cpu", "numpy"),
            FlashcoreContender("torch", "torch"),
            FlashcoreContender("jax", "jax"),
            FlashcoreContender("reference", "numpy"),
            TorchSdpa(None), TorchSdpa("math"),
            JaxDpa("xla"),
            Naive("numpy"),
        ]
    if device == "cuda":
        dev = "cuda:0"
        lib = _gpu_library() or "torch"
        return [
            FlashcoreContender("numba_cuda", lib, dev),
            FlashcoreContender("torch", "torch", dev),
            FlashcoreContender("jax", "jax", dev),
            TorchSdpa("flash", dev), TorchSdpa("cudnn", dev), TorchSdpa("efficient", dev),
            TorchSdpa("math", dev),
            JaxDpa("cudnn", dev), JaxDpa("xla", dev),
            Naive("torch", dev),
        ]
    raise ValueError(f"device={device!r} is not one of ('auto', 'cpu', 'cuda')")


#: Contenders left out of a default sweep (slow or redundant); name them to include them.
NOT_BY_DEFAULT = {"flashcore:reference", "torch_sdpa_math", "flashcore:jax", "flashcore:torch"}


def get_contender(name: str) -> Contender:
    """The contender called ``name`` (CPU names, or GPU names with the ``@gpu`` suffix)."""
    for c in contenders("cpu") + contenders("cuda"):
        if c.name == name:
            return c
    raise ValueError(f"contender {name!r} is not one of {contender_names()}")


def contender_names() -> list[str]:
    return [c.name for c in contenders("cpu") + contenders("cuda")]


def default_contenders(device: str = "auto") -> list[Contender]:
    """The contenders a default sweep runs: those available here, minus NOT_BY_DEFAULT; the
    flashcore reference joins only when flashcore has no kernel backend here."""
    cands = [c for c in contenders(device) if c.unavailable_reason() is None]
    own = [c for c in cands if c.kind == "flashcore" and c.backend not in ("reference",)]
    chosen = [c for c in cands if c.name not in NOT_BY_DEFAULT]
    if not own:
        chosen = [c for c in cands if c.name == "flashcore:reference"] + chosen
    return chosen


# --- machine ceilings --------------------------------------------------------------------


def measure_ceilings(device: str = "cpu", dtype: str = "float32", quick: bool = False) -> dict:
    """This machine's memory bandwidth (GB/s, a large copy) and GEMM throughput (GFLOP/s,
    a square matmul in ``dtype``, float32 for half types on the CPU), best of a few runs."""
    if device == "cpu":
        n = (1 << 23) if quick else (1 << 25)  # float32 elements: 32 MiB or 128 MiB
        a = np.ones(n, dtype=np.float32)
        b = np.empty_like(a)
        np.copyto(b, a)
        best = min(_seconds(lambda: np.copyto(b, a)) for _ in range(5))
        bw = 2 * a.nbytes / best / 1e9
        gdt = np.float64 if dtype == "float64" else np.float32
        m = 1024 if quick else 2048
        x = np.ones((m, m), dtype=gdt)
        y = np.ones((m, m), dtype=gdt)
        x @ y
        best = min(_seconds(lambda: x @ y) for _ in range(3))
        return {"device": "cpu", "mem_bw_GBps": bw, "gemm_GFLOPps": 2 * m**3 / best / 1e9,
                "gemm_dtype": np.dtype(gdt).name,
                "how": f"NumPy copy of {n * 4 >> 20} MiB; NumPy matmul {m}x{m}"}
    torch = _import_torch()
    dev = torch.device("cuda:0" if device == "cuda" else device)
    tdt = getattr(torch, dtype)
    a = torch.ones(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB
    b = torch.empty_like(a)
    bw_t = _cuda_best(torch, dev, lambda: b.copy_(a), 10)
    bw = 2 * a.numel() * 4 / bw_t / 1e9
    m = 8192
    x = torch.randn(m, m, device=dev).to(tdt)
    y = torch.randn(m, m, device=dev).to(tdt)
    g_t = _cuda_best(torch, dev, lambda: x @ y, 5)
    return {"device": str(dev), "mem_bw_GBps": bw, "gemm_GFLOPps": 2 * m**3 / g_t / 1e9,
            "gemm_dtype": dtype, "how": f"torch copy of 1 GiB; torch matmul {m}x{m}"}


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cuda_best(torch, dev, fn, n):
    fn()
    torch.cuda.synchronize(dev)
    best = math.inf
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize(dev)
        best = min(best, s.elapsed_time(e) / 1e3)
    return best


# --- one measurement ---------------------------------------------------------------------


def measure(contender: Contender, config: Config, direction: str, *, repeat: int = 5,
            warmup: int = 1, budget_s: float | None = None, memory: bool = True,
            seed: int = 0, check=None, host=None) -> dict:
    """Time (and measure the memory of) one contender on one config and direction.

    ``check(outputs) -> dict``, if given, is called on the warm-up run's outputs and its answer
    stored under ``"check"``. Never raises for a contender's failure: a contender that
    cannot run here comes back with
    ``"skipped"`` (the reason), one that fails with ``"error"`` (the exception's first line).
    """
    rec = {"contender": contender.name, "kind": contender.kind, "library": contender.library,
           "device": contender.device, "config": config.as_dict(), "direction": direction,
           "flops": config.flops(direction),
           "bytes": config.io_bytes(direction, contender.materializes),
           "times_s": [], "median_s": None, "gflops_per_s": None,
           "peak_extra_host_bytes": None, "host_peak_method": None,
           "peak_extra_gpu_bytes": None, "skipped": None, "error": None}
    why = contender.unavailable_reason(config)
    if why is not None:
        rec["skipped"] = why
        return rec
    prep = None
    try:
        prep = contender.prepare(config, direction, seed, host)
        try:
            prep.outputs = prep.run()  # the first run compiles: not timed
        except Exception as e:  # the contender declined this config (e.g. no kernel for it)
            rec["skipped"] = _first_line(e)
            return rec
        if check is not None:
            rec["check"] = check(prep.outputs)
        times = time_runs(prep, repeat=repeat, warmup=max(0, warmup - 1), budget_s=budget_s)
        rec["times_s"] = times
        med = statistics.median(times)
        rec["median_s"] = med
        rec["gflops_per_s"] = rec["flops"] / med / 1e9
        if memory:
            prep.outputs = None
            if contender.device == "cpu":
                b, method = peak_extra_host_bytes(prep.run)
                rec["peak_extra_host_bytes"], rec["host_peak_method"] = b, method
            else:
                rec["peak_extra_gpu_bytes"] = gpu_peak_extra_bytes(prep)
    except Exception as e:  # report, don't abort the sweep
        rec["error"] = _first_line(e)
    finally:
        del prep
        gc.collect()
    return rec


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# --- the sweep ---------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream=None, enabled: bool = True, width: int = 28):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str):
        """Show that the next step, ``label``, starts."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            filled = int(self.width * self.done / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            line = f"[{bar}] {self.done}/{self.total} {elapsed:4.0f}s  {label}"
            self.stream.write("\r\x1b[K" + line[:150])
        else:
            self.stream.write(f"[{self.done + 1}/{self.total} {elapsed:4.0f}s] {label}\n")
        self.stream.flush()

    def advance(self):
        self.done += 1

    def close(self):
        if self.enabled and self.tty:
            filled = "#" * self.width
            elapsed = time.perf_counter() - self.t0
            self.stream.write(
                f"\r\x1b[K[{filled}] {self.done}/{self.total} {elapsed:4.0f}s  done\n")
            self.stream.flush()


@dataclass
class SweepOptions:
    batch: int = 1
    heads: int = 8
    seqlens: tuple = (512, 1024, 2048, 4096)
    head_dims: tuple = (64,)
    dtypes: tuple = ("float32",)
    causal: tuple = (False, True)
    directions: tuple = DIRECTIONS
    repeat: int = 5
    budget_s: float = 2.0
    memory: bool = True
    device: str = "auto"
    contenders: tuple | None = None  # names; None = default_contenders(device)
    ceilings: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def configs(self) -> list[Config]:
        return [Config(self.batch, self.heads, n, d, dt, c)
                for dt in self.dtypes for d in self.head_dims for c in self.causal
                for n in self.seqlens]


def machine_info() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("flashcore", "numpy", "numba", "scipy", "array-api-compat", "ml_dtypes",
                "torch", "jax", "jaxlib", "cupy-cuda13x", "cupy-cuda12x", "numba-cuda"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {"hostname": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "memory_bytes": total_host_memory(),
            "versions": versions}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_host_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def run_sweep(opts: SweepOptions, progress: bool = True, stream=None) -> dict:
    """Measure every chosen contender on every config and direction; return the JSON-able
    report (schema ``flashcore-bench/1``, see :func:`validate_report`)."""
    if opts.contenders:
        chosen = [get_contender(n) for n in opts.contenders]
    else:
        chosen = default_contenders(opts.device)
    configs = opts.configs()
    steps = [(cfg, d, c) for cfg in configs for d in opts.directions for c in chosen]
    bar = Progress(len(steps) + (1 if opts.ceilings else 0), stream=stream, enabled=progress)
    results = []
    ceilings = None
    dev = "cpu" if all(c.device == "cpu" for c in chosen) else "cuda"
    if opts.ceilings:
        bar.step("measuring this machine's bandwidth and GEMM ceilings")
        try:
            ceilings = measure_ceilings(dev, opts.dtypes[0])
        except Exception as e:  # a ceiling is a nicety; the sweep goes on without it
            ceilings = {"error": _first_line(e)}
        bar.advance()
    for cfg, direction, c in steps:
        bar.step(f"{c.name} {DIRECTION_LABEL[direction]} {cfg.label()}")
        results.append(measure(c, cfg, direction, repeat=opts.repeat, budget_s=opts.budget_s,
                               memory=opts.memory, seed=opts.seed))
        bar.advance()
    bar.close()
    add_ratios(results)
    options = dataclasses.asdict(opts)
    return {"schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "ceilings": ceilings, "options": options,
            "contenders": [c.info() for c in chosen], "results": results}


def add_ratios(results: list[dict]):
    """Set ``ratio_to_best_peer`` (time / fastest peer's time on the same config and
    direction; None where no peer ran) and ``best_peer`` on every record."""
    groups = {}
    for r in results:
        key = (json.dumps(r["config"], sort_keys=True), r["direction"])
        groups.setdefault(key, []).append(r)
    for rs in groups.values():
        peers = [r for r in rs if r["kind"] == "peer" and r["median_s"]]
        best = min(peers, key=lambda r: r["median_s"]) if peers else None
        for r in rs:
            r["best_peer"] = best["contender"] if best else None
            r["ratio_to_best_peer"] = (r["median_s"] / best["median_s"]
                                       if best and r["median_s"] else None)


#: Keys every result record has, with the types their values may take.
RESULT_KEYS = {
    "contender": (str,), "kind": (str,), "library": (str,), "device": (str,),
    "config": (dict,), "direction": (str,), "flops": (float, int), "bytes": (float, int),
    "times_s": (list,), "median_s": (float, type(None)), "gflops_per_s": (float, type(None)),
    "peak_extra_host_bytes": (int, type(None)), "host_peak_method": (str, type(None)),
    "peak_extra_gpu_bytes": (int, type(None)), "skipped": (str, type(None)),
    "error": (str, type(None)), "ratio_to_best_peer": (float, type(None)),
    "best_peer": (str, type(None)),
}


def validate_report(report: dict):
    """Raise ValueError if ``report`` does not follow schema ``flashcore-bench/1``."""
    for key in ("schema", "created", "machine", "ceilings", "options", "contenders", "results"):
        if key not in report:
            raise ValueError(f"report lacks the key {key!r}")
    if report["schema"] != SCHEMA:
        raise ValueError(f"schema={report['schema']!r}, expected {SCHEMA!r}")
    for i, r in enumerate(report["results"]):
        for key, types in RESULT_KEYS.items():
            if key not in r:
                raise ValueError(f"results[{i}] lacks the key {key!r}")
            if not isinstance(r[key], types):
                raise ValueError(f"results[{i}][{key!r}] = {r[key]!r} is not of {types}")
        if r["direction"] not in DIRECTIONS:
            raise ValueError(f"results[{i}]['direction'] = {r['direction']!r}")
        Config(**r["config"])


def write_json(report: dict, path):
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


# --- text tables -------------------------------------------------------------------------


def _fmt_time(s):
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _fmt_mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def format_tables(report: dict) -> str:
    """The ratio tables: one per (dtype, head dim, causal) and direction, rows per seqlen and
    contender, time relative to the fastest peer."""
    rs = report["results"]
    gpu = any(r["device"] != "cpu" for r in rs)
    unit, div = ("TFLOP/s", 1e3) if gpu else ("GFLOP/s", 1.0)
    out = []
    groups = {}
    for r in rs:
        c = r["config"]
        key = (c["dtype"], c["head_dim"], c["causal"], c["batch"], c["heads"], r["direction"])
        groups.setdefault(key, []).append(r)
    for (dt, d, causal, b, h, direction), grp in groups.items():
        out.append(f"\n{DIRECTION_LABEL[direction]}: B={b} H={h} D={d} {dt} "
                   f"{'causal' if causal else 'non-causal'}   (x peer = time / fastest peer's)")
        mem_col = "GPU peak MiB" if gpu else "peak MiB"
        header = (f"{'N':>6}  {'contender':<24} {'time':>10} {'x peer':>7} {unit:>8} "
                  f"{'GB moved':>9} {mem_col:>12}")
        out.append(header)
        out.append("-" * len(header))
        for r in sorted(grp, key=lambda r: r["config"]["seqlen"]):
            n = r["config"]["seqlen"]
            if r["median_s"] is None:
                why = r["skipped"] or r["error"]
                tag = "skipped" if r["skipped"] else "error"
                out.append(f"{n:>6}  {r['contender']:<24} {tag}: {why}"[:160])
                continue
            ratio = r.get("ratio_to_best_peer")
            mem = r["peak_extra_gpu_bytes"] if gpu else r["peak_extra_host_bytes"]
            out.append(f"{n:>6}  {r['contender']:<24} {_fmt_time(r['median_s']):>10} "
                       f"{(f'{ratio:.2f}' if ratio else '-'):>7} "
                       f"{r['gflops_per_s'] / div:>8.3g} {r['bytes'] / 1e9:>9.3g} "
                       f"{_fmt_mib(mem):>12}")
    ceil = report.get("ceilings") or {}
    if "mem_bw_GBps" in ceil:
        out.append(f"\nthis machine: memory bandwidth {ceil['mem_bw_GBps']:.1f} GB/s, "
                   f"GEMM {ceil['gemm_GFLOPps']:.1f} GFLOP/s "
                   f"({ceil['gemm_dtype']}; {ceil['how']})")
    out.append("time: median after a warm-up; FLOP/s: nominal FLOPs (4BHN^2D forward, 2.5x that "
               "backward, halved causal); GB moved: modelled traffic; peak: extra memory of one "
               "run, outputs included")
    return "\n".join(out)


# --- plots -------------------------------------------------------------------------------


def plot(report: dict, outdir) -> list[str]:
    """Write PNGs into ``outdir``: time against sequence length per contender (one figure per
    direction, one panel per dtype/head dim/causal) and a roofline. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    outdir = os.fspath(outdir)
    os.makedirs(outdir, exist_ok=True)
    rs = [r for r in report["results"] if r["median_s"]]
    names = sorted({r["contender"] for r in report["results"]})
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    paths = []
    for direction in DIRECTIONS:
        drs = [r for r in rs if r["direction"] == direction]
        if not drs:
            continue
        panels = sorted({(r["config"]["dtype"], r["config"]["head_dim"], r["config"]["causal"])
                         for r in drs}, key=str)
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (dt, d, causal) in zip(axes[0], panels):
            for name in names:
                pts = sorted((r["config"]["seqlen"], r["median_s"] * 1e3) for r in drs
                             if r["contender"] == name and r["config"]["dtype"] == dt
                             and r["config"]["head_dim"] == d and r["config"]["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, color=colors[name])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("time (ms, median)")
            ax.set_title(f"{DIRECTION_LABEL[direction]}: D={d} {dt} "
                         f"{'causal' if causal else 'non-causal'}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(outdir, f"time_vs_seqlen_{direction}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths.append(_roofline(plt, report, rs, colors, outdir))
    return paths


def _roofline(plt, report, rs, colors, outdir):
    gpu = any(r["device"] != "cpu" for r in rs)
    div, unit = (1e3, "TFLOP/s") if gpu else (1.0, "GFLOP/s")
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [r["flops"] / r["bytes"] for r in rs] or [1.0]
    ceil = report.get("ceilings") or {}
    if "mem_bw_GBps" in ceil:
        bw, peak = ceil["mem_bw_GBps"], ceil["gemm_GFLOPps"]
        lo, hi = min(min(xs), peak / bw) / 4, max(max(xs), peak / bw) * 4
        grid = np.geomspace(lo, hi, 200)
        ax.plot(grid, np.minimum(peak, bw * grid) / div, color="black", lw=1.5,
                label=f"roof: {bw:.0f} GB/s, {peak / div:.3g} {unit} ({ceil['gemm_dtype']} GEMM)")
    for name in sorted({r["contender"] for r in rs}):
        for direction, marker in (("fwd", "o"), ("fwdbwd", "s")):
            pts = [(r["flops"] / r["bytes"], r["gflops_per_s"] / div) for r in rs
                   if r["contender"] == name and r["direction"] == direction]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=colors[name],
                           facecolors=colors[name] if direction == "fwd" else "none",
                           label=f"{name} ({DIRECTION_LABEL[direction]})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / modelled byte)")
    ax.set_ylabel(f"achieved {unit}")
    ax.set_title("roofline of this machine")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = os.path.join(outdir, "roofline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
