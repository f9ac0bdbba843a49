"""The machine a report was measured on: its name and versions, its memory, and its
ceilings (memory bandwidth and GEMM throughput) for the roofline."""
from __future__ import annotations

import math
import os
import platform
import time

import numpy as np

from .libraries import import_torch

#: the packages whose versions a report records
VERSIONED = ("flashcore", "numpy", "numba", "scipy", "array-api-compat", "ml_dtypes",
             "torch", "jax", "jaxlib", "cupy-cuda13x", "cupy-cuda12x", "numba-cuda")


def machine_info() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in VERSIONED:
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {"hostname": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu": cpu_name(),
            "cpu_flags": cpu_flags(), "numba_cpu_target": numba_cpu_target(),
            "cpu_count": os.cpu_count(), "memory_bytes": total_host_memory(),
            "versions": versions}


def numba_cpu_target() -> dict | None:
    """What the numba_cpu kernels are compiled for: Numba's target CPU name and features
    (``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``; None: the host's) and the SIMD width the
    kernels' vectors take (``backends/numba_cpu/simd.py``: a named CPU without features
    gets 128 bits, 1.5-1.8x slower than the host's 256 on an AVX2 build). None without
    Numba."""
    try:
        from numba.core import config

        from flashcore.backends.numba_cpu import simd
    except ImportError:
        return None
    return {"cpu_name": config.CPU_NAME, "cpu_features": config.CPU_FEATURES,
            "vector_bits": simd.VECTOR_BITS}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: /proc/cpuinfo flags that decide how fast the CPU kernels can be (vector width, FMA,
#: half-precision and matrix units); x86 names, and ARM's ``asimd``/``sve``
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd",
             "sve", "sve2")


def cpu_flags() -> list[str]:
    """The instruction-set flags of :data:`ISA_FLAGS` this CPU reports (``/proc/cpuinfo``;
    empty where there is none)."""
    found = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    found.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return [flag for flag in ISA_FLAGS if flag in found]


def total_host_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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
    torch = import_torch()
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
