"""What every kernel does first: which tile and which heads a block owns, and the per-row
softmax statistics the backward passes read."""
from __future__ import annotations

from numba import float32

from .constants import LOG2E, NEG_INF, POS_INF
from .convert import device_function


@device_function
def block_tile(block_x, block_y, grid_x, grid_y, CAUSAL, LAST_HEAVIEST, GROUP):
    """``(tile, bh)`` of block ``(block_x, block_y)`` on a grid of ``(grid_x, grid_y)`` =
    (tiles, batch * heads) blocks: as launched, or (``CAUSAL``: tiles differ in work)
    heaviest first, across all grid rows (``GROUP`` 0) or within each group of ``GROUP``
    rows in turn (compile-time; the wgmma kernels take :data:`HEAD_GROUP`). Blocks start in
    order of their linear index (x fastest); group ``g`` takes the linear indices ``g *
    GROUP * grid_x`` on, and in it index ``L`` becomes rank ``L // rows`` of row ``L %
    rows`` (``rows`` the group's, fewer in a last partial group; all of ``grid_y`` with
    ``GROUP`` 0): every head of the group starts its heaviest tile (the last one with
    ``LAST_HEAVIEST``, else the first) before any lighter one, so a group's tail is made of
    its lightest tiles. Groups keep the blocks running at once on a few heads, whose keys
    and values stay in L2 (+10% on the wgmma D=128 causal forward at B=4 H=16); the
    mma.sync and SIMT kernels keep the order across all rows (the extra arithmetic made the
    mma.sync dK/dV kernel with every mask spill 100 bytes). (Arguments, not
    ``cuda.blockIdx``: the simulator gives kernels, not helpers, their thread's view.)"""
    if not CAUSAL:
        return block_x, block_y
    lin = block_x + block_y * grid_x
    if GROUP == 0:
        rank = lin // grid_y
        return (grid_x - 1 - rank if LAST_HEAVIEST else rank), lin - rank * grid_y
    span = GROUP * grid_x  # blocks of a whole group
    grp = lin // span
    rows = min(GROUP, grid_y - grp * GROUP)
    within = lin - grp * span
    rank = within // rows
    bh = grp * GROUP + within - rank * rows
    return (grid_x - 1 - rank if LAST_HEAVIEST else rank), bh


@device_function
def split_heads(bh, heads, group):
    """``(b, h, hk)`` of grid row ``bh`` = ``b * heads + h``: batch, head, and the key/value
    head ``h // group`` it reads (GQA; ``group`` 1 when ``heads`` are key/value heads)."""
    b = bh // heads
    h = bh - b * heads
    return b, h, h // group


@device_function
def lse_log2(lv):
    """A row's stored lse in the log2 domain of ``P = exp2(S · scale · log2 e − lse ·
    log2 e)``: +inf for a row that sees no key (lse −inf), so that its P is 0."""
    return POS_INF if lv == NEG_INF else lv * float32(LOG2E)


@device_function
def query_stats(lse, delta, lidx, didx, valid):
    """``(lse · log2 e, delta)`` of one query row, as both backward passes use them in
    ``P = exp2(S · scale · log2 e − lse · log2 e)`` and ``dS = P (dP − delta)``: a row that
    sees no key (lse −inf) reads +inf, so that its P is 0; a row past the end (``valid``
    false; ``lidx``, ``didx`` are not read) reads ``(+inf, 0)``."""
    ls = POS_INF
    dl = float32(0.0)
    if valid:
        ls = lse_log2(lse[lidx])
        dl = delta[didx]
    return ls, dl
