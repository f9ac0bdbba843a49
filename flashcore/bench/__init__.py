"""The benchmark: flashcore's backends and the peers a user would pick instead, side by side.

One runner serves three front ends: the main job of ``python -m flashcore``, the sweep of
``python -m flashcore bench`` and the asv suite under ``asv_bench/``. Nothing here imports a
framework at module import time; each contender imports its library when it is prepared.

Modules, each importing only those above it
-------------------------------------------
``libraries``      lazy framework imports; which library reaches which device; waiting
``masks``          the masked cases (``window:W``, ``docs:K``, ``softcap:C``, ``alibi``, ...):
                   parsing, visible fraction, how each contender is given them
``config``         :class:`Config` (one problem size) and the seeded inputs
``measure``        :class:`Prepared`, time of a run, peak extra memory, :func:`measure`
``machine``        the machine's name, versions, memory and bandwidth/GEMM ceilings
``contender``      :class:`Contender`, the memory guard, whether a backend answers
``flashcore_api``, ``torch_sdpa``, ``torch_flex``, ``jax_dpa``, ``naive``
                   the contenders, one module per family
``registry``       the contenders by name, and the default choice
``report``         the report's schema, JSON, text tables;  ``plots``: the PNG figures
``sweep``          the sweep over configs, directions and contenders, into one report

Vocabulary
----------
Config
    One problem size: batch, heads, sequence length (queries = keys), head dim, dtype, causal,
    and a mask (``"none"`` by default; see :mod:`flashcore.bench.masks`).
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
    the call and ``block_until_ready``. A sweep's contenders take their timed runs in turns
    on each config and direction (A B, B A, A B, ...; ``measure_interleaved``), so that a
    change in a shared host's load falls on all of them alike; ``--no-interleave`` times
    each one's runs back to back. ``budget_s`` cuts the runs short (after at least 3) once
    the slowest contender's add up to more.
FLOPs
    The convention of the FlashAttention papers: forward ``4·B·H·Nq·Nk·D`` (two matmuls),
    backward 2.5× that (five matmuls), halved when causal; the same nominal count for every
    contender, so GFLOP/s compare times (a naive causal kernel does the full work anyway).
    Masked configs count only the visible (query, key) pairs (``window:W`` about ``W/N``,
    ``docs:K`` about ``1/K``), so FLOP/s of a masked case stay comparable with a full one.
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
Host time of a call (``--host-overhead``)
    On a tiny input (B=1, H=1, N=16), the best of 5 blocks of 2000 back-to-back forward
    calls, the device waited for only after each block: what a call costs the host.
"""
from __future__ import annotations

from .config import DIRECTION_LABEL, DIRECTIONS, DTYPES, Config, host_inputs, to_library
from .contender import MEMORY_GUARD, Contender, backend_reason
from .flashcore_api import FlashcoreContender
from .jax_dpa import JaxDpa
from .libraries import gpu_library, has_module, import_jax, import_torch, library_reason
from .machine import machine_info, measure_ceilings
from .masks import Mask, parse_mask
from .measure import (
    Prepared,
    gpu_peak_extra_bytes,
    host_peak_method,
    host_seconds_per_call,
    measure,
    measure_interleaved,
    peak_extra_host_bytes,
    time_one_run,
    time_runs,
)
from .naive import Naive, naive_backward, naive_forward
from .plots import plot
from .registry import (
    NOT_BY_DEFAULT,
    WITH_MASKS,
    all_contenders,
    contender_names,
    contenders,
    default_contenders,
    get_contender,
)
from .report import (
    RESULT_KEYS,
    SCHEMA,
    format_host_overhead,
    format_mask_ratios,
    format_ratios,
    format_tables,
    validate_report,
    write_json,
)
from .sweep import (
    SIDE_BY_SIDE,
    SIDE_BY_SIDE_PEERS,
    Progress,
    SweepOptions,
    add_ratios,
    measure_host_overhead,
    run_sweep,
)
from .torch_flex import TorchFlex
from .torch_sdpa import TorchSdpa

__all__ = [
    "Config", "Contender", "DIRECTIONS", "DIRECTION_LABEL", "DTYPES", "FlashcoreContender",
    "JaxDpa", "MEMORY_GUARD", "Mask", "NOT_BY_DEFAULT", "Naive", "Prepared", "Progress", "RESULT_KEYS",
    "SCHEMA", "SIDE_BY_SIDE", "SIDE_BY_SIDE_PEERS", "SweepOptions", "TorchFlex", "TorchSdpa", "WITH_MASKS", "add_ratios",
    "all_contenders", "backend_reason", "contender_names", "contenders", "default_contenders",
    "format_host_overhead", "format_mask_ratios", "format_ratios", "format_tables", "get_contender", "gpu_library",
    "gpu_peak_extra_bytes", "has_module", "host_inputs", "host_peak_method",
    "host_seconds_per_call", "import_jax", "import_torch", "library_reason", "machine_info",
    "measure", "measure_ceilings", "measure_host_overhead", "measure_interleaved", "naive_backward", "naive_forward",
    "parse_mask", "peak_extra_host_bytes", "plot", "run_sweep", "time_one_run", "time_runs", "to_library", "validate_report",
    "write_json",
]
