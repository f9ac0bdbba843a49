"""The user's score_mod / mask_mod on the backward (issue 14's speed rows) on an H100/H200:
forward+backward and the backward alone, each mask on the wgmma backward and on the
mma.sync one (``FLASHCORE_HOPPER_BWD=0``), side by side in one process.

Masks (bf16, B=4 H=16 N=8192 D=128 unless given, non-causal unless ``--causal``; as the bench's
``--masks``): none; the built-in softcap 30; the same softcap written as a Python
``score_mod``; a relative-position ``score_mod`` ``s + 0.01 (j - i)``; 8 equal documents by
a ``mask_mod`` with a ``block_mask`` made once, untimed. Each is checked first: the wgmma
backward's gradients against the mma.sync backward's (norm-wise relative difference, both
within ~1e-2 of the exact ones at bf16), and which kernels ran. Times: CUDA events around
``attention_forward`` then ``attention_backward`` (f+b) and around the backward alone
(``hopper_forward.timer``: the median of ``--repeat`` calls after 3 warm-up calls), the
front end's host time included. The table comes last: ms, then the time over the built-in
softcap's in the same backward (the issue: a score_mod softcap within 1.15x) and over no
mask.

``--varlen``: packed sequences instead (``attention_varlen_forward`` / ``_backward``): 16 of
random lengths 128..4096 (seed 0; issue 15's varlen case), H=16, the same masks but the
documents (8 per sequence, ids per sequence row) without a block_mask, which packed calls
do not take.

Usage: python tools/mods_backward.py [--repeat 10] [--causal] [--seqlen 8192] [--head-dim 128]
                                     [--varlen]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from hopper_forward import environment, timer  # (tools/ is the script's directory)

HOPPER_BWD_ENV = "FLASHCORE_HOPPER_BWD"
TOL = 2e-2


def _cases(docs):
    """``(label, options)`` of each case: the bench's mods (``flashcore.bench.masks``), the
    documents' options ``docs`` last."""
    from flashcore.bench.masks import relpos, softcap_mod

    return [("none", {}), ("softcap 30", {"softcap": 30.0}),
            ("softcap 30 as score_mod", {"score_mod": softcap_mod(30.0)}),
            ("relpos score_mod", {"score_mod": relpos}), ("8 docs mask_mod", docs)]


def masks(flashcore, torch, B, H, N):
    """:func:`_cases` of a dense batch: 8 equal documents, a block_mask made once."""
    from flashcore.bench.masks import doc_ids, same_doc

    doc = doc_ids(B, N, 8)
    bm = flashcore.create_block_mask(same_doc, B, None, N, N, mod_args=(doc,))
    return _cases({"mask_mod": same_doc, "mod_args": (torch.from_numpy(doc).cuda(),),
                   "block_mask": bm})


def varlen_masks(flashcore, torch, lengths):
    """:func:`_cases` of packed sequences of ``lengths``: 8 documents per sequence, no
    block_mask (packed calls take none)."""
    from flashcore.bench.masks import same_doc

    doc = np.zeros((len(lengths), int(max(lengths))), np.int64)
    for s, n in enumerate(lengths):
        doc[s, :n] = np.arange(n) * 8 // n
    return _cases({"mask_mod": same_doc, "mod_args": (torch.from_numpy(doc).cuda(),)})


def calls(flashcore, torch, args):
    """``(shape label, forward(opts), backward(o, lse, opts), cases)`` of dense or packed
    inputs."""
    H, D = 16, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    if not args.varlen:
        B, N = 4, args.seqlen
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", generator=g,
                                   dtype=torch.bfloat16) for _ in range(4))
        return (f"B={B} H={H} N={N} D={D}", lambda o: flashcore.attention_forward(q, k, v, **o),
                lambda o_, l_, o: flashcore.attention_backward(do, q, k, v, o_, l_, **o),
                masks(flashcore, torch, B, H, N))
    lengths = np.random.default_rng(0).integers(128, 4097, 16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device="cuda")
    total = int(lengths.sum())
    q, k, v, do = (torch.randn(total, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(4))
    m = int(lengths.max())
    kw = {"max_seqlen_q": m, "max_seqlen_k": m}
    return (f"varlen 16 sequences 128..4096 ({total} tokens) H={H} D={D}",
            lambda o: flashcore.attention_varlen_forward(q, k, v, cu, cu, **kw, **o),
            lambda o_, l_, o: flashcore.attention_varlen_backward(do, q, k, v, o_, l_, cu, cu,
                                                                  **kw, **o),
            varlen_masks(flashcore, torch, lengths))


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--varlen", action="store_true")
    args = ap.parse_args(argv)
    torch, flashcore, launch = environment()
    shape, forward, backward, cases = calls(flashcore, torch, args)
    rows, failed = [], False
    for label, opts in cases:
        opts = dict(opts, causal=args.causal, backend="numba_cuda")
        o, lse = forward(opts)
        grads, times = {}, {}
        for mode, env in (("wgmma", "1"), ("mma.sync", "0")):
            os.environ[HOPPER_BWD_ENV] = env
            ran = []
            real = launch.launch_dkdv

            def spy(kern, *a, real=real, **kw):
                ran.append(kern.name)
                return real(kern, *a, **kw)

            launch.launch_dkdv = spy
            grads[mode] = backward(o, lse, opts)
            launch.launch_dkdv = real
            want = "attn_backward_dkdv_wgmma" if mode == "wgmma" else "attn_backward_dkdv_tc"
            if ran != [want]:
                print(f"check {label} {mode}: FAIL ran {ran}", flush=True)
                failed = True

            def fb(opts=opts):
                backward(*forward(opts), opts)

            def bwd(opts=opts, o=o, lse=lse):
                backward(o, lse, opts)

            times[mode] = (timer(torch, fb, args.repeat), timer(torch, bwd, args.repeat))
        os.environ.pop(HOPPER_BWD_ENV, None)
        diff = max(float((a.float() - b.float()).norm() / b.float().norm())
                   for a, b in zip(grads["wgmma"], grads["mma.sync"]))
        ok = diff < TOL and all(bool(torch.isfinite(x).all()) for x in grads["wgmma"])
        failed |= not ok
        print(f"check {label}: {'pass' if ok else 'FAIL'} (wgmma vs mma.sync {diff:.2e})",
              flush=True)
        rows.append((label, times))
    base = {m: dict(rows)["softcap 30"][m] for m in ("wgmma", "mma.sync")}
    none = {m: dict(rows)["none"][m] for m in ("wgmma", "mma.sync")}
    print(f"\nbf16 {shape} {'causal' if args.causal else 'non-causal'}, "
          f"{torch.cuda.get_device_name(0)}; ms (median of {args.repeat}); ratios: over the "
          "built-in softcap's / over no mask's, same backward")
    print("| mask | f+b wgmma | f+b mma.sync | bwd wgmma | bwd mma.sync | f+b wgmma ÷ softcap "
          "| f+b wgmma ÷ none | f+b mma.sync ÷ softcap |")
    print("|---|---|---|---|---|---|---|---|")
    for label, t in rows:
        print(f"| {label} | {t['wgmma'][0]:.2f} | {t['mma.sync'][0]:.2f} | {t['wgmma'][1]:.2f} "
              f"| {t['mma.sync'][1]:.2f} | {t['wgmma'][0] / base['wgmma'][0]:.2f} "
              f"| {t['wgmma'][0] / none['wgmma'][0]:.3f} "
              f"| {t['mma.sync'][0] / base['mma.sync'][0]:.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
