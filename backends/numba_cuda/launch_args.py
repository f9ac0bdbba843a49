"""The arguments every kernel launch takes for what a call does not use (no ALiBi slopes,
no mod_args, dense rows, no tile classes) or builds from its arrays (packed rows, mod_args,
strides in (B, H, N, D) order, flat host views for the simulator), and the launches of
the attention kernels with them (their grids, their argument lists), and the argument
types of every kernel entry (:func:`signature`); ``launch`` re-exports them."""
from __future__ import annotations

import numpy as np
from numba.cuda import types

from .device.convert import SIMULATOR
from .device.user_mods import MAX_ARGS, MAX_DIMS

#: stored dtype name -> numba element type of the kernel's pointers (bf16 as raw bits)
_ELEM = {"float32": types.float32, "float16": types.float16, "bfloat16": types.uint16}
_I64 = types.int64
#: stored dtype name -> elements in 16 bytes (one vector load)
_VECTOR = {"float32": 4, "float16": 8, "bfloat16": 8}
_F64 = types.float64


#: mod_args dtype name -> numba element type of its pointer (bool arrays as their bytes)
_ARG_ELEM = {n: getattr(types, n) for n in (
    "float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64")}
_ARG_ELEM["bool"] = types.uint8
_I32P = types.CPointer(types.int32)
#: The packed-rows arguments every attention kernel takes last (device/seams.sequence;
#: read by varlen and KV-cache variants only, :func:`packed_args`): cu_seqlens_q,
#: cu_seqlens_k, the keys of each cached sequence, the block table (int32 pointers), then
#: the table's batch stride, the page size, the page stride, the packed query rows, the
#: keys per split, the split strides of the partial output and lse, and the number of
#: varlen sequences (``device/seams.packed_tile``).
PACKED_SIG = (_I32P,) * 4 + (_I64,) * 8


def signature(kernel: str, dtype: str, mod_args: tuple = (), split: bool = False) -> tuple:
    """Argument types of a kernel entry (variant.ENTRY): pointers (inputs and outputs in the
    stored dtype, lse and delta float32), then int64 sizes and strides, the float64 scale,
    then the ALiBi slopes (float32) and their batch and head strides (read only by ALiBi
    variants; others get any float32 buffer), then the user mods' arrays: MAX_ARGS
    pointers (typed by ``mod_args``, the variant's ``UserMods.args``; float32 past them)
    and MAX_ARGS * MAX_DIMS int64 extents, then the mask_mod's tile classes (int8, read by
    variants with a mask_mod) with their batch, head and query-block strides. Both families
    take the same arguments, then :data:`PACKED_SIG`. A ``split`` forward writes a float32
    partial output. The mask_mod's classification (``tile_classify``) takes the classes,
    seven sizes, the mod_args and the varlen offsets."""
    e = types.CPointer(_ELEM[dtype])
    f32 = types.CPointer(types.float32)
    o = f32 if split else e
    kinds = [a[0] for a in mod_args] + ["float32"] * (MAX_ARGS - len(mod_args))
    margs = tuple(types.CPointer(_ARG_ELEM[k]) for k in kinds) + (_I64,) * (MAX_ARGS * MAX_DIMS)
    cls = types.CPointer(types.int8)
    mods = (f32, _I64, _I64) + margs + (cls, _I64, _I64, _I64)
    dkdv = (e, e, e, e, f32, f32, e, e) + (_I64,) * 33 + (_F64,) + mods + PACKED_SIG
    return {
        "attn_forward": (e, e, e, o, f32) + (_I64,) * 21 + (_F64,) + mods + PACKED_SIG,
        "attn_backward_preprocess": (e, e, f32) + (_I64,) * 11,
        "attn_backward_dkdv": dkdv,
        "attn_backward_dkdvq": dkdv,  # (its dQ accumulator where ALiBi's slopes go)
        "attn_backward_dq_convert": (f32, e) + (_I64,) * 11 + (_F64,),
        "attn_backward_dq": ((e, e, e, e, f32, f32, e) + (_I64,) * 28 + (_F64,) + mods
                             + PACKED_SIG),
        "attn_merge_splits": (f32, f32, e, f32) + (_I64,) * 8,
        "cache_append": (e, e, e, e, _I32P, _I32P, _I32P) + (_I64,) * 25,
        "tile_classify": (cls,) + (_I64,) * 7 + margs + (_I32P, _I32P),
    }[kernel]


