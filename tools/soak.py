"""Soak: many forward+backward calls cycling through 20 kinds of call, watching memory.

Each call is one forward and one backward of one of :data:`KINDS` (batch, heads, GQA,
Nq != Nk, head dims 8..128, causal or not, float32/float64/float16/bfloat16), taken in turn,
on inputs made once per kind (so that whatever grows is flashcore's); a kind the backend
does not serve (numba_cuda has no float64) is left out and named. Every ``--every``
calls it samples the host RSS (psutil if installed, else /proc/self/statm) and, on a GPU,
``torch.cuda.memory_allocated``. The first ``--warmup`` calls (every kind at least once:
compiles, plan caches, allocator pools) set the baseline; the report gives the growth after
it (last and largest sample, and the slope of a straight line through the samples, per
1000 calls), then the size of every cache flashcore holds at module level (the front end's
Memo plan caches, functools caches, numba dispatchers' compiled specializations, the
backends' plan dicts) with its bound.

This is a check to run, not a timed test. On a 2-core CPU host with numba_cpu, the kernels
of the four dtypes compile once (several minutes, then numba's disk cache), after which
10,000 calls take a few minutes.

Usage:
    python tools/soak.py [--calls 10000] [--backend numba_cpu] [--device cpu|cuda]
                         [--library numpy|torch] [--every 250] [--warmup 400] [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

#: (B, Hq, Hkv, Nq, Nk, D, causal, dtype): 20 kinds of call. Nq > Nk with causal has rows
#: that see no key; Nq = 1 is a decoding step.
KINDS = (
    (1, 1, 1, 16, 16, 16, False, "float32"),
    (1, 2, 1, 32, 32, 32, True, "float32"),
    (2, 4, 2, 64, 64, 64, False, "float32"),
    (2, 4, 4, 128, 128, 64, True, "float32"),
    (1, 8, 2, 17, 93, 32, False, "float32"),
    (1, 4, 1, 93, 17, 32, True, "float32"),
    (3, 2, 2, 50, 50, 80, False, "float32"),
    (1, 2, 2, 200, 200, 128, True, "float32"),
    (2, 2, 1, 1, 64, 64, True, "float32"),
    (1, 1, 1, 7, 7, 8, False, "float32"),
    (1, 2, 1, 32, 32, 32, True, "float64"),
    (2, 2, 2, 64, 48, 64, False, "float64"),
    (1, 4, 2, 65, 65, 16, True, "float64"),
    (1, 1, 1, 128, 128, 128, False, "float64"),
    (1, 2, 2, 64, 64, 64, True, "float16"),
    (2, 4, 1, 40, 100, 32, False, "float16"),
    (1, 2, 1, 128, 128, 128, True, "float16"),
    (1, 2, 2, 64, 64, 64, False, "bfloat16"),
    (2, 2, 2, 33, 33, 64, True, "bfloat16"),
    (1, 4, 4, 96, 128, 96, False, "bfloat16"),
)

#: What bounds each module-level cache that is not a Memo or an lru_cache (which state
#: their own maxsize). Keyed by "module.NAME".
BOUNDS = {
    "flashcore._mods._COMPILED": "one per user score_mod/mask_mod function (unbounded; "
                                 "grows only with new functions)",
    "flashcore._mods._CLASSES": "at most 32 keys (_MAX_CLASSES) and 256 MiB of array "
                                "copies (_MAX_KEPT), the oldest keys dropped first",
    "flashcore._torch_ops._STATIC": "one per distinct static options (window, softcap, "
                                    "mods): grows only with new options",
    "flashcore._torch_ops._STATIC_IDS": "as _STATIC",
    "flashcore._interop._LIBRARY_BY_TYPE": "one per array type",
    "flashcore._interop._DTYPE_NAMES": "one per dtype",
    "flashcore._memo._ALL": "one per Memo (module constants)",
    "flashcore.backends.numba_cpu.masked_kernels._MADE":
        "one per (score_mod, mask_mod) pair (unbounded; grows only with new functions)",
    "flashcore.backends.numba_cuda.launch._PLANS":
        "one per (pass, head dim, dtype, causal, device, tiling, alignment, family, mask "
        "options): no sequence length or batch in the key",
    "flashcore.backends.numba_cuda.driver._PREPARED": "one per kernel variant and GPU",
    "flashcore.backends.numba_cuda.driver._BUILDING": "builds under way only",
    "flashcore.backends.numba_cuda.adapters._TORCH_SCRATCH": "one per GPU",
    "flashcore._numba_cache._INSTALLED": "numba's caching modules patched (at most 2)",
    "flashcore.backends.numba_cpu._KERNEL_VIEW": "a constant table (4 dtypes)",
    # functools caches
    "flashcore._dispatch.load()": "one per backend name (5)",
    "flashcore.backends.numba_cpu.tiles.choose_tiles()":
        "one per (head dim <= 256, dtype, causal): at most 2048",
}


def host_rss() -> int:
    """This process's resident set size in bytes."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_source() -> str:
    try:
        import psutil  # noqa: F401

        return "psutil"
    except ImportError:
        return "/proc/self/statm"


