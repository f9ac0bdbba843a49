"""Figures of a report (PNG, through matplotlib, imported only here): time against sequence
length per contender, and a roofline of the machine with every measurement on it."""
from __future__ import annotations

import os

import numpy as np

from .config import DIRECTION_LABEL, DIRECTIONS


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
        panels = sorted({(r["config"]["dtype"], r["config"]["head_dim"], r["config"]["causal"],
                          r["config"].get("mask", "none")) for r in drs}, key=str)
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (dt, d, causal, mask) in zip(axes[0], panels):
            for name in names:
                pts = sorted((r["config"]["seqlen"], r["median_s"] * 1e3) for r in drs
                             if r["contender"] == name and r["config"]["dtype"] == dt
                             and r["config"]["head_dim"] == d and r["config"]["causal"] == causal
                             and r["config"].get("mask", "none") == mask)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, color=colors[name])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("time (ms, median)")
            ax.set_title(f"{DIRECTION_LABEL[direction]}: D={d} {dt} "
                         f"{'causal' if causal else 'non-causal'}"
                         f"{'' if mask == 'none' else ' ' + mask}", fontsize=10)
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
