"""The element-wise evaluation of a mask_mod behind create_block_mask (Numba, CPU)."""
import numpy as np
from numba import njit, prange


@njit(parallel=True)
def classify(mask_mod, classes, Nq, Nk, block, mod_args, EMPTY, PARTIAL, FULL, lens_q,
             lens_k):
    """classes[b, h, qt, kt] <- EMPTY, PARTIAL or FULL (flashcore._mods's class numbers,
    passed in) for mask_mod's visible elements of query rows ``qt*block ...`` and keys
    ``kt*block ...``, below ``Nq`` and ``Nk``, or (``lens_q``, ``lens_k`` not empty) below
    batch entry ``b``'s own ``lens_q[b]`` and ``lens_k[b]`` (a varlen call's sequences;
    a tile past them is EMPTY)."""
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
                for j in range(j0, j1):
                    if mask_mod(b, h, i, j, *mod_args):
                        seen += 1
            total = max(0, i1 - i0) * max(0, j1 - j0)
            classes[b, h, qt, kt] = EMPTY if seen == 0 else (FULL if seen == total
                                                              else PARTIAL)
    return np.int64(0)
