"""What a call with a mask_mod and no BlockMask pays for its tile classes, with flashcore from
whichever tree ``PYTHONPATH`` names (torch CUDA tensors, B=4 H=16 N=8192 D=128 bf16, 8
equal documents by per-token ids, forward only). One line per measurement, ms per call
(tools/packed_gpu.timed: CUDA events, the host's work counted; ``inner`` calls back to back):

- ``block_mask``: the ids' BlockMask made once (untimed), then calls with it;
- ``same ids``: no BlockMask, the same ids tensor every call;
- ``new ids``: no BlockMask, the same documents numbered anew every call (new contents:
  a training loop whose packing changes every step);
- ``per-head mask``: a mask that reads ``h`` (its classes cannot be shared by the heads),
  the same ids every call, then new ids every call;
- ``create_block_mask``: the BlockMask's own time (B given, H None), three calls with new
  ids (the first compiles the mask).

``PROFILE=1``: each path's kernels (torch.profiler, one call) before its timings.

Also checks that the calls without a BlockMask give the BlockMask call's output bit for
bit. For before/after, run two trees in turns in one device call::

    for t in old new; do PYTHONPATH=/path/to/$t python3 tools/mask_classes.py $t; done

(notes/gpu_tile_classes_2026-11-28.md).
"""
import os
import sys
import time

import torch
from packed_gpu import kernel_times, timed  # (tools/: the decode measurements' own)

import flashcore


def same_doc(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def head_doc(b, h, i, j, ids):
    return ids[b, i] == ids[b, j] and h >= 0


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "here"
    B, H, N, D = (int(x) for x in os.environ.get("SHAPE", "4,16,8192,128").split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    per = N // 8

    def ids_for(label):  # (the same documents, numbered from ``label``: new contents)
        pos = torch.arange(N, device="cuda")
        return (pos // per + label).to(torch.int32)[None].repeat(B, 1).contiguous()

    ids = ids_for(0)
    made = []
    for n in range(3):  # (the first call compiles the mask)
        t0 = time.perf_counter()
        bm = flashcore.create_block_mask(same_doc, B, None, N, N, mod_args=(ids_for(n),))
        made.append(time.perf_counter() - t0)
    bm = flashcore.create_block_mask(same_doc, B, None, N, N, mod_args=(ids,))
    ref = flashcore.attention(q, k, v, block_mask=bm, mod_args=(ids,))
    got = flashcore.attention(q, k, v, mask_mod=same_doc, mod_args=(ids,))
    print(f"check {tag} no BlockMask == BlockMask: "
          f"{'pass' if torch.equal(got, ref) else 'FAIL'}", flush=True)
    fresh = iter(range(1, 1 << 30))
    reps = int(os.environ.get("REPS", "10"))
    rows = [
        ("block_mask", lambda: flashcore.attention(q, k, v, block_mask=bm, mod_args=(ids,)),
         reps),
        ("same ids", lambda: flashcore.attention(q, k, v, mask_mod=same_doc, mod_args=(ids,)),
         reps),
        ("new ids", lambda: flashcore.attention(q, k, v, mask_mod=same_doc,
                                                mod_args=(ids_for(next(fresh)),)),
         int(os.environ.get("NEW_REPS", reps))),
        ("per-head mask", lambda: flashcore.attention(q, k, v, mask_mod=head_doc,
                                                      mod_args=(ids,)), reps),
        ("per-head mask, new ids", lambda: flashcore.attention(
            q, k, v, mask_mod=head_doc, mod_args=(ids_for(next(fresh)),)),
         int(os.environ.get("NEW_REPS", reps))),
    ]
    for name, fn, n in rows:
        if os.environ.get("PROFILE") == "1":
            kernel_times(fn, f"{tag} {name}")
        one = timed(fn, reps=n, warm=2) * 1e3
        b2b = timed(fn, reps=max(2, n // 3), warm=1, inner=5) * 1e3
        print(f"{tag} {name}: {one:.3f} ms per call, {b2b:.3f} ms back to back", flush=True)
    print(f"{tag} create_block_mask: " + ", ".join(f"{t * 1e3:.1f}" for t in made)
          + " ms (first, then new ids)", flush=True)


if __name__ == "__main__":
    main()
