"""A forward with a mask_mod on an H100/H200: the schedule without the overlap
(``tilings.HOPPER_MASK_MOD``, g2n64, empty tiles skipped), the overlapped one
(``--candidate``, g2n128o: the classes' key range, every tile of it computed) and the
persistent kernel (``tilings.MASK_MOD_PERSISTENT``, where it has a tiling for the head
dim: one block per SM taking query tiles from a counter), side by side in one process,
each checked against the first and timed.

Cases (bf16, B=4 H=16 N=8192, ``--head-dims``, non-causal unless ``--causal``): 8 equal
documents (every visited tile full; a ``block_mask`` made once, untimed) and 8 documents
of unequal lengths (their edges inside 128-blocks: partial tiles); the unmasked forward
(the default tiling) for the ratios. Times: CUDA events around ``attention_forward``
(``hopper_forward.timer``: median of ``--repeat`` after 3 warm-up calls). The table comes
last: ms, and the time over the unmasked forward's.

Usage: python tools/mask_mod_forward.py [--repeat 10] [--head-dims 128] [--causal]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from hopper_forward import environment, timer  # (tools/ is the script's directory)


def docs(B, N, lengths):
    ids = np.repeat(np.arange(len(lengths)), lengths)[:N]
    return np.ascontiguousarray(np.broadcast_to(ids, (B, N)).astype(np.int32))


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--candidate", default="2,128,1",
                    help="warpgroups,keys,overlap of the overlapped tiling (g2n128o)")
    args = ap.parse_args(argv)
    cand = tuple(int(x) for x in args.candidate.split(","))
    torch, flashcore, launch = environment()
    from flashcore.backends.numba_cuda.hopper import tilings

    from flashcore.bench.masks import same_doc

    B, H, N = 4, 16, 8192
    saved = dict(tilings.MASK_MOD_TILES)
    saved_ps = dict(tilings.MASK_MOD_PERSISTENT)
    cand_tiles = tilings.HopperTiles(cand[0], cand[1], bool(cand[2]))
    names = [("g2n64", None), (cand_tiles.tag, cand_tiles)]
    names += [("persistent", None)] if saved_ps else []
    rows, failed = [], False
    for D in (int(x) for x in args.head_dims.split(",")):
        g = torch.Generator(device="cuda").manual_seed(D)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(3))
        base = dict(causal=args.causal, backend="numba_cuda")
        none = timer(torch, lambda: flashcore.attention_forward(q, k, v, **base), args.repeat)
        rng = np.random.default_rng(0)
        cuts = np.sort(rng.choice(np.arange(1, N), 7, replace=False))
        cases = {"8 equal documents": docs(B, N, [N // 8] * 8),
                 "8 unequal documents": docs(B, N, np.diff(np.r_[0, cuts, N]))}
        for label, ids in cases.items():
            bm = flashcore.create_block_mask(same_doc, B, None, N, N, mod_args=(ids,))
            opts = dict(base, mask_mod=same_doc, mod_args=(torch.from_numpy(ids).cuda(),),
                        block_mask=bm)
            out, ms = {}, {}
            for name, tiles in names:
                if name == "persistent" and D not in saved_ps:
                    continue
                tilings.MASK_MOD_TILES.clear()
                if tiles is not None:
                    tilings.MASK_MOD_TILES[(D, False)] = tiles
                if name != "persistent":
                    tilings.MASK_MOD_PERSISTENT.clear()
                launch._PLANS.clear()
                tags = []
                real = launch.launch_forward

                def spy(kern, *a, real=real, **kw):
                    tags.append(kern._dispatcher.py_func.__qualname__)
                    return real(kern, *a, **kw)

                launch.launch_forward = spy
                try:
                    out[name] = flashcore.attention_forward(q, k, v, **opts)
                finally:
                    launch.launch_forward = real
                want = name if tiles is None else tiles.tag
                if name == "persistent":
                    want = saved_ps[D].tag
                if not (len(tags) == 1 and f"_{want}_" in tags[0]):
                    print(f"check D={D} {label} {name}: FAIL ran {tags}", flush=True)
                    failed = True
                ms[name] = timer(torch, lambda: flashcore.attention_forward(q, k, v, **opts),
                                 args.repeat)
                tilings.MASK_MOD_TILES.clear()
                tilings.MASK_MOD_TILES.update(saved)
                tilings.MASK_MOD_PERSISTENT.update(saved_ps)
            launch._PLANS.clear()
            o1, l1 = out["g2n64"]
            for name in ms:
                o2, l2 = out[name]
                diff = float((o1.float() - o2.float()).norm() / o1.float().norm())
                fin = torch.isfinite(l1)
                ok = (diff < 1e-2 and bool(torch.equal(fin, torch.isfinite(l2)))
                      and float((l1[fin] - l2[fin]).abs().max()) < 1e-3
                      and bool(torch.isfinite(o2).all()))
                failed |= not ok
                print(f"check D={D} {label} {name} against g2n64: "
                      f"{'pass' if ok else 'FAIL'} (o {diff:.2e})", flush=True)
            rows.append((D, label, none, ms))
    print(f"\nbf16 B={B} H={H} N={N} {'causal' if args.causal else 'non-causal'}, "
          f"{torch.cuda.get_device_name(0)}; forward ms (median of {args.repeat}), and over the "
          "unmasked forward's")
    heads = [n for n, _ in names]
    print("| D | mask | unmasked | " + " | ".join(heads) + " | "
          + " | ".join(f"{n} / unmasked" for n in heads) + " |")
    print("|---" * (3 + 2 * len(heads)) + "|")
    for D, label, none, ms in rows:
        print(f"| {D} | {label} | {none:.3f} | "
              + " | ".join(f"{ms[n]:.3f}" if n in ms else "-" for n in heads) + " | "
              + " | ".join(f"{ms[n] / none:.3f}" if n in ms else "-" for n in heads) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
