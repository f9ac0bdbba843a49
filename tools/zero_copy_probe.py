"""Why does autograd sometimes copy numba_cuda's gradients instead of keeping them?

tests/test_torch.py::test_zero_copy_by_data_pointer[cuda] fails now and then: q.grad is
not the buffer the backend returned, so AccumulateGrad cloned it, which it does when the
returned tensor has more references than the engine's own. This repeats the test's call
many times; each time the buffer was not kept it prints who else held the backend's
tensor (gc.get_referrers through a weakref, from a post-accumulate-grad hook), its
refcount when the backend returned it, and whether a gc.collect() before backward
changes the rate.

Usage (GPU): python tools/zero_copy_probe.py [--repeat 200]
"""
from __future__ import annotations

import argparse
import gc
import sys
import weakref

import numpy as np
import torch

import flashcore
from flashcore import _dispatch


def describe(obj, depth=0):
    out = []
    for r in gc.get_referrers(obj):
        if r is sys._getframe() or isinstance(r, list) and r is _HOLD:
            continue
        kind = type(r).__name__
        if kind == "frame":
            out.append(f"frame {r.f_code.co_filename}:{r.f_lineno} {r.f_code.co_name}")
        elif kind in ("dict", "list", "tuple", "cell"):
            summary = f"{kind} of {len(r)}" if hasattr(r, "__len__") else kind
            if depth < 1:
                inner = describe(r, depth + 1)
                summary += " <- [" + "; ".join(inner[:4]) + "]"
            out.append(summary)
        else:
            out.append(kind)
    return out


_HOLD: list = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    real = _dispatch.select
    state = {}

    def select(case, backend):
        impl = real(case, backend)

        class Wrapped:
            NAME = impl.NAME

            @staticmethod
            def forward(q, k, v, c):
                return impl.forward(q, k, v, c)

            @staticmethod
            def backward(*a):
                out = impl.backward(*a)
                state["refs"] = [sys.getrefcount(x) for x in out]
                state["weak"] = [weakref.ref(x) for x in out]
                state["ptrs"] = [x.data_ptr() for x in out]
                return out

        return Wrapped

    _dispatch.select = select
    rng = np.random.default_rng(15)
    copies = {False: 0, True: 0}
    shown = 0
    for it in range(args.repeat):
        collect = bool(it % 2)
        q, k, v = (torch.from_numpy(rng.standard_normal((2, 16, 4, 16)).astype(np.float32))
                   .cuda().requires_grad_() for _ in range(3))
        seen = {}

        def hook(p, name):
            seen[name] = p.grad.data_ptr()
            if name == "q" and p.grad.data_ptr() != state["ptrs"][0]:
                w = state["weak"][0]()
                seen["holders"] = describe(w) if w is not None else ["(already freed)"]
        for name, x in (("q", q), ("k", k), ("v", v)):
            x.register_post_accumulate_grad_hook(lambda p, n=name: hook(p, n))
        o = flashcore.attention(q, k, v, layout="bnhd")
        if collect:
            gc.collect()
        o.sum().backward()
        kept = [seen[n] == p for n, p in zip("qkv", state["ptrs"])]
        if not all(kept):
            copies[collect] += 1
            if shown < 5:
                shown += 1
                print(f"iter {it} (gc.collect before backward: {collect}): kept {kept}, "
                      f"refcounts at return {state['refs']}, holders of dq: "
                      f"{seen.get('holders')}")
    n = args.repeat // 2
    print(f"zero-copy probe: copies without gc.collect {copies[False]}/{n}, "
          f"with gc.collect before backward {copies[True]}/{args.repeat - n}")


if __name__ == "__main__":
    main()
