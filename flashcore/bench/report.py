"""What a sweep's report is (schema ``flashcore-bench/1``) and how it is written: checked,
saved as JSON, and printed as ratio tables."""
from __future__ import annotations

import json
import os

from .config import DIRECTION_LABEL, DIRECTIONS, Config
from .masks import label as mask_label

SCHEMA = "flashcore-bench/1"

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
    if not isinstance(report.get("host_overhead", []), list):  # optional, from --host-overhead
        raise ValueError("report['host_overhead'] is not a list")


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
    """The ratio tables: one per (dtype, head dim, causal, mask) and direction, rows per
    seqlen and contender, time relative to the fastest peer; a masked table ends with how
    each contender was given the mask."""
    rs = report["results"]
    gpu = any(r["device"] != "cpu" for r in rs)
    unit, div = ("TFLOP/s", 1e3) if gpu else ("GFLOP/s", 1.0)
    out = []
    groups = {}
    for r in rs:
        c = r["config"]
        key = (c["dtype"], c["head_dim"], c["causal"], c["batch"], c["heads"], r["direction"],
               c.get("mask", "none"))
        groups.setdefault(key, []).append(r)
    for (dt, d, causal, b, h, direction, mask), grp in groups.items():
        m = "" if mask == "none" else f" mask {mask_label(mask)}"
        out.append(f"\n{DIRECTION_LABEL[direction]}: B={b} H={h} D={d} {dt} "
                   f"{'causal' if causal else 'non-causal'}{m}   "
                   f"(x peer = time / fastest peer's)")
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
        hows = {r["contender"]: r.get("mask_how") for r in grp if r.get("mask_how")}
        for name, how in hows.items():
            out.append(f"        {name}: {how}")
    ceil = report.get("ceilings") or {}
    if "mem_bw_GBps" in ceil:
        out.append(f"\nthis machine: memory bandwidth {ceil['mem_bw_GBps']:.1f} GB/s, "
                   f"GEMM {ceil['gemm_GFLOPps']:.1f} GFLOP/s "
                   f"({ceil['gemm_dtype']}; {ceil['how']})")
    flags = (report.get("machine") or {}).get("cpu_flags")
    if flags:
        out.append(f"CPU: {report['machine'].get('cpu', '?')}; instruction set {' '.join(flags)}")
    target = (report.get("machine") or {}).get("numba_cpu_target")
    if target:
        out.append(f"numba_cpu: {target['vector_bits']}-bit vectors, compiled for "
                   f"{target['cpu_name'] or 'this host'}"
                   + (f" ({target['cpu_features']})" if target.get("cpu_features") else ""))
    out.append("time: median after a warm-up; FLOP/s: nominal FLOPs (4BHN^2D forward, 2.5x that "
               "backward, halved causal); GB moved: modelled traffic; peak: extra memory of one "
               "run, outputs included")
    if any(r["config"].get("mask", "none") != "none" for r in rs):
        out.append("masked: FLOPs and score traffic counted over the visible (query, key) "
                   "pairs only (window:W about W/N, docs:K about 1/K)")
    return "\n".join(out)


def format_mask_ratios(report: dict) -> str:
    """Each masked result's time divided by the same contender's time without a mask (same
    sizes, dtype, causal and direction): what the mask saves; empty without masks."""
    rs = report["results"]
    base = {}
    for r in rs:
        if r["config"].get("mask", "none") == "none" and r["median_s"]:
            base[(_config_key(r, without_mask=True), r["direction"], r["contender"])] = r[
                "median_s"]
    rows = []
    for r in rs:
        mask = r["config"].get("mask", "none")
        if mask == "none":
            continue
        ref = base.get((_config_key(r, without_mask=True), r["direction"], r["contender"]))
        ratio = f"{r['median_s'] / ref:.3f}" if ref and r["median_s"] else "-"
        speed = f"{ref / r['median_s']:.1f}x" if ref and r["median_s"] else "-"
        rows.append(f"{DIRECTION_LABEL[r['direction']]:<17} {Config(**r['config']).label():<52} "
                    f"{r['contender']:<24} {ratio:>8} {speed:>8}")
    if not rows:
        return ""
    header = (f"{'direction':<17} {'config':<52} {'contender':<24} {'/ none':>8} "
              f"{'faster':>8}")
    return "\n".join(["\nmasked time / the same contender's time without a mask", header,
                      "-" * len(header), *rows])


def format_ratios(report: dict, against) -> str:
    """Every other contender's time divided by the time of each contender named in
    ``against`` on the same config and direction: one column per name, "-" where either
    did not run."""
    against = tuple(against)
    rs = report["results"]
    times = {}
    for r in rs:
        times[(_config_key(r), r["direction"], r["contender"])] = r["median_s"]
    cols = [f"/ {n}" for n in against]
    w = max([44] + [len(Config(**r["config"]).label()) for r in rs])  # 44: without masks
    header = f"{'direction':<17} {'config':<{w}} {'contender':<24} " + " ".join(cols)
    out = ["\ntime / the named contender's time (same config and direction)", header,
           "-" * len(header)]
    for r in rs:
        if r["contender"] in against:
            continue
        key = (_config_key(r), r["direction"])
        cells = []
        for n in against:
            ref = times.get((*key, n))
            cells.append(f"{r['median_s'] / ref:.2f}" if ref and r["median_s"] else "-")
        out.append(f"{DIRECTION_LABEL[r['direction']]:<17} {Config(**r['config']).label():<{w}} "
                   f"{r['contender']:<24} "
                   + " ".join(f"{c:>{len(col)}}" for c, col in zip(cells, cols)))
    return "\n".join(out)


def _config_key(r, without_mask=False):
    c = dict(r["config"])
    if without_mask:
        c.pop("mask", None)
    return tuple(c[k] for k in sorted(c))


def format_host_overhead(report: dict) -> str:
    """The host time per call of each contender on a tiny input (``--host-overhead``)."""
    recs = report.get("host_overhead") or []
    if not recs:
        return ""
    label = Config(**recs[0]["config"]).label()
    out = [f"\nhost time of one forward call, {label} (best of 5 blocks of "
           f"{recs[0]['inner']} calls; the device is waited for after each block)"]
    for r in recs:
        if r["us_per_call"] is None:
            tag = "skipped" if r["skipped"] else "error"
            out.append(f"  {r['contender']:<24} {tag}: {r['skipped'] or r['error']}"[:160])
        else:
            out.append(f"  {r['contender']:<24} {r['us_per_call']:>9.1f} us")
    return "\n".join(out)
