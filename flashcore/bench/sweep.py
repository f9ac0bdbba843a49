"""The sweep: every chosen contender on every config and direction, with a progress bar,
gathered into one JSON-able report."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import sys
import time
from dataclasses import dataclass, field

from .config import DIRECTION_LABEL, DIRECTIONS, Config
from .machine import machine_info, measure_ceilings
from .masks import canonical
from .measure import first_line, host_seconds_per_call, measure, measure_interleaved
from .registry import default_contenders, get_contender
from .report import SCHEMA


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

    def advance(self, steps: int = 1):
        self.done += steps

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
    masks: tuple = ("none",)  # see flashcore.bench.masks: "window:512", "docs:8", ...
    directions: tuple = DIRECTIONS
    repeat: int = 5
    budget_s: float = 2.0
    #: take the contenders' timed runs in turns, call by call (see measure_interleaved);
    #: False: each contender's runs back to back, one contender after the other
    interleave: bool = True
    memory: bool = True
    device: str = "auto"
    contenders: tuple | None = None  # names; None = default_contenders(device)
    ceilings: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def configs(self) -> list[Config]:
        return [Config(self.batch, self.heads, n, d, dt, c, m)
                for dt in self.dtypes for d in self.head_dims for c in self.causal
                for m in self.masks for n in self.seqlens]

    @property
    def masked(self) -> bool:
        """Whether any config has a mask (a default sweep then adds the mask peers)."""
        return any(canonical(m) != "none" for m in self.masks)

    def host_overhead_config(self) -> Config:
        """The tiny input whose forward call :func:`measure_host_overhead` times: B=1, H=1,
        N=16 at the sweep's first head dim and dtype, so the device work is negligible."""
        return Config(1, 1, 16, self.head_dims[0], self.dtypes[0], False)


#: ``python -m flashcore bench --side-by-side``: numba_cuda next to torch SDPA's flash
#: (FlashAttention-2), cuDNN and memory-efficient kernels at the size of DESIGN.md's anchors,
#: with the time divided by each of them and the host time of a tiny call. The peak memory
#: at long sequences is the same sweep's GPU peak column at another size (``--seqlens 16384
#: --batch 1 --heads 16 --head-dims 128 --dtypes bfloat16 --directions fwd``).
SIDE_BY_SIDE_PEERS = ("torch_sdpa_flash@gpu", "torch_sdpa_cudnn@gpu", "torch_sdpa_efficient@gpu")
SIDE_BY_SIDE = dict(batch=4, heads=16, seqlens=(4096,), head_dims=(64, 128),
                    dtypes=("bfloat16", "float32"), causal=(False, True), device="cuda",
                    contenders=("flashcore:numba_cuda@gpu",) + SIDE_BY_SIDE_PEERS)


def run_sweep(opts: SweepOptions, progress: bool = True, stream=None,
              host_overhead: bool = False) -> dict:
    """Measure every chosen contender on every config and direction; return the JSON-able
    report (schema ``flashcore-bench/1``, see :func:`flashcore.bench.report.validate_report`).
    With ``opts.interleave`` (the default) the contenders of one config and direction take
    their timed runs in turns (:func:`flashcore.bench.measure.measure_interleaved`), so that
    a burst of load on a shared host falls on all of them alike; without it each contender's
    runs come back to back (:func:`flashcore.bench.measure.measure`).
    With ``host_overhead``, the report also holds ``"host_overhead"``: the records of
    :func:`measure_host_overhead` for every contender."""
    if opts.contenders:
        chosen = [get_contender(n) for n in opts.contenders]
    else:
        chosen = default_contenders(opts.device, masked=opts.masked)
    configs = opts.configs()
    steps = len(configs) * len(opts.directions) * len(chosen)
    extra_steps = (1 if opts.ceilings else 0) + (len(chosen) if host_overhead else 0)
    bar = Progress(steps + extra_steps, stream=stream, enabled=progress)
    results = []
    ceilings = None
    dev = "cpu" if all(c.device == "cpu" for c in chosen) else "cuda"
    if opts.ceilings:
        bar.step("measuring this machine's bandwidth and GEMM ceilings")
        try:
            ceilings = measure_ceilings(dev, opts.dtypes[0])
        except Exception as e:  # a ceiling is a nicety; the sweep goes on without it
            ceilings = {"error": first_line(e)}
        bar.advance()
    for cfg in configs:
        for direction in opts.directions:
            if opts.interleave:
                bar.step(f"{', '.join(c.name for c in chosen)} in turns, "
                         f"{DIRECTION_LABEL[direction]} {cfg.label()}")
                results += measure_interleaved(chosen, cfg, direction, repeat=opts.repeat,
                                               budget_s=opts.budget_s, memory=opts.memory,
                                               seed=opts.seed)
                bar.advance(len(chosen))
                continue
            for c in chosen:
                bar.step(f"{c.name} {DIRECTION_LABEL[direction]} {cfg.label()}")
                results.append(measure(c, cfg, direction, repeat=opts.repeat,
                                       budget_s=opts.budget_s, memory=opts.memory,
                                       seed=opts.seed))
                bar.advance()
    overhead = []
    if host_overhead:
        tiny = opts.host_overhead_config()
        for c in chosen:
            bar.step(f"{c.name} host time of a call, {tiny.label()}")
            overhead.append(measure_host_overhead(c, tiny, seed=opts.seed))
            bar.advance()
    bar.close()
    add_ratios(results)
    options = dataclasses.asdict(opts)
    if not opts.masked:  # a sweep without masks writes the options it always wrote
        del options["masks"]
    report = {"schema": SCHEMA,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              "machine": machine_info(), "ceilings": ceilings, "options": options,
              "contenders": [c.info() for c in chosen], "results": results}
    if host_overhead:
        report["host_overhead"] = overhead
    return report


def measure_host_overhead(contender, config: Config, seed: int = 0, inner: int = 2000,
                  repeat: int = 5) -> dict:
    """Host time of one forward call of ``contender`` on ``config`` (a tiny one): see
    :func:`flashcore.bench.measure.host_seconds_per_call`. Like :func:`measure`, a
    contender that cannot run comes back with ``"skipped"``, one that fails with
    ``"error"``."""
    rec = {"contender": contender.name, "config": config.as_dict(), "inner": inner,
           "us_per_call": None, "skipped": contender.unavailable_reason(config), "error": None}
    if rec["skipped"] is not None:
        return rec
    prep = None
    try:
        prep = contender.prepare(config, "fwd", seed)
        try:
            prep.run()  # compiles
        except Exception as e:  # the contender declined this config
            rec["skipped"] = first_line(e)
            return rec
        seconds = host_seconds_per_call(prep.call, prep.sync, inner=inner, repeat=repeat)
        rec["us_per_call"] = seconds * 1e6
    except Exception as e:  # report, don't abort the sweep
        rec["error"] = first_line(e)
    finally:
        del prep
        gc.collect()
    return rec


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
