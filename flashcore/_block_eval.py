"""The element-wise evaluation of a mask_mod behind create_block_mask (Numba, CPU)."""
import numpy as np
from numba import njit, prange


@njit(parallel=True)
def classify(mask_mod, classes, Nq, Nk, block, mod_args, EMPTY, PARTIAL, FULL):
    """classes[b, h, qt, kt] <- EMPTY, PARTIAL or FULL (flashcore._mods's class numbers,
    passed in) for mask_mod's visible elements of query rows ``qt*block ...`` and keys
    ``kt*block ...``."""
    B, H, nqt, nkt = classes.shape
    for job in prange(B * H * nqt):
        b = job // (H * nqt)
        h = (job // nqt) % H
        qt = job % nqt
        i0 = qt * block
        i1 = min(Nq, i0 + block)
        for kt in range(nkt):
            j0 = kt * block
            j1 = min(Nk, j0 + block)
            seen = 0
            for i in range(i0, i1):
                for j in range(j0, j1):
                    if mask_mod(b, h, i, j, *mod_args):
                        seen += 1
            total = (i1 - i0) * (j1 - j0)
            classes[b, h, qt, kt] = EMPTY if seen == 0 else (FULL if seen == total
                                                              else PARTIAL)
    return np.int64(0)
