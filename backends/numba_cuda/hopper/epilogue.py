"""The wgmma kernels' epilogue: a warpgroup's 64 rows of an output (O; dK, dV; dQ) through
its own lines of a resident tile in shared memory (Q; K, V; Q), then to global memory in
16-byte stores.

Written from the accumulators straight to global memory (``store_frags``), each thread
rounds and stores its fragment elements one by one: 2-byte stores, each warp instruction
touching 8 rows' sectors partially, 64 of them per thread at D=128, plus the rounding in
integer instructions. A block's start and end run under no other block's work (one block
per SM), so they weigh on every short tile walk: varlen sequences, windows, causal tiles.
Here each thread rounds pairs to 16-bit by one ``cvt`` (``fragments.pack``) and writes them
as 32-bit words into the warpgroup's lines of the Q tile, which its wgmmas have finished
reading, in the tile's 128-byte swizzle (the 32 lanes of a store land on 32 banks); then
each thread copies whole 16-byte chunks of rows (consecutive lanes along a row, whole
sectors). Outputs are bit for bit the same as ``store_frags``'s (round to nearest even;
NaN stays NaN).

The tile's lines were copied by all of the block's threads: a kernel whose loop ran no
step (a block that sees no key, or no query) makes a block-wide barrier after its last
``cp.async`` wait before it calls this (the loops' barriers do it otherwise); the
warpgroup's own barrier here does not wait for the other warpgroup's copies.

It needs the output's rows contiguous and 16-byte aligned: the adapters allocate the
outputs themselves (contiguous, from the array library's allocator), and other strides take
``store_frags``.
"""
from __future__ import annotations

from ..device.convert import copy16, device_function
from ..device.pipeline import named_sync, st_shared_u32
from ..tensor_core.fragments import pack, store_frags


@device_function
def wg_barrier(wg):
    """A barrier of this warpgroup's 128 threads alone (named barrier ``3 + wg``: the
    ping-pong schedule's turns take 1 and 2)."""
    if wg == 0:
        named_sync(3, 128)
    else:
        named_sync(4, 128)


@device_function
def store_o(BF16, smem, e0, o, obase, w_row, i, Nq, osn, osd, oa, inv0, inv1, D, BM, wg,
            warp, g, tq, wtid):
    """``D`` columns of this warpgroup's rows ``w_row .. w_row + 63`` of an output (this
    thread's: ``i``, ``i + 8``, scaled by ``inv0``, ``inv1``; ``oa`` in wgmma's accumulator
    order) to ``o[obase + row * osn + col * osd]``, rows at or past ``Nq`` skipped, through
    lines ``64 wg ..`` of the ``BM``-line tile at element ``e0`` of ``smem``, which only
    this warpgroup's wgmmas read (every one waited for)."""
    CH = D // 8  # 8-column n-tiles of the accumulators, 16-byte chunks of a row
    if osd != 1 or (osn & 7) != 0 or (obase & 7) != 0:  # (rows not 16-byte aligned)
        store_frags(o, obase, i, Nq, osn, osd, oa, 0, inv0, inv1, CH, tq)
        return
    lb = e0 + wg * (64 * 64)  # the warpgroup's first line (64 elements a line)
    wg_barrier(wg)  # (every warp's wgmmas have read its Q rows)
    for dn in range(CH):
        blk = lb + (dn >> 3) * (BM * 64)  # the 64-column block of this n-tile
        for r in range(2):
            line = 16 * warp + g + 8 * r
            mul = inv0 if r == 0 else inv1
            bits = pack(BF16, oa[4 * dn + 2 * r] * mul, oa[4 * dn + 2 * r + 1] * mul)
            st_shared_u32(smem, blk + line * 64 + (((dn & 7) ^ (line & 7)) << 3) + 2 * tq,
                          bits)
    wg_barrier(wg)
    RS = 128 // CH  # rows a pass of the warpgroup
    c = wtid % CH
    blk = lb + (c >> 3) * (BM * 64)
    for p in range(64 // RS):
        line = wtid // CH + p * RS
        row = w_row + line
        if row < Nq:
            copy16(o, obase + row * osn + 8 * c, smem,
                   blk + line * 64 + (((c & 7) ^ (line & 7)) << 3))
