"""Document masks (and a window) on the default dispatch, forward and backward, for a
before/after of the mask seams on an H100/H200: run it once per tree (``PYTHONPATH`` and
a ``FLASHCORE_CACHE_DIR`` of its own), in turns, then ``--compare`` the two saved outputs.

Cases (bf16, B=4 H=16 N=8192, D=64 and 128, causal or not): no mask; 8 equal documents
and 8 unequal ones by a ``mask_mod`` with a ``block_mask`` made once (untimed); at D=128
non-causal a window of 1024 (512, 511). Each case's o, lse, dq, dk and dv are saved to
``--save``; times are CUDA events (``hopper_forward.timer``: median of ``--repeat``
after 3 warm-up calls) around ``attention_forward`` and around ``attention_backward``.
The table comes last.

Usage: python tools/mask_ab.py TAG [--repeat 10] [--save /tmp/ab_TAG.pt]
       python tools/mask_ab.py --compare A.pt B.pt   (bitwise equal, or the largest diffs)
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def compare(a_path, b_path) -> int:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    differ = 0
    for key in a:
        if all(torch.equal(x, y) for x, y in zip(a[key], b[key])):
            print(f"{key}: bitwise equal")
            continue
        differ += 1
        diffs = [float((x.float() - y.float()).abs().nan_to_num(0).max()) for x, y in
                 zip(a[key], b[key])]
        print(f"{key}: DIFFER (largest |a - b| of o, lse, dq, dk, dv: {diffs})")
    return 1 if differ else 0


def run(tag, repeat, save) -> int:
    from hopper_forward import environment, timer  # (tools/ is the script's directory)
    from mask_mod_forward import docs

    torch, flashcore, _ = environment()
    from flashcore.bench.masks import same_doc

    B, H, N = 4, 16, 8192
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, N), 7, replace=False))
    saved, rows = {}, []
    for D in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(D)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g,
                                   dtype=torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            cases = [("none", {})]
            if D == 128 and not causal:
                cases.append(("window1024", {"window": (512, 511)}))
            for name, ids in (("equal", docs(B, N, [N // 8] * 8)),
                              ("unequal", docs(B, N, np.diff(np.r_[0, cuts, N])))):
                bm = flashcore.create_block_mask(same_doc, B, None, N, N, mod_args=(ids,))
                cases.append((name, {"mask_mod": same_doc, "block_mask": bm,
                                     "mod_args": (torch.from_numpy(ids).cuda(),)}))
            for name, extra in cases:
                opts = dict(causal=causal, backend="numba_cuda", **extra)
                out, lse = flashcore.attention_forward(q, k, v, **opts)
                grads = flashcore.attention_backward(do, q, k, v, out, lse, **opts)
                key = f"D{D} {'causal' if causal else 'full'} {name}"
                saved[key] = [out.cpu(), lse.cpu()] + [x.cpu() for x in grads]
                tf = timer(torch, lambda: flashcore.attention_forward(q, k, v, **opts), repeat)
                tb = timer(torch, lambda: flashcore.attention_backward(do, q, k, v, out, lse,
                                                                       **opts), repeat)
                rows.append((key, tf, tb))
                print(f"{tag} | {key} | forward {tf:.3f} | backward {tb:.3f}", flush=True)
    torch.save(saved, save or f"/tmp/ab_{tag}.pt")
    print(f"\n{tag}: bf16 B={B} H={H} N={N}, {torch.cuda.get_device_name(0)}; ms (median of "
          f"{repeat})")
    print("| tree | case | forward | backward |\n|---|---|---|---|")
    for key, tf, tb in rows:
        print(f"| {tag} | {key} | {tf:.3f} | {tb:.3f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag", nargs="?", default="tree")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--save", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    return run(args.tag, args.repeat, args.save)


if __name__ == "__main__":
    sys.exit(main())
