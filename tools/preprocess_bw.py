"""The backward's preprocess (``delta = rowsum(dO * O)``) alone on a GPU: its tilings side by
side in one process, each checked against a float64 sum and timed, with the bandwidth it
reaches (bytes of O and dO read + delta written, over the time) next to the device's copy
bandwidth (a device-to-device copy of 2 GiB: bytes read + written / time).

Forms (``launch.simt_variants``' preprocess, built with other tilings):
- ``scalar w32``: a warp per row, one element per lane and load (the form before
  2026-11-28's vector loads: ``RowTiles(128, 32, vector=False)``);
- ``vector``: the default tiling (``RowTiles.for_head_dim``), 16-byte loads of O and dO;
- ``vector, scalar path``: the same tiling made to take its scalar loads (``vec`` 0, as for
  rows that are not 16-byte aligned).

Shapes: the varlen rows of ``tools/packed_gpu.py`` (28212 tokens, H=16, D=128, bf16,
packed (total, H, D)), and dense (B, H, N, D) bf16 rows of the bench (B=4 H=16 N=4096 D=64
and 128; B=1 H=16 N=16384 D=128). Times: CUDA events, median of ``--repeat`` calls.

Usage: python tools/preprocess_bw.py [--repeat 50]
"""
from __future__ import annotations

import argparse

import torch
from flashcore.backends.numba_cuda import launch, tilings
from flashcore.backends.numba_cuda.variant import Variant
from hopper_forward import timer  # (tools/ is the script's directory)


def copy_bandwidth(repeat) -> float:
    """GB/s of a device-to-device copy of 2 GiB (read + written)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timer(torch, lambda: b.copy_(a), repeat)
    return 2 * a.numel() / ms / 1e6


def shapes():
    """(label, o, do, (B, H, N)): (B, H, N, D)-ordered views of the arrays."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    total, h, d = 28212, 16, 128
    o = torch.randn(total, h, d, device="cuda", generator=g).bfloat16()
    do = torch.randn(total, h, d, device="cuda", generator=g).bfloat16()
    # packed rows as one batch entry: (1, H, total, D) in (B, H, N, D) order
    out.append(("varlen 28212x16 D=128", o.permute(1, 0, 2)[None], do.permute(1, 0, 2)[None],
                (1, h, total)))
    for b, h, n, d in ((4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)):
        o = torch.randn(b, h, n, d, device="cuda", generator=g).bfloat16()
        do = torch.randn(b, h, n, d, device="cuda", generator=g).bfloat16()
        out.append((f"dense {b}x{h}x{n} D={d}", o, do, (b, h, n)))
    return out


def launcher(tiles, d, vec):
    """A function(o, do, delta) launching the preprocess of tiling ``tiles`` (``vec``: its
    16-byte loads allowed)."""
    v = Variant("preprocess", "simt", d, "bfloat16", False, tiles)
    kern, rows = launch.kernel(v, torch.cuda.current_device()), v.block_m

    def run(o, do, delta):
        B, H, N, _ = o.shape
        stream = torch.cuda.current_stream().cuda_stream
        kern(((N + rows - 1) // rows, B * H), stream,
             (o.data_ptr(), do.data_ptr(), delta.data_ptr(), N, H, *o.stride(),
              *do.stride(), int(vec)))
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}")
    copy = copy_bandwidth(args.repeat)
    print(f"device copy bandwidth: {copy:.0f} GB/s")
    rows, failed = [], 0
    for label, o, do, (B, H, N) in shapes():
        d = o.shape[-1]
        ref = (o.double() * do.double()).sum(-1).float()
        forms = (("scalar w32", tilings.RowTiles(128, 32, vector=False), False),
                 ("vector", tilings.RowTiles.for_head_dim(d), True),
                 ("vector, scalar path", tilings.RowTiles.for_head_dim(d), False))
        nbytes = 2 * o.numel() * o.element_size() + B * H * N * 4
        for name, tiles, vec in forms:
            fn = launcher(tiles, d, vec)
            delta = torch.full((B, H, N), float("nan"), device="cuda")
            fn(o, do, delta)
            err = float((delta - ref).abs().max() / ref.abs().max())
            ok = err < 1e-5
            failed += not ok
            ms = timer(torch, lambda fn=fn, delta=delta: fn(o, do, delta), args.repeat)
            gbs = nbytes / ms / 1e6
            rows.append((label, name, ms, gbs, err, ok))
            print(f"check {label} {name}: {'pass' if ok else 'FAIL'} (max rel err {err:.1e})")
    print("\n| shape | form | ms | GB/s | of copy |\n|---|---|---|---|---|")
    for label, name, ms, gbs, _, _ in rows:
        print(f"| {label} | {name} | {ms:.4f} | {gbs:.0f} | {gbs / copy:.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