# --- inputs and one call ------------------------------------------------------------------


def make_inputs(kind, library, device, seed):
    """(q, k, v, do) of one kind, in ``library`` on ``device``."""
    import numpy as np

    from flashcore import _interop

    B, Hq, Hkv, Nq, Nk, D, _causal, dtype = kind
    rng = np.random.default_rng(seed)
    shapes = [(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, Hq, Nq, D)]
    host = [rng.standard_normal(s).astype(_interop.np_dtype(dtype)) for s in shapes]
    if library == "numpy":
        return host
    import torch

    tdt = getattr(torch, dtype)
    return [torch.from_numpy(a.astype(np.float32)).to(device=device, dtype=tdt) for a in host]


def one_call(kind, inputs, library, backend):
    """Forward and backward of one kind of call: attention_forward + attention_backward on
    NumPy, autograd on torch."""
    import flashcore

    causal = kind[6]
    q, k, v, do = inputs
    if library == "numpy":
        o, lse = flashcore.attention_forward(q, k, v, causal=causal, backend=backend)
        return flashcore.attention_backward(do, q, k, v, o, lse, causal=causal,
                                            backend=backend)
    import torch

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = flashcore.attention(q, k, v, causal=causal, backend=backend)
    return torch.autograd.grad(o, (q, k, v), do)


# --- caches -------------------------------------------------------------------------------


def caches() -> list:
    """``(name, size, bound)`` of every cache held at module level by flashcore's modules."""
    from flashcore._memo import Memo

    out = []
    helpers = helper_specs = 0
    for modname, mod in sorted(sys.modules.items()):
        if not modname.startswith("flashcore") or mod is None:
            continue
        for name, obj in sorted(vars(mod).items()):
            full = f"{modname}.{name}"
            if isinstance(obj, Memo):
                out.append((full, len(obj), f"Memo: emptied at {obj.max_size}"))
            elif isinstance(obj, functools._lru_cache_wrapper) and getattr(
                    obj, "__module__", None) == modname:
                info = obj.cache_info()
                bound = (f"lru maxsize {info.maxsize}" if info.maxsize is not None else
                         BOUNDS.get(full + "()", "functools.cache: one per distinct "
                                    "arguments (bound not stated)"))
                out.append((full + "()", info.currsize, bound))
            elif hasattr(obj, "overloads") and hasattr(obj, "py_func") and getattr(
                    obj.py_func, "__module__", None) == modname:
                helpers += 1
                helper_specs += len(obj.overloads)
                if type(getattr(obj, "_cache", None)).__name__ not in ("NoneType", "NullCache"):
                    out.append((full + " [numba kernel]", len(obj.overloads),
                                "compiled specializations: one per argument types (dtype, "
                                "layout), never per shape"))
            elif (isinstance(obj, (dict, list, set)) and name.startswith("_")
                  and name.lstrip("_").isupper() and name not in ("__all__",)):
                out.append((full, len(obj), BOUNDS.get(full, "bound not stated")))
    out.append((f"numba dispatchers of flashcore ({helpers}, kernels above included)",
                helper_specs, "compiled specializations in all: by argument types only"))
    return out


# --- the soak -----------------------------------------------------------------------------


def soak(calls, backend, device, library, every, warmup, log=print):
    if device == "cuda":
        import torch

        gpu_mem = lambda: torch.cuda.memory_allocated()  # noqa: E731
        sync = torch.cuda.synchronize
    else:
        gpu_mem, sync = None, lambda: None
    import flashcore

    t0 = time.perf_counter()
    rss0 = host_rss()
    kinds, inputs = [], []
    for seed, kind in enumerate(KINDS):  # (each kind's first call: its warm-up starts)
        x = make_inputs(kind, library, device, seed)
        try:
            one_call(kind, x, library, backend)
        except flashcore.BackendUnavailableError as e:  # (numba_cuda serves no float64)
            log(f"skipped {kind}: {str(e).splitlines()[0]}")
            continue
        kinds.append(kind)
        inputs.append(x)
    if not kinds:
        raise SystemExit(f"backend {backend!r} serves none of the kinds")
    samples = []  # (calls done, rss, gpu bytes or None, seconds)
    warmup = max(warmup, len(kinds))
    for done in range(len(kinds), calls + 1):  # (the first call of each kind was above)
        if done > len(kinds):
            n = (done - 1) % len(kinds)
            one_call(kinds[n], inputs[n], library, backend)
        if done == warmup or (done > warmup and (done - warmup) % every == 0) or done == calls:
            sync()
            s = (done, host_rss(), gpu_mem() if gpu_mem else None, time.perf_counter() - t0)
            samples.append(s)
            log(f"{done:7d} calls  rss {s[1] / 2**20:8.1f} MiB"
                + (f"  gpu {s[2] / 2**20:8.1f} MiB" if s[2] is not None else "")
                + f"  {s[3]:7.1f} s")
    return rss0, samples[0][3], samples