def no_slopes(buffer):
    """The slopes argument of a call without ALiBi: a float32 buffer of the call (its
    variants never read it) with zero strides. The simulator copies each array argument
    back after the launch, so there it is a buffer of its own, not one the kernel writes."""
    if SIMULATOR:
        return np.zeros(1, np.float32), (0, 0)
    return buffer, (0, 0)


def no_mod_args(buffer):
    """The mod_args arguments of a call without them (:func:`no_slopes`'s buffer)."""
    return (no_slopes(buffer)[0],) * MAX_ARGS + (0,) * (MAX_ARGS * MAX_DIMS)


def no_packed(buffer, batch=0):
    """The packed-rows arguments of a dense call (never read; but ``nseq``, the batch, by a
    persistent kernel)."""
    h = no_slopes(buffer)[0]
    return (h, h, h, h, 0, 1, 0, 0, 0, 0, 0, batch)


def packed_args(cu_q=None, cu_k=None, seqk=None, table=None, tsb=0, page=1, psp=0,
                total_q=0, chunk=0, oss=0, lss=0, nseq=0, buffer=None):
    """The packed-rows arguments (:data:`PACKED_SIG`) of a varlen or KV-cache call: int32
    handles (``buffer``'s, never read, where a layout has none), the block table's batch
    stride, the page size and the page stride (paged), the packed query rows (varlen),
    split-KV's keys per split and the partials' split strides, and the number of
    sequences (varlen)."""
    h = no_slopes(buffer)[0]
    return (h if cu_q is None else cu_q, h if cu_k is None else cu_k,
            h if seqk is None else seqk, h if table is None else table, tsb, page, psp,
            total_q, chunk, oss, lss, nseq)


def no_classes(buffer):
    """The tile-classes arguments of a call without a mask_mod (never read)."""
    return (no_slopes(buffer)[0], 0, 0, 0)


def mod_args(views) -> tuple:
    """The mod_args arguments of a call from ``views``, a ``(handle, shape)`` per C-
    contiguous array: MAX_ARGS handles (the first again past them), then each array's
    extents padded with 1 to MAX_DIMS (and 1s past the arrays)."""
    handles = [h for h, _ in views]
    handles += [handles[0]] * (MAX_ARGS - len(handles))
    ext = []
    for _, shape in views:
        ext += list(shape) + [1] * (MAX_DIMS - len(shape))
    ext += [1] * (MAX_ARGS * MAX_DIMS - len(ext))
    return (*handles, *ext)


def bhnd(strides, layout):
    """Strides of a (B, H, N, D) or (B, N, H, D) array, in (B, H, N, D) order."""
    s0, s1, s2, s3 = strides
    return (s0, s1, s2, s3) if layout == "bhnd" else (s0, s2, s1, s3)


def host_flat(x: np.ndarray):
    """A flat NumPy view over the memory of ``x`` (simulator launches index it like a
    pointer) and ``x``'s strides in elements; bf16 is viewed as its uint16 bits."""
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    item = x.itemsize
    if any(s < 0 for s in x.strides) or any(s % item for s in x.strides):
        x = np.ascontiguousarray(x)
    strides = tuple(s // item for s in x.strides)
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, strides)) if x.size else 0
    flat = np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(item,))
    return flat, strides


# --- the launches ---------------------------------------------------------------------------


def _grid(bm, case, keys=False):
    """``(tiles, batch x heads)`` of a launch over the call's query rows (or its key rows,
    by the key heads, where ``keys``) in tiles of ``bm``. Varlen: every sequence's tiles on
    the first axis (``device/seams.packed_tile`` finds a tile's sequence), ``total // bm +
    batch`` of them (at least their number, with no block past a sequence's end but for at
    most ``batch``), by heads."""
    heads = case.heads_kv if keys else case.heads_q
    if case.varlen is None:
        rows = case.seqlen_k if keys else case.seqlen_q
        return (rows + bm - 1) // bm, case.batch * heads
    total = case.varlen.total_k if keys else case.varlen.total_q
    return total // bm + case.batch, heads


