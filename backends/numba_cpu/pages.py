"""Key and value loads of the kernels that read a KV cache: through a page table, or as
dense rows. The page table is the one addressing seam the loads take: key position ``p`` of
sequence ``b`` is slot ``p % page_size`` of page ``table[b, p // page_size]`` of a
``(num_pages, Hkv, page_size, D)`` kernel view; an empty table means a dense
``(B, Hkv, N, D)`` view.
"""
from numba import njit

from .forward_kernels import load_tile
from .scalar import load


@njit
def load_cache_rows(src, table, page_size, b, h, r0, n, out, mult):
    """out[:n, :D] = keys or values r0 .. r0+n-1 of sequence b, head h (the masked
    forward's Sᵀ = K Qᵀ takes K as stored, as P V takes V)."""
    if table.shape[0] == 0:
        load_tile(src, b, h, r0, n, out, mult)
        return
    for r in range(n):
        p = r0 + r
        page = table[b, p // page_size]
        slot = p % page_size
        for d in range(src.shape[3]):
            out[r, d] = load(src[page, h, slot, d]) * mult