def slope_per_1000(points):
    """Least-squares slope of (calls, bytes) in bytes per 1000 calls (0 for < 2 points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def summary(rss0, warm_s, samples, warmup):
    base = next(s for s in samples if s[0] >= warmup)
    after = [s for s in samples if s[0] >= base[0]]
    out = {
        "rss_start_bytes": rss0,
        "rss_after_warmup_bytes": base[1],
        "rss_last_bytes": after[-1][1],
        "rss_growth_after_warmup_bytes": after[-1][1] - base[1],
        "rss_max_growth_after_warmup_bytes": max(s[1] for s in after) - base[1],
        "rss_slope_bytes_per_1000_calls": slope_per_1000([(s[0], s[1]) for s in after]),
        "warmup_calls": base[0],
        "warmup_seconds": warm_s,
        "seconds": samples[-1][3],
        "calls": samples[-1][0],
        "samples": [list(s) for s in samples],
    }
    if base[2] is not None:
        out.update(
            gpu_after_warmup_bytes=base[2], gpu_last_bytes=after[-1][2],
            gpu_growth_after_warmup_bytes=after[-1][2] - base[2],
            gpu_max_growth_after_warmup_bytes=max(s[2] for s in after) - base[2])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000, help="forward+backward calls (10000)")
    p.add_argument("--backend", default="numba_cpu",
                   help="flashcore backend (numba_cpu; numba_cuda on a GPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--library", choices=("numpy", "torch"), default=None,
                   help="array library (numpy on cpu, torch on cuda)")
    p.add_argument("--every", type=int, default=250, help="calls between samples (250)")
    p.add_argument("--warmup", type=int, default=400,
                   help="calls before the baseline sample (400: 20 rounds of the kinds)")
    p.add_argument("--json", default=None, help="write the report here as JSON")
    args = p.parse_args(argv)
    library = args.library or ("torch" if args.device == "cuda" else "numpy")
    if library == "numpy" and args.device == "cuda":
        p.error("--device cuda needs --library torch")
    if args.warmup < len(KINDS) or args.calls < args.warmup:
        p.error(f"need --calls >= --warmup >= {len(KINDS)} (every kind once before the "
                f"baseline)")
    import numba

    import flashcore

    print(f"soak: {args.calls} calls, backend {args.backend}, {library} on {args.device}, "
          f"{len(KINDS)} kinds; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, numba {numba.__version__}, RSS by {rss_source()}")
    rss0, warm_s, samples = soak(args.calls, args.backend, args.device, library, args.every,
                                 args.warmup)
    report = summary(rss0, warm_s, samples, args.warmup)
    report["caches"] = [{"name": n, "size": s, "bound": b} for n, s, b in caches()]
    report.update(backend=args.backend, device=args.device, library=library,
                  flashcore=getattr(flashcore, "__version__", None),
                  numba=numba.__version__, python=platform.python_version(),
                  threading_layer=_threading_layer())
    mib = 2**20
    print(f"\nRSS: start {rss0 / mib:.1f} MiB, after {report['warmup_calls']} warm-up calls "
          f"({report['warmup_seconds']:.1f} s) {report['rss_after_warmup_bytes'] / mib:.1f} "
          f"MiB, after {report['calls']} calls {report['rss_last_bytes'] / mib:.1f} MiB: "
          f"growth {report['rss_growth_after_warmup_bytes'] / mib:+.2f} MiB (largest "
          f"{report['rss_max_growth_after_warmup_bytes'] / mib:+.2f} MiB, slope "
          f"{report['rss_slope_bytes_per_1000_calls'] / 1024:+.1f} KiB per 1000 calls); "
          f"{report['seconds']:.1f} s in all")
    if "gpu_last_bytes" in report:
        print(f"GPU memory_allocated: after warm-up {report['gpu_after_warmup_bytes'] / mib:.1f}"
              f" MiB, last {report['gpu_last_bytes'] / mib:.1f} MiB, growth "
              f"{report['gpu_growth_after_warmup_bytes'] / mib:+.2f} MiB")
    print("\ncaches (size: bound)")
    for c in report["caches"]:
        print(f"  {c['name']}: {c['size']}: {c['bound']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _threading_layer():
    try:
        import numba

        return numba.threading_layer()
    except ValueError:  # (no parallel kernel ran)
        return None


if __name__ == "__main__":
    sys.exit(main())
