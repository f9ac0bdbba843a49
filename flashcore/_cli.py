"""The command line: ``python -m flashcore`` (the main job), ``info``, ``bench``, ``warmup``.

``python -m flashcore [options]``
    Runs attention forward at a realistic size on the best backend this machine has, checks
    the result against the float64 reference on a slice (a few heads, the first and last rows),
    and prints time, achieved GFLOP/s and peak extra memory next to the naive softmax(QKᵀ)V
    of the same library.
``python -m flashcore info``
    Backends (usable, or why not), devices, versions.
``python -m flashcore bench [options]``
    The side-by-side sweep of flashcore's backends and their peers (see flashcore.bench).
``python -m flashcore warmup [options]``
    Compiles numba_cuda's kernel variants into numba's disk cache (see flashcore._warmup).

All measuring is done by :mod:`flashcore.bench`; this module only parses, chooses and prints.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from . import bench
from ._case import DTYPES

#: norm-wise relative error of the output allowed on the checked slice, per dtype (rounding of
#: the output to the dtype plus float32 accumulation; far below what a wrong tile produces)
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
#: rows checked at each end of the sequence, heads checked (first and last)
CHECK_ROWS = 64
#: the main job stops repeating (after 3 timed runs) once they add up to this many seconds
MAIN_BUDGET_S = 8.0


# --- argument types: errors name the option and the value ----------------------------------


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _head_dim(text):
    value = _positive_int(text)
    if value > 256:
        raise argparse.ArgumentTypeError(f"head dim must be between 1 and 256, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _int_list(text, check=_positive_int):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}")
    try:
        return tuple(check(t) for t in items)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None


def _choice_list(choices):
    def parse(text):
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad)) or repr(text)} not among {', '.join(choices)}")
        return items
    return parse


def _mask_list(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated masks, got {text!r}")
    try:
        masks = tuple(bench.parse_mask(t).text for t in items)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(dict.fromkeys(masks))  # in order, once each


def _backend_names():
    from ._dispatch import REGISTRY

    return ("auto", *REGISTRY)


# --- the main job ------------------------------------------------------------------------


def _main_parser():
    p = argparse.ArgumentParser(
        prog="python -m flashcore",
        description="Run exact attention (forward) at a realistic size on the best backend "
                    "here, check it against the float64 reference on a slice, and compare time "
                    "and memory with the naive softmax(QK^T)V. Subcommands: 'info' lists "
                    "backends, devices and versions; 'bench' runs the side-by-side sweep "
                    "(python -m flashcore bench --help).")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="batch size (1)")
    p.add_argument("--heads", type=_positive_int, default=8, metavar="H", help="heads (8)")
    p.add_argument("--seqlen", type=_positive_int, default=4096, metavar="N",
                   help="sequence length of queries and keys (4096)")
    p.add_argument("--head-dim", type=_head_dim, default=64, metavar="D", help="head dim (64)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="(float32)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--backend", choices=_backend_names(), default="auto",
                   help="flashcore backend (auto: the first usable of numba_cuda, numba_cpu, "
                        "torch, jax, then the reference)")
    p.add_argument("--repeat", type=_positive_int, default=5, metavar="R",
                   help="timed runs after one warm-up; the median is shown (5)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive comparison")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _backend_target(name):
    """(library, device) of the arrays a backend is run on by the main job."""
    gpu_lib = None
    if name in ("numba_cuda", "torch", "jax"):
        gpu_lib = bench.gpu_library()
    if name == "numba_cuda":
        return (gpu_lib or "torch"), "cuda:0"
    if name == "torch":
        return "torch", ("cuda:0" if gpu_lib == "torch" else "cpu")
    if name == "jax":
        try:
            return "jax", ("cuda:0" if bench.library_reason("jax", "cuda:0") is None else "cpu")
        except Exception:  # jax missing: its reason comes from the availability check
            return "jax", "cpu"
    return "numpy", "cpu"


def choose_backend(requested, config):
    """(backend name, library, device, notes): the backend the main job runs on.

    "auto" follows flashcore's own order (``_dispatch.AUTO_ORDER``) over the backends usable
    here, each run on the arrays it serves; the reference, which auto declines at this size,
    is the last resort. A named backend that cannot run raises BackendUnavailableError.
    """
    from . import _dispatch
    from ._case import Case
    from ._errors import BackendUnavailableError

    names = _dispatch.AUTO_ORDER if requested == "auto" else (requested,)
    notes = []
    for name in names:
        library, device = _backend_target(name)
        why = bench.backend_reason(name)
        if why is None:
            why = bench.library_reason(library, device)
        if why is None:
            case = Case(library=library, device=device, dtype=config.dtype, batch=config.batch,
                        heads_q=config.heads, heads_kv=config.heads, seqlen_q=config.seqlen,
                        seqlen_k=config.seqlen, head_dim=config.head_dim, causal=config.causal,
                        scale=config.scale, layout="bhnd", need_lse=True,
                        explicit=requested != "auto" or name == "reference")
            why = _dispatch.load(name).supports(case)
        if why is None:
            return name, library, device, notes
        if requested != "auto":
            raise BackendUnavailableError(f"backend {name!r} cannot run here: {why}")
        notes.append(f"{name}: {why}")
    raise BackendUnavailableError("no backend can run here:\n  " + "\n  ".join(notes))


def _slices(config):
    """[(batch, head, row slice, key count)] checked: first and last batch and head, the
    first and last CHECK_ROWS rows. Rows [0, m) see keys [0, m) under the causal mask
    (queries = keys, so the bottom-right alignment is preserved by cutting the keys there)."""
    n, m = config.seqlen, min(CHECK_ROWS, config.seqlen)
    heads = sorted({0, config.heads - 1})
    batches = sorted({0, config.batch - 1})
    out = []
    for b in batches:
        for h in heads:
            out.append((b, h, slice(0, m), m if config.causal else n))
            if n > m:
                out.append((b, h, slice(n - m, n), n))
    return out


def check_against_reference(config, library, seed):
    """A ``check(outputs)`` for bench.measure: the output and lse on the slices against the
    float64 reference computed on the same inputs."""
    import flashcore

    from . import _interop, reference  # noqa: F401  (reference: the oracle below)

    def check(outputs):
        o, lse = outputs
        o = np.asarray(_interop.copy_to_host(o, library)).astype(np.float64)
        lse = np.asarray(_interop.copy_to_host(lse, library)).astype(np.float64)
        q, k, v = (a.astype(np.float64) for a in bench.host_inputs(config, seed)[:3])
        worst, lse_worst, nan = 0.0, 0.0, False
        for b, h, rows, nk in _slices(config):
            sl = (slice(b, b + 1), slice(h, h + 1))
            ro, rl = flashcore.attention_forward(q[sl][:, :, rows], k[sl][:, :, :nk],
                                                 v[sl][:, :, :nk], causal=config.causal,
                                                 backend="reference")
            got = o[sl][:, :, rows]
            nan |= not np.all(np.isfinite(got))
            err = np.linalg.norm(got - ro) / max(np.linalg.norm(ro), 1e-300)
            worst = max(worst, float(err))
            lse_worst = max(lse_worst, float(np.max(np.abs(lse[sl][:, :, rows] - rl))))
        tol = TOLERANCE[config.dtype]
        ok = (not nan) and worst <= tol and lse_worst <= max(100 * tol, 1e-5)
        return {"rel_err": worst if not nan else math.inf, "lse_abs_err": lse_worst,
                "tolerance": tol, "ok": bool(ok), "slices": len(_slices(config))}
    return check


def _fmt_bytes(b):
    if b is None:
        return "n/a"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def run_main(argv):
    args = _main_parser().parse_args(argv)
    from ._errors import BackendUnavailableError

    config = bench.Config(args.batch, args.heads, args.seqlen, args.head_dim, args.dtype,
                           args.causal)
    try:
        name, library, device, notes = choose_backend(args.backend, config)
    except BackendUnavailableError as e:
        print(f"flashcore: {e}", file=sys.stderr)
        return 2
    import flashcore

    print(f"flashcore {flashcore.__version__}: attention forward, {config.label()}")
    where = "GPU " + device if device != "cpu" else f"CPU, {os.cpu_count()} cores"
    print(f"backend: {name} on {library} arrays ({where})")
    for n in notes:
        print(f"  passed over {n}")
    if name == "reference":
        print("  note: the reference materializes the score matrix; it is the oracle, not a "
              "fast kernel")
    contender = bench.FlashcoreContender(name, library, device)
    t0 = time.perf_counter()
    rec = bench.measure(contender, config, "fwd", repeat=args.repeat, seed=args.seed,
                         budget_s=MAIN_BUDGET_S,
                         check=check_against_reference(config, library, args.seed))
    wall = time.perf_counter() - t0
    if rec["median_s"] is None:
        print(f"flashcore: {name} failed: {rec['error'] or rec['skipped']}", file=sys.stderr)
        return 1
    chk = rec["check"]
    rows = []
    rows.append((f"flashcore {name}", rec))
    naive = None
    if not args.no_naive:
        naive_c = bench.Naive(library if library in ("numpy", "torch", "cupy") else "numpy",
                               device if library in ("numpy", "torch", "cupy") else "cpu")
        naive = bench.measure(naive_c, config, "fwd", repeat=min(args.repeat, 3),
                               seed=args.seed, budget_s=MAIN_BUDGET_S)
        rows.append((f"naive {naive_c.library}", naive))
    print(f"check against the float64 reference on {chk['slices']} slices "
          f"(heads first/last, rows first/last {min(CHECK_ROWS, config.seqlen)}): "
          f"relative error {chk['rel_err']:.2e}, lse error {chk['lse_abs_err']:.1e} "
          f"(tolerance {chk['tolerance']:.0e}) {'ok' if chk['ok'] else 'FAILED'}")
    gpu = device != "cpu"
    print()
    unit, div = ("TFLOP/s", 1e3) if gpu else ("GFLOP/s", 1.0)
    print(f"{'':<24}{'time (median)':>16}{unit:>10}{'peak extra memory':>20}")
    for label, r in rows:
        mem = r["peak_extra_gpu_bytes"] if gpu else r["peak_extra_host_bytes"]
        if r["median_s"] is None:
            print(f"{label:<24}  skipped: {r['skipped'] or r['error']}")
            continue
        print(f"{label:<24}{r['median_s'] * 1e3:>13.1f} ms{r['gflops_per_s'] / div:>10.1f}"
              f"{_fmt_bytes(mem):>20}")
    if naive is not None and naive["median_s"]:
        speed = naive["median_s"] / rec["median_s"]
        line = (f"\n{name}: {speed:.2f}x faster than naive" if speed >= 1 else
                f"\n{name}: {1 / speed:.2f}x slower than naive")
        m1 = rec["peak_extra_gpu_bytes"] if gpu else rec["peak_extra_host_bytes"]
        m2 = naive["peak_extra_gpu_bytes"] if gpu else naive["peak_extra_host_bytes"]
        if m1 and m2:
            line += (f", {m2 / m1:.1f}x less extra memory" if m2 >= m1 else
                     f", {m1 / m2:.1f}x more extra memory")
        print(line)
    half = " (causal: half)" if config.causal else ""
    print(f"(times: median of {len(rec['times_s'])} runs after a warm-up; {unit}: "
          f"{config.flops('fwd') / 1e9:.1f} GFLOP nominal{half}; memory: "
          f"{_memory_note(rec, gpu)}; wall {wall:.1f} s)")
    return 0 if chk["ok"] else 1


def _memory_note(rec, gpu):
    if gpu:
        return "torch.cuda.max_memory_allocated above the baseline, outputs included"
    method = rec.get("host_peak_method")
    if method == "VmHWM":
        return ("growth of the resident set at its peak (Linux VmHWM reset per run), "
                "outputs included")
    if method == "sampler":
        return "growth of the resident set sampled every ms, outputs included"
    return "not measurable on this platform"


# --- info --------------------------------------------------------------------------------


def run_info(argv):
    argparse.ArgumentParser(prog="python -m flashcore info",
                            description="List backends, devices and versions.").parse_args(argv)
    import flashcore

    from . import _dispatch

    m = bench.machine_info()
    print(f"flashcore {flashcore.__version__}, Python {m['python']} on {m['platform']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()
                                   if k != "flashcore"))
    mem = m["memory_bytes"]
    print(f"host: {m['cpu']}, {m['cpu_count']} cores"
          + (f", {mem / 2**30:.1f} GiB memory" if mem else ""))
    try:
        import numba

        print(f"numba: {numba.config.NUMBA_NUM_THREADS} threads, threading layer "
              f"{numba.config.THREADING_LAYER!r}")
    except Exception as e:  # numba broken: say so, go on
        print(f"numba: cannot be imported ({e})")
    print("devices:")
    print("  cpu")
    for line in gpu_lines():
        print(f"  {line}")
    print('backends (in "auto" order):')
    for name in _dispatch.AUTO_ORDER:
        why = bench.backend_reason(name)
        print(f"  {name:<11} {'usable' if why is None else 'unavailable: ' + why}")
    return 0


def gpu_lines():
    """One line per GPU seen by any installed library, or one line saying none was found."""
    import importlib.util

    lines = []
    if importlib.util.find_spec("torch"):
        try:
            import torch

            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                lines.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB (PyTorch "
                             f"{torch.version.cuda and 'CUDA ' + torch.version.cuda})")
        except Exception as e:  # driver trouble: report it as a line
            lines.append(f"PyTorch cannot query CUDA: {e}")
    if not lines and importlib.util.find_spec("numba_cuda"):
        try:
            from numba import cuda

            if cuda.is_available():
                for d in cuda.list_devices():
                    name = d.name.decode() if isinstance(d.name, bytes) else d.name
                    lines.append(f"cuda:{d.id} {name} (numba.cuda)")
        except Exception as e:  # driver trouble
            lines.append(f"numba.cuda cannot query CUDA: {e}")
    if importlib.util.find_spec("jax"):
        try:
            jax = bench.import_jax()
            for d in jax.devices():
                if d.platform != "cpu":
                    lines.append(f"jax {d.platform}:{d.id} {getattr(d, 'device_kind', '')}")
        except Exception:  # jax without an accelerator plugin: nothing to list
            pass
    return lines or ["no GPU found"]


# --- bench -------------------------------------------------------------------------------


def _bench_parser():
    p = argparse.ArgumentParser(
        prog="python -m flashcore bench",
        description="Side-by-side benchmark of flashcore's backends and the peers (torch "
                    "SDPA, jax dot_product_attention, naive softmax(QK^T)V): ratio table, "
                    "FLOP/s, modelled bytes, peak memory; optional JSON and PNG plots.")
    p.add_argument("--seqlens", type=_int_list, default=(512, 1024, 2048, 4096),
                   metavar="N,N,...", help="sequence lengths (512,1024,2048,4096)")
    p.add_argument("--head-dims", type=lambda t: _int_list(t, _head_dim), default=(64,),
                   metavar="D,D,...", help="head dims (64)")
    p.add_argument("--dtypes", type=_choice_list(DTYPES), default=("float32",),
                   metavar="DT,...", help=f"dtypes among {', '.join(DTYPES)} (float32)")
    p.add_argument("--causal", choices=("no", "yes", "both"), default=None,
                   help="causal masks to run (both; no when --masks names a mask)")
    p.add_argument("--masks", type=_mask_list, default=("none",), metavar="MASK,...",
                   help="masks to run: none, window:W (W keys per query), docs:K (K equal "
                   "documents by a mask_mod; flashcore gets a BlockMask made untimed), "
                   "softcap:C, softcap-py:C (softcap as a Python score_mod), alibi, relpos "
                   "(score_mod s + 0.01(j-i)); e.g. none,window:512,docs:8 (none)")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B", help="(1)")
    p.add_argument("--heads", type=_positive_int, default=8, metavar="H", help="(8)")
    p.add_argument("--directions", type=_choice_list(bench.DIRECTIONS),
                   default=bench.DIRECTIONS, metavar="fwd,fwdbwd", help="(both)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU where one is visible, else the CPU")
    p.add_argument("--contenders",
                   type=_choice_list(bench.contender_names()), default=None,
                   metavar="NAME,...", help="what to run (default: everything usable here but "
                   f"{', '.join(sorted(bench.NOT_BY_DEFAULT))}); see --list")
    p.add_argument("--repeat", type=_positive_int, default=5, metavar="R",
                   help="timed runs per measurement, at most (5)")
    p.add_argument("--budget", type=_positive_float, default=2.0, metavar="SECONDS",
                   help="stop repeating (after 3 runs) once the runs add up to this; taking "
                   "turns, once the slowest contender's do (2)")
    p.add_argument("--no-interleave", action="store_true",
                   help="time each contender's runs back to back, one contender after the "
                   "other (default: the contenders of a config take turns, run by run, so "
                   "that a change in the host's load falls on all of them alike)")
    p.add_argument("--quick", action="store_true",
                   help="a small sweep for a smoke test: N=256,512, non-causal, 3 runs")
    p.add_argument("--side-by-side", action="store_true",
                   help="the GPU comparison of DESIGN.md's anchors: numba_cuda next to SDPA "
                   "flash, cuDNN and mem-efficient at B=4 H=16 N=4096 D=64,128, bfloat16 and "
                   "float32, causal and not, with --ratio-to those three and --host-overhead")
    p.add_argument("--ratio-to", type=_choice_list(bench.contender_names()), default=(),
                   metavar="NAME,...", help="also print every contender's time divided by "
                   "each named contender's, per config and direction")
    p.add_argument("--host-overhead", action="store_true",
                   help="also time one forward call of each contender on a tiny input "
                   "(B=1 H=1 N=16): what a call costs the host")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip measuring this machine's bandwidth and GEMM ceilings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG figures into DIR")
    p.add_argument("--list", action="store_true",
                   help="list the contenders and whether each can run here, then exit")
    return p


def run_bench(argv):
    parser = _bench_parser()
    args = parser.parse_args(argv)
    if args.list:
        for c in bench.all_contenders():
            why = c.unavailable_reason()
            default = "" if c.name not in bench.NOT_BY_DEFAULT else " (not by default)"
            print(f"{c.name:<24} {'usable' + default if why is None else 'unavailable: ' + why}")
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib: pip install "flashcore[bench]"')
    opts = bench.SweepOptions(
        batch=args.batch, heads=args.heads, seqlens=args.seqlens, head_dims=args.head_dims,
        dtypes=args.dtypes, causal={"no": (False,), "yes": (True,), "both": (False, True)}[
            args.causal or ("no" if args.masks != ("none",) else "both")], masks=args.masks, directions=args.directions, repeat=args.repeat,
        budget_s=args.budget, interleave=not args.no_interleave, memory=not args.no_memory,
        device=args.device,
        contenders=args.contenders, ceilings=not args.no_ceilings)
    ratio_to, host_overhead = args.ratio_to, args.host_overhead
    if args.side_by_side:
        for key, value in bench.SIDE_BY_SIDE.items():
            setattr(opts, key, value)
        ratio_to, host_overhead = bench.SIDE_BY_SIDE_PEERS, True
    if args.quick:
        opts.seqlens, opts.causal, opts.repeat = (256, 512), (False,), min(args.repeat, 3)
    chosen = ([bench.get_contender(n) for n in opts.contenders] if opts.contenders
              else bench.default_contenders(opts.device, masked=opts.masked))
    if not chosen:
        print("flashcore bench: nothing can run here", file=sys.stderr)
        return 2
    print(f"flashcore bench: {', '.join(c.name for c in chosen)}; "
          f"N={','.join(map(str, opts.seqlens))} D={','.join(map(str, opts.head_dims))} "
          f"{','.join(opts.dtypes)}"
          + (f" masks {','.join(opts.masks)}" if opts.masked else ""), flush=True)
    report = bench.run_sweep(opts, progress=not args.no_progress, host_overhead=host_overhead)
    print(bench.format_tables(report))
    if opts.masked:
        print(bench.format_mask_ratios(report))
    if ratio_to:
        print(bench.format_ratios(report, ratio_to))
    if host_overhead:
        print(bench.format_host_overhead(report))
    if args.json:
        bench.write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        for path in bench.plot(report, args.plot):
            print(f"wrote {path}")
    return 0


# --- entry point -------------------------------------------------------------------------


def run_warmup(argv) -> int:
    from ._warmup import run_warmup as warmup

    return warmup(argv)


COMMANDS = {"info": run_info, "bench": run_bench, "warmup": run_warmup}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    if argv and not argv[0].startswith("-"):
        print(f"flashcore: unknown command {argv[0]!r}; expected one of "
              f"{', '.join(COMMANDS)} or options of the main job (--help)", file=sys.stderr)
        return 2
    return run_main(argv)