def launch_forward(kern, bm, case, stream, q, k, v, o, lse, slopes, margs,
                   classes, packed=None, splits=1, ctas=0):
    """One forward launch of ``kern`` (``bm`` query rows per block; the SIMT and the
    tensor-core forwards take the same arguments). q, k, v, o are (handle, strides4) pairs;
    lse is a handle of a contiguous float32 (B, Hq, Nq) buffer; slopes a (handle, (batch
    stride, head stride)) pair (:func:`no_slopes` without ALiBi); margs the MAX_ARGS
    pointers and MAX_ARGS * MAX_DIMS extents of the mod_args (:func:`no_mod_args`);
    classes the mask_mod's tile classes, ``(handle, batch stride, head stride, query-block
    stride)`` (:func:`no_classes`); packed the packed-rows arguments (:func:`packed_args`;
    None for a dense batch); ``splits`` key ranges per (query tile, head), on grid z.
    ``ctas``: a persistent kernel's blocks (a dense batch: they walk the grid's tiles, and
    take the batch as ``nseq``), 0 for one block per tile."""
    grid = _grid(bm, case)
    if ctas:  # (the tensor maps kept where a producer of bulk copies reads them)
        grid = (min(ctas, grid[0] * grid[1]), 1)
        packed = (*(packed or no_packed(lse))[:-1], case.batch)
    kern((*grid, splits), stream,
         (q[0], k[0], v[0], o[0], lse, case.seqlen_q, case.seqlen_k, case.heads_q,
          case.heads_q // case.heads_kv, case.seqlen_k - case.seqlen_q, *q[1], *k[1], *v[1],
          *o[1], float(case.scale), slopes[0], *slopes[1], *margs, *classes,
          *(packed or no_packed(lse))))


def launch_preprocess(pre, rows, case, stream, o, do, delta):
    """The backward's preprocess ``delta = rowsum(dO ∘ O)`` (``rows`` per block,
    tilings.RowTiles) over the call's rows: (B, Hq, Nq), or for varlen the packed rows as
    one batch entry; by 16-byte loads where the head dim fills them and both arrays' rows
    are contiguous and 16-byte aligned (:func:`rows_aligned`)."""
    B, Nq, Hq = case.batch, case.seqlen_q, case.heads_q
    if case.varlen is not None:
        B, Nq = 1, case.varlen.total_q
    elems = _VECTOR[case.dtype]
    sizes = (B, Hq, Nq)
    vec = (case.head_dim % elems == 0 and rows_aligned(o, sizes, elems)
           and rows_aligned(do, sizes, elems))
    pre(((Nq + rows - 1) // rows, B * Hq), stream,
        (o[0], do[0], delta, Nq, Hq, *o[1], *do[1], int(vec)))


def rows_aligned(view, sizes, elems=4) -> bool:
    """Whether every row of a (handle, strides) view of a (B, H, N, D) array (``sizes``: B,
    H, N) is contiguous and starts 16 bytes aligned, ``elems`` elements making 16 bytes
    (strides of dims of size 1 never move an address)."""
    handle, (sb, sh, sn, sd) = view
    nb, nh, nn = sizes
    # (written out, not looped: it runs for every fp32 and tensor-core launch)
    return (sd == 1 and (nb < 2 or sb % elems == 0) and (nh < 2 or sh % elems == 0)
            and (nn < 2 or sn % elems == 0) and (SIMULATOR or int(handle) % 16 == 0))


def launch_dkdv(kern, bm, case, stream, q, k, v, do, lse, delta, dk, dv, slopes, margs,
                classes, packed=None, passes=1):
    """One dK/dV launch (``bm`` keys per block; ``passes`` blocks per key tile on grid z,
    each making its share of dK's and dV's columns: tilings.dkdv_passes); lse has three
    strides, delta is a handle."""
    Hq, Hkv, Nq, Nk = case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k
    kern((*_grid(bm, case, keys=True), passes), stream,
         (q[0], k[0], v[0], do[0], lse[0], delta, dk[0], dv[0], Nq, Nk, Hq, Hkv, Hq // Hkv,
          Nk - Nq, *q[1], *k[1], *v[1], *do[1], *dk[1], *dv[1], *lse[1], float(case.scale),
          slopes[0], *slopes[1], *margs, *classes, *(packed or no_packed(delta))))


def launch_dq(kern, bm, case, stream, q, k, v, do, lse, delta, dq, slopes, margs,
              classes, packed=None):
    """One dQ launch (``bm`` queries per block)."""
    Hq, Hkv, Nq, Nk = case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k
    kern(_grid(bm, case), stream,
         (q[0], k[0], v[0], do[0], lse[0], delta, dq[0], Nq, Nk, Hq, Hq // Hkv, Nk - Nq,
          *q[1], *k[1], *v[1], *do[1], *dq[1], *lse[1], float(case.scale), slopes[0],
          *slopes[1], *margs, *classes, *(packed or no_packed(delta))))
