"""Where a kernel's warps stall, per loop: an Nsight Compute source page (``ncu --import
REPORT --page source --csv --print-source sass``, as the ``ncu`` stage of tools/gpu_session.sh writes it) summed
over each loop (a branch back to an earlier address) and over the rest, with the largest
stall reasons of each as a share of its samples.

Usage: python tools/ncu_regions.py KERNEL.sass.csv
"""
from __future__ import annotations

import collections
import csv
import re
import sys


def regions(path):
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(" not in h]
    addr = [int(r[0], 16) for r in data]
    where = {a: i for i, a in enumerate(addr)}
    loops = []
    for i, r in enumerate(data):
        m = re.search(r"BRA (0x[0-9a-f]+)", r[1])
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in where:
            loops.append((where[int(m.group(1), 16)], i))
    per = collections.defaultdict(collections.Counter)
    for i, r in enumerate(data):
        # the innermost loop holding instruction i
        inside = [(b - a, a, b) for a, b in loops if a <= i <= b]
        name = "other"
        if inside:
            _, a, b = min(inside)
            name = f"loop {hex(addr[a])[-5:]}-{hex(addr[b])[-5:]} ({b - a + 1} instructions)"
        c = per[name]
        c["samples"] += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        c["executed"] += int(r[ix["Instructions Executed"]] or 0)
        for h in reasons:
            c[h] += int(r[ix[h]] or 0)
    return per, reasons


def main():
    per, reasons = regions(sys.argv[1])
    total = sum(c["samples"] for c in per.values()) or 1
    for name, c in sorted(per.items(), key=lambda kv: -kv[1]["samples"]):
        top = sorted(((c[h], h[6:]) for h in reasons), reverse=True)[:6]
        n = max(1, c["samples"])
        print(f"{name:44s} {100 * c['samples'] / total:5.1f}% of samples  "
              + " ".join(f"{r}:{100 * v / n:.0f}%" for v, r in top))


if __name__ == "__main__":
    main()
