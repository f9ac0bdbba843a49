"""Measuring one contender: the time of a run, the peak extra memory of a run (host and
GPU), and :func:`measure`, which does both and returns one result record."""
from __future__ import annotations

import gc
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass

from .config import Config
from .libraries import import_jax, import_torch

# --- a run made ready --------------------------------------------------------------------


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


# --- time --------------------------------------------------------------------------------


def time_one_run(prep: Prepared) -> float:
    """Seconds of one run of ``prep``, its outputs dropped before returning. On the CPU (and
    for JAX) ``time.perf_counter`` around ``prep.run()``, which waits for the outputs; with
    ``prep.timer == "cuda_event"`` CUDA events around ``prep.call()``, the device waited for
    before the start and after the end."""
    if prep.timer == "cuda_event":
        torch = import_torch()
        dev = torch.device(prep.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        prep.call()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    prep.run()
    return time.perf_counter() - t0


def time_runs(prep: Prepared, repeat: int = 5, warmup: int = 1, budget_s: float | None = None):
    """Seconds of ``repeat`` runs after ``warmup`` untimed runs. With ``budget_s``, stop early
    (after at least 3 runs) once the timed runs add up to more than that."""
    for _ in range(warmup):
        prep.outputs = prep.run()
    times = []
    while len(times) < repeat:
        times.append(time_one_run(prep))
        if budget_s is not None and len(times) >= 3 and sum(times) > budget_s:
            break
    return times


def host_seconds_per_call(call, sync=None, inner: int = 2000, repeat: int = 5,
                          warmup: int = 200) -> float:
    """Host time of one ``call()``: the best of ``repeat`` blocks of ``inner`` back-to-back
    calls, the clock stopped before waiting for the device (``sync(last output)``) after
    each block. On a tiny input the device work is shorter than the host's and calls queue
    up, so this is what a call costs the host (argument checks, dispatch, allocation,
    launch); the best block is the one least disturbed by other processes."""
    out = None
    for _ in range(warmup):
        out = call()
    if sync is not None:
        sync(out)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        best = min(best, (time.perf_counter() - t0) / inner)
        if sync is not None:
            sync(out)
    return best


# --- host memory -------------------------------------------------------------------------


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


def host_peak_method() -> str:
    """How :func:`peak_extra_host_bytes` reads the peak here: "VmHWM", "sampler" or "none"."""
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


# --- GPU memory --------------------------------------------------------------------------


def gpu_peak_extra_bytes(prep: Prepared) -> int | None:
    """Peak extra device memory of one run, where the device's allocator can tell it."""
    if prep.gpu_memory == "torch":
        torch = import_torch()
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
        jax = import_jax()
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


# --- one measurement ---------------------------------------------------------------------


def measure(contender, config: Config, direction: str, *, repeat: int = 5,
            warmup: int = 1, budget_s: float | None = None, memory: bool = True,
            seed: int = 0, check=None, host=None) -> dict:
    """Time (and measure the memory of) one contender on one config and direction: its
    ``repeat`` timed runs back to back (see :func:`measure_interleaved` for several
    contenders taking turns).

    ``contender`` is a :class:`flashcore.bench.contender.Contender`. ``check(outputs) ->
    dict``, if given, is called on the warm-up run's outputs and its answer stored under
    ``"check"``. Never raises for a contender's failure: a contender that cannot run here
    comes back with ``"skipped"`` (the reason), one that fails with ``"error"`` (the
    exception's first line).
    """
    rec = new_record(contender, config, direction)
    prep = _ready(contender, rec, config, direction, warmup, seed, check, host)
    if prep is None:
        return rec
    try:
        times = time_runs(prep, repeat=repeat, warmup=0, budget_s=budget_s)
        _finish(contender, rec, prep, times, memory)
    except Exception as e:  # report, don't abort the sweep
        rec["error"] = first_line(e)
    finally:
        del prep
        gc.collect()
    return rec


def measure_interleaved(contenders, config: Config, direction: str, *, repeat: int = 5,
                        warmup: int = 1, budget_s: float | None = None, memory: bool = True,
                        seed: int = 0, check=None) -> list[dict]:
    """Like :func:`measure` for each of ``contenders`` (one record each, in their order),
    but with the timed runs taken in turns, so that a change in the machine's load while
    they are measured falls on all of them alike.

    Every contender is first made ready, each with its own inputs, and run ``warmup``
    times untimed (the first run compiles). Then round ``i`` times one run of each
    contender still running, starting with the ``i``-th (mod their number), so that none
    always goes first: A B, B A, A B, ... until each has ``repeat`` runs or, with
    ``budget_s``, after at least 3 rounds, the round in which the slowest contender's runs
    add up to more than ``budget_s``. A contender that is skipped or fails is recorded so
    and the others go on without it. The peak memory of a run is measured after the
    rounds, one contender at a time, each contender's inputs released once it is done.
    """
    recs = [new_record(c, config, direction) for c in contenders]
    live = []  # a _Turn for each contender still running
    for c, rec in zip(contenders, recs):
        prep = _ready(c, rec, config, direction, warmup, seed, check, None)
        if prep is not None:
            live.append(_Turn(c, rec, prep))
    prep = None  # each prepared contender is held by its turn alone
    rounds = 0
    while live and rounds < repeat:
        for turn in [live[(rounds + j) % len(live)] for j in range(len(live))]:
            try:
                turn.times.append(time_one_run(turn.prep))
            except Exception as e:  # report, drop this one, the others go on
                turn.rec["error"] = first_line(e)
                live = [t for t in live if t is not turn]
                turn.prep = None  # its inputs go
                gc.collect()
        rounds += 1
        if (budget_s is not None and live and rounds >= 3
                and max(sum(t.times) for t in live) > budget_s):
            break
    while live:
        turn = live.pop(0)
        try:
            _finish(turn.contender, turn.rec, turn.prep, turn.times, memory)
        except Exception as e:  # report, don't abort the sweep
            turn.rec["error"] = first_line(e)
        turn.prep = None
        gc.collect()
    return recs


class _Turn:
    """One contender taking its turns in :func:`measure_interleaved`."""

    def __init__(self, contender, rec, prep):
        self.contender, self.rec, self.prep, self.times = contender, rec, prep, []


def new_record(contender, config: Config, direction: str) -> dict:
    """A result record (schema ``flashcore-bench/1``) with nothing measured yet."""
    rec = {"contender": contender.name, "kind": contender.kind, "library": contender.library,
           "device": contender.device, "config": config.as_dict(), "direction": direction,
           "flops": config.flops(direction),
           "bytes": config.io_bytes(direction, contender.materializes),
           "times_s": [], "median_s": None, "gflops_per_s": None,
           "peak_extra_host_bytes": None, "host_peak_method": None,
           "peak_extra_gpu_bytes": None, "skipped": None, "error": None}
    if config.mask != "none":
        rec["mask_how"] = contender.mask_how(config)
    return rec


def _ready(contender, rec, config, direction, warmup, seed, check, host):
    """``contender`` prepared and warmed up (``max(warmup, 1)`` untimed runs, the first of
    which compiles; ``check`` on its outputs), or None with ``rec``'s ``"skipped"`` or
    ``"error"`` set. The warm-up outputs are released before the timed runs."""
    why = contender.unavailable_reason(config)
    if why is not None:
        rec["skipped"] = why
        return None
    prep = None
    try:
        prep = contender.prepare(config, direction, seed, host)
        try:
            prep.outputs = prep.run()  # the first run compiles: not timed
        except Exception as e:  # the contender declined this config (e.g. no kernel for it)
            rec["skipped"] = first_line(e)
        else:
            if check is not None:
                rec["check"] = check(prep.outputs)
            for _ in range(warmup - 1):
                prep.outputs = prep.run()
            prep.outputs = None
            return prep
    except Exception as e:  # report, don't abort the sweep
        rec["error"] = first_line(e)
    prep = None
    gc.collect()  # a contender that cannot run lets go of its inputs at once
    return None


def _finish(contender, rec, prep, times, memory):
    """Store ``times`` and what follows from them in ``rec``; with ``memory``, measure the
    peak extra memory of one more run of ``prep``."""
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


def first_line(e: BaseException) -> str:
    """``"TypeName: first line of the message"``, at most 300 characters."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
