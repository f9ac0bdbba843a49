"""Tensor maps of the bulk tensor copies (``HopperTiles.tma``): Q, K and V of a dense
launch as 4-D tensors (D, N, H, B) (innermost first; row, head and batch strides in bytes,
unit stride along D; varlen rows as (D, total, H, 1)), boxes of 64 columns (128 bytes: the 128-byte swizzle, the layout of
``device/wgmma``'s tiles) and ``block_n`` rows, rows past N zero-filled. The driver encodes
each (``cuTensorMapEncodeTiled``; the encoded bytes are kept per arrays, :data:`MAX_KEPT`
sets, so a call on the same arrays encodes nothing). The strides are multiples of 16 bytes
wherever the tensor-core kernels serve (``launch.rows_aligned``), as the driver requires.

The kernel reads the three 128-byte maps from global memory, through the block-table
argument (which the wgmma kernels do not otherwise read), from a slot of a ring of
:data:`SLOTS` per device (:class:`_Ring`): a call on the arrays of an earlier call on the
same stream reads the slot that call's maps were copied to; other calls take the next
slot, whose maps are written into its pinned host buffer and copied to its device buffer
on the launch's stream (``cuMemcpyHtoDAsync``, ordered before the kernel). An event
recorded after each launch marks its slot in use; a slot is written again only once that
event has completed (a host wait that a ring of 1024 slots never makes in practice: the
driver's queue of launches is shorter). Nothing is allocated or synchronized per call, but
a call pays 20-35 µs more host time (75 µs with new arrays: encoding three maps takes
23 µs; before the slots were reused), hence ``tilings.TMA_MIN_WORK``. A by-value
kernel parameter (FlashAttention 3's ``__grid_constant__``) cut that to 10 µs but its
kernel ran 30% slower (notes/tma_2026-11-26.md). The simulator takes
``device/sim_pipeline.sim_tensor_map``'s description instead.
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from .device.convert import SIMULATOR
from .device.pipeline import COUNTERS_OFFSET

#: CUtensorMapDataType of the 16-bit dtypes; CUtensorMapSwizzle 128B; L2 promotion 256B.
_DTYPE = {"float16": 6, "bfloat16": 9}
_SWIZZLE_128B = 3
_L2_256B = 3
#: Columns of one box: 128 bytes of 16-bit elements (the 128-byte swizzle's width).
BOX_COLUMNS = 64
#: Sets of encoded maps kept (host bytes, per arrays).
MAX_KEPT = 256
#: Slots of each device's ring (3 maps, 384 bytes, and 128 bytes of the persistent
#: forward's scheduling counters, zero when copied: ``device/pipeline.counter_add``; the
#: kernel that counts on them sets them to zero again before it ends).
SLOTS = 1024
_MAPS = COUNTERS_OFFSET  # (the three maps, before the counters the kernel reads)
_SET = _MAPS + 128
#: CUevent flag: no timing (cheaper to record).
_EVENT_DISABLE_TIMING = 2
#: CU_STREAM_PER_THREAD: one handle for every thread's own default stream.
_PER_THREAD = 2

_kept: OrderedDict = OrderedDict()  # (dtype, block_n, geometry) -> 384 bytes
_rings: dict = {}
_rings_lock = threading.Lock()
_kept_lock = threading.Lock()


def _lib():
    from .driver import _LIBCUDA, _libcuda

    return _LIBCUDA or _libcuda()


def _geometry(view, dims):
    """(address, dims (D, N, H, B), byte strides (row, head, batch)) of a (handle, strides)
    view of a (B, H, N, D) array with ``dims`` (B, H, N, D); a dim of extent 1 takes the
    stride of the dims inside it (never stepped; the driver wants multiples of 16)."""
    handle, (sb, sh, sn, _) = view
    B, H, N, D = dims
    row = 2 * sn if N > 1 else 2 * D
    head = 2 * sh if H > 1 else row * N
    batch = 2 * sb if B > 1 else head * H
    return int(handle), (D, N, H, B), (row, head, batch)


def _encode_map(out, dtype, address, dims, strides, rows):
    gd = (ctypes.c_uint64 * 4)(*dims)
    gs = (ctypes.c_uint64 * 3)(*strides)
    box = (ctypes.c_uint32 * 4)(BOX_COLUMNS, rows, 1, 1)
    es = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    err = _lib().cuTensorMapEncodeTiled(out, _DTYPE[dtype], 4, address, gd, gs, box, es, 0,
                                        _SWIZZLE_128B, _L2_256B, 0)
    if err:
        from .driver import error_text

        raise RuntimeError(f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, "
                           f"box=({BOX_COLUMNS}, {rows})) failed: {error_text(err)}")


def serves(case, q, k, v) -> bool:
    """Whether views ``q``, ``k``, ``v`` can be tensor maps: every stride of a dim of more
    than one element positive (a broadcast view, ``expand``, has zeros, which the driver
    refuses). (Multiples of 16 bytes they are wherever the tensor-core kernels serve.)"""
    for (_, (sb, sh, sn, _)), (B, H, N, _) in _views(case, q, k, v):
        if (B > 1 and sb <= 0) or (H > 1 and sh <= 0) or (N > 1 and sn <= 0):
            return False
    return True


def _views(case, q, k, v):
    """Q's, K's and V's views with their (B, H, N, D) sizes: a dense batch's, or varlen rows
    as one batch entry of every packed row (the kernel finds a sequence's first row from
    the offsets: ``hopper/pingpong.map_origin``)."""
    D, vl = case.head_dim, case.varlen
    if vl is None:
        B, nq, nk = case.batch, case.seqlen_q, case.seqlen_k
    else:
        B, nq, nk = 1, vl.total_q, vl.total_k
    return ((q, (B, case.heads_q, nq, D)), (k, (B, case.heads_kv, nk, D)),
            (v, (B, case.heads_kv, nk, D)))


def _check(err, what):
    if err:
        from .driver import error_text

        raise RuntimeError(f"{what} failed: {error_text(err)}")


class _Ring:
    """One device's slots: a pinned host buffer and a device buffer of :data:`SLOTS` sets,
    per slot the event recorded after the launch that last read it, the stream whose copy
    wrote it and the bytes it holds. A call whose maps a slot already holds, written on its
    own stream, reads that slot again: no copy, no wait (the same arrays call after call,
    as in a training loop or a benchmark: the stream's order puts the copy before both
    launches). Otherwise the next slot of the ring is written once the launch that last
    read it is done (a host wait that a ring of 1024 slots never makes in practice: the
    driver's queue of launches is shorter); a slot handed to a call whose launch is not
    yet queued (between :meth:`put` and :meth:`used`, on another thread) is skipped.
    ``lib``: libcuda (driver._libcuda's types); ``ctx``: the device's primary context,
    made current around the driver calls where another is."""

    def __init__(self, lib, ctx, dev, host):
        self.lib, self.ctx, self.dev, self.host = lib, ctx, dev, host
        self.lock = threading.Lock()
        self.events = [None] * SLOTS
        self.writer = [None] * SLOTS  # the stream whose copy wrote the slot
        self.held = [None] * SLOTS  # the bytes the slot holds
        self.slot_of: dict = {}  # bytes -> the slot holding them
        # calls given the slot whose launch is not yet queued (put, then used): another
        # thread's call must not rewrite it in between
        self.pending = [0] * SLOTS
        self.next = 0
        self._cur = ctypes.c_void_p()
        self._cur_ref = ctypes.byref(self._cur)

    @classmethod
    def on(cls, device) -> "_Ring":
        """The ring of GPU ``device``, its buffers allocated (256-byte aligned: slots are
        64)."""
        from .driver import _primary_context

        lib, ctx = _lib(), _primary_context(device)
        ring = cls(lib, ctx, 0, 0)
        dev, host = ctypes.c_uint64(), ctypes.c_void_p()
        pushed = ring._enter()
        try:
            _check(lib.cuMemAlloc_v2(ctypes.byref(dev), SLOTS * _SET), "cuMemAlloc")
            _check(lib.cuMemHostAlloc(ctypes.byref(host), SLOTS * _SET, 0), "cuMemHostAlloc")
        finally:
            ring._exit(pushed)
        ring.dev, ring.host = dev.value, host.value
        return ring

    def _enter(self) -> bool:
        """The ring's context made current (True: pushed, for :meth:`_exit`)."""
        self.lib.cuCtxGetCurrent(self._cur_ref)
        if self._cur.value == self.ctx:
            return False
        _check(self.lib.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
        return True

    def _exit(self, pushed):
        if pushed:
            self.lib.cuCtxPopCurrent_v2(self._cur_ref)

    def put(self, data: bytes, stream) -> tuple:
        """The device address of a slot holding ``data`` (copied on ``stream`` unless a slot
        written on it holds them already), and the slot (:meth:`used` after the launch)."""
        lib = self.lib
        # the stream the copy is ordered on (a handle that names each thread's own stream,
        # CU_STREAM_PER_THREAD, is a stream per thread)
        who = (stream, threading.get_ident()) if stream == _PER_THREAD else stream
        with self.lock:
            i = self.slot_of.get(data)
            if i is not None and self.writer[i] == who:
                self.pending[i] += 1
                return self.dev + i * _SET, i
            i = self.next
            for _ in range(SLOTS):  # (handed out, its launch not yet queued: skipped)
                if not self.pending[i]:
                    break
                i = (i + 1) % SLOTS
            else:
                raise RuntimeError(f"every one of the {SLOTS} tensor-map slots is held by a "
                                   "call whose launch is not queued yet")
            self.next = (i + 1) % SLOTS
            pushed = self._enter()
            try:
                ev = self.events[i]
                if ev is not None:  # (the launch that last read slot i is done)
                    _check(lib.cuEventSynchronize(ev), "cuEventSynchronize")
                old = self.held[i]
                if old is not None and self.slot_of.get(old) == i:
                    del self.slot_of[old]
                self.held[i] = self.writer[i] = None  # (until the copy is queued)
                ctypes.memmove(self.host + i * _SET, data, _SET)
                _check(lib.cuMemcpyHtoDAsync_v2(self.dev + i * _SET, self.host + i * _SET,
                                                _SET, stream), "cuMemcpyHtoDAsync")
            finally:
                self._exit(pushed)
            self.held[i], self.writer[i] = data, who
            self.slot_of[data] = i
            self.pending[i] += 1
        return self.dev + i * _SET, i

    def used(self, i, stream):
        """Slot ``i`` is read by the launch just queued on ``stream`` (or that failed)."""
        lib = self.lib
        with self.lock:
            pushed = self._enter()
            try:
                ev = self.events[i]
                if ev is None:
                    e = ctypes.c_void_p()
                    _check(lib.cuEventCreate(ctypes.byref(e), _EVENT_DISABLE_TIMING),
                           "cuEventCreate")
                    ev = self.events[i] = e.value
                _check(lib.cuEventRecord(ev, stream), "cuEventRecord")
                # (only once the event marks the launch: a failed record leaves the slot
                # held, never rewritten under a launch that may still read it)
                self.pending[i] -= 1
            finally:
                self._exit(pushed)


def _ring(device, values=False) -> _Ring:
    """GPU ``device``'s ring of tensor maps, or (``values``) of :func:`put_values`' values:
    one of their own, so a decode loop's slot per step never wraps onto the slot a
    training loop's maps are read again from (whose event may be of its latest launch)."""
    key = (device, "values") if values else device
    ring = _rings.get(key)
    if ring is None:
        with _rings_lock:
            ring = _rings.get(key)
            if ring is None:
                ring = _rings[key] = _Ring.on(device)
    return ring


def _encoded(case, q, k, v, block_n) -> bytes:
    """The three maps' bytes, kept per arrays: the key is the views with their sizes
    (:func:`_views`), so a kept set costs no geometry (the same bytes object comes back,
    whose hash Python keeps: the ring finds its slot by it)."""
    views = _views(case, q, k, v)
    key = (case.dtype, block_n, views)
    with _kept_lock:
        data = _kept.get(key)
        if data is not None:
            _kept.move_to_end(key)
            return data
    geo = tuple(_geometry(view, dims) for view, dims in views)
    host = (ctypes.c_uint8 * (_SET + 64))()
    at = -ctypes.addressof(host) % 64  # (the struct is 64-byte aligned in C)
    for n, (address, dims, strides) in enumerate(geo):
        _encode_map(ctypes.addressof(host) + at + 128 * n, case.dtype, address, dims,
                    strides, block_n)
    data = bytes(host)[at:at + _MAPS] + bytes(_SET - _MAPS)  # (the counters: zero)
    with _kept_lock:
        _kept[key] = data
        if len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    return data


def put(case, device, stream, q, k, v, block_n):
    """``(handle, slot)``: Q's, K's and V's tensor maps (boxes of ``block_n`` rows) on
    ``device``, ordered on ``stream`` before what is queued there next (:func:`used` after
    the launch); under the simulator an int64 array of simulated maps and None."""
    if SIMULATOR:
        from .device.sim_pipeline import sim_tensor_map

        maps = []
        for view, dims in _views(case, q, k, v):
            flat, (sb, sh, sn, _) = view
            B, H, N, D = dims
            maps.append(sim_tensor_map(flat, (D, N, H, B), (sn, sh, sb),
                                       (BOX_COLUMNS, block_n)))
        return np.concatenate(maps + [np.zeros_like(maps[0])]), None  # (and counters)
    return _ring(device).put(_encoded(case, q, k, v, block_n), stream)


#: Bytes :func:`put_values` takes (a slot's size).
VALUES_BYTES = _SET


def put_values(device, stream, data: bytes) -> tuple:
    """``(address, slot)``: up to :data:`VALUES_BYTES` bytes of small per-call values (a
    KV-cache call's lengths given on the host) in a slot of ``device``'s ring, copied on
    ``stream`` as :func:`put` copies maps (a slot holding the same bytes, written on that
    stream, is read again), in a ring of their own; :func:`used` (``values=True``) after
    the last launch that reads them."""
    return _ring(device, True).put(data.ljust(_SET, b"\0"), stream)


def used(device, stream, slot, values=False):
    """The launch that reads ``slot`` (of :func:`put`; ``values``: of :func:`put_values`)
    is queued on ``stream``."""
    if slot is not None:
        _ring(device, values).used(slot, stream)
