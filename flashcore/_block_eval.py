"""The element-wise evaluation of a mask_mod behind create_block_mask (Numba, CPU).

One kernel per number of mod_args (:func:`classify` picks it), each passing the arrays to
the mask as separate arguments: a call that unpacks a tuple (``mask_mod(b, h, i, j,
*mod_args)``) in the loop keeps LLVM from inlining and vectorizing it (a document mask:
0.60 against 0.047 ns an element on one Zen 4 core,
notes/mask_mod_persistent_2026-11-28.md)."""
import numpy as np
from numba import njit, prange

_SOURCE = '''
def classify(mask_mod, classes, Nq, Nk, block, mod_args, EMPTY, PARTIAL, FULL, lens_q,
             lens_k):
    {unpack}
    B, H, nqt, nkt = classes.shape
    for job in prange(B * H * nqt):
        b = job // (H * nqt)
        h = (job // nqt) % H
        qt = job % nqt
        nq, nk = Nq, Nk
        if lens_q.size:
            nq, nk = lens_q[b], lens_k[b]
        i0 = qt * block
        i1 = min(nq, i0 + block)
        for kt in range(nkt):
            j0 = kt * block
            j1 = min(nk, j0 + block)
            seen = 0
            for i in range(i0, i1):
                row = 0
                for j in range(j0, j1):
                    row += np.int64(mask_mod(b, h, i, j{args}))
                seen += row
            total = max(0, i1 - i0) * max(0, j1 - j0)
            classes[b, h, qt, kt] = EMPTY if seen == 0 else (FULL if seen == total
                                                              else PARTIAL)
    return np.int64(0)
'''

_KERNELS = {}


def _kernel(n):
    """The kernel for ``n`` mod_args, made once."""
    if n not in _KERNELS:
        names = [f"a{k}" for k in range(n)]
        src = _SOURCE.format(
            unpack=(", ".join(names) + ", = mod_args") if n else "pass",
            args="".join(", " + a for a in names))
        space = {"np": np, "prange": prange}
        exec(compile(src, f"<flashcore._block_eval.classify, {n} mod_args>", "exec"),
             space)
        _KERNELS[n] = njit(parallel=True)(space["classify"])
    return _KERNELS[n]


def classify(mask_mod, classes, Nq, Nk, block, mod_args, EMPTY, PARTIAL, FULL, lens_q,
             lens_k):
    """classes[b, h, qt, kt] <- EMPTY, PARTIAL or FULL (flashcore._mods's class numbers,
    passed in) for mask_mod's visible elements of query rows ``qt*block ...`` and keys
    ``kt*block ...``, below ``Nq`` and ``Nk``, or (``lens_q``, ``lens_k`` not empty) below
    batch entry ``b``'s own ``lens_q[b]`` and ``lens_k[b]`` (a varlen call's sequences;
    a tile past them is EMPTY). ``mask_mod`` is Numba-compiled, ``mod_args`` a tuple of
    arrays."""
    return _kernel(len(mod_args))(mask_mod, classes, Nq, Nk, block, tuple(mod_args), EMPTY,
                                  PARTIAL, FULL, lens_q, lens_k)
