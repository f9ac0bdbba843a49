"""``device/pipeline.py``'s barriers for the CUDA simulator, with the hardware's semantics
(PTX ISA: "Parallel Synchronization and Communication Instructions: mbarrier", ``bar``).

The simulator runs every thread of a block as a Python thread (``BlockThread``) and the
blocks one after another; their state lives here, per block (keyed by the block's
``BlockManager``), guarded by one ``threading.Condition``:

- an mbarrier, by the byte address of its 8 bytes in the block's shared memory: the
  current phase, the arrivals still pending in it and the count each phase expects.
  ``count`` arrivals complete the phase (the next starts with ``count`` pending again); a
  parity wait passes once the phase of that parity has completed, that is while the
  current phase's parity differs (a waiter that fell two phases behind waits forever, as
  on the GPU). ``cp.async.mbarrier.arrive.noinc`` arrives at once (``cp_async16`` copies
  synchronously here) and counts against ``count`` (``noinc``), as a plain arrive. The
  barrier's 8 bytes of shared memory hold a signature of its state, checked at every
  use: a copy that overwrites a barrier fails here too.
- a named barrier, by its id (1..15; 0 is ``syncthreads``): ``count`` threads taking part,
  ``bar.arrive`` counting without waiting, ``bar.sync`` counting and waiting for the
  generation it joined to complete.

A wait that can never complete fails instead of hanging: once nothing has arrived on any of
the block's barriers for :data:`STALL_S` seconds while every live thread of the block waits
(here, on a wait that still cannot pass, or in ``syncthreads``), the waiters raise
``RuntimeError("deadlock ...")`` with what each group of threads waits for; any wait longer
than :data:`TIMEOUT_S` (environment ``FLASHCORE_SIM_BARRIER_TIMEOUT``) raises
``TimeoutError``.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter

import numpy as np

#: Seconds without any arrival, every live thread of the block waiting, that make a deadlock.
STALL_S = 1.0
#: Seconds any one wait may take.
TIMEOUT_S = float(os.environ.get("FLASHCORE_SIM_BARRIER_TIMEOUT", "600"))
_POLL_S = 1.0
_MAGIC = 0xB4B4

_cond = threading.Condition()
_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Block:
    """The barriers of one simulated block."""

    def __init__(self):
        self.mbarriers: dict = {}
        self.named: dict = {}
        self.progress = time.monotonic()  # the last arrival or init


class _MBarrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0
        self.tx = 0  # bytes of bulk copies the phase still waits for

    def settle(self):
        """Complete the phase if its arrivals are in and its bytes landed (True then)."""
        if self.pending or self.tx:
            return False
        self.phase += 1
        self.pending = self.count
        return True

    def signature(self):
        return np.array([_MAGIC, self.phase & 0xFFFF, self.pending & 0xFFFF,
                         self.count & 0xFFFF], np.uint16)


class _Named:
    def __init__(self):
        self.count, self.arrived, self.generation = 0, 0, 0


def _me():
    from numba.cuda.simulator.kernel import BlockThread

    me = threading.current_thread()
    if not isinstance(me, BlockThread):
        raise TypeError("barriers run only inside a simulated kernel thread")
    return me


def _block(me) -> _Block:
    blk = _blocks.get(me._manager)
    if blk is None:
        blk = _blocks[me._manager] = _Block()
    return blk


def _where(me):
    return f"block {tuple(me.blockIdx)}, thread {me.thread_id}"


def _bytes(smem, idx):
    """The barrier's 8 bytes (as 4 uint16) and its byte address."""
    off = int(idx) * smem.itemsize
    addr = smem.__array_interface__["data"][0] + off
    if addr % 8:
        raise RuntimeError(f"mbarrier at shared element {int(idx)}: not 8-byte aligned")
    return smem.view(np.uint8)[off:off + 8].view(np.uint16), addr


def _mbarrier(me, smem, idx):
    """The initialized mbarrier at ``smem[idx]`` (its bytes checked), and its bytes."""
    words, addr = _bytes(smem, idx)
    bar = _block(me).mbarriers.get(addr)
    if bar is None:
        raise RuntimeError(f"{_where(me)}: mbarrier at shared element {int(idx)} used before "
                           "mbarrier.init")
    if not np.array_equal(words, bar.signature()):
        raise RuntimeError(f"{_where(me)}: the 8 bytes of the mbarrier at shared element "
                           f"{int(idx)} were overwritten")
    return bar, words


def _await(me, blk, ready, what):
    """Wait (holding ``_cond``) until ``ready()``; fail on a deadlock or the timeout
    (``what()`` says what the wait is for)."""
    start = time.monotonic()
    me._flashcore_wait = (ready, what)
    try:
        while not ready():
            _cond.wait(_POLL_S)
            if me.abort:
                raise RuntimeError("another simulated thread failed")
            if ready():
                break
            now = time.monotonic()
            if now - blk.progress > STALL_S:
                stuck = _stuck(me)
                if stuck is not None:
                    raise RuntimeError(f"deadlock in block {tuple(me.blockIdx)}: no thread "
                                       f"can go on (this one: {what()}); {stuck}")
            if now - start > TIMEOUT_S:
                raise TimeoutError(f"{_where(me)}: {what()} did not pass in {TIMEOUT_S:.0f} s")
    finally:
        me._flashcore_wait = None


def _stuck(me):
    """If every live thread of ``me``'s block waits on something that cannot pass (a
    barrier wait here or ``syncthreads``): what they wait for; else None."""
    from numba.cuda.simulator.kernel import BlockThread

    waits = Counter()
    for t in threading.enumerate():
        if not isinstance(t, BlockThread) or t._manager is not me._manager:
            continue
        if t.syncthreads_blocked:
            waits["syncthreads"] += 1
            continue
        w = getattr(t, "_flashcore_wait", None)
        if w is None or w[0]():
            return None  # running, or about to
        waits[w[1]()] += 1
    return "; ".join(f"{n} thread(s) on {w}" for w, n in waits.most_common(8))


def _progress(blk, done):
    """An arrival (``done``: one that completed a phase or generation: wake the waiters)."""
    blk.progress = time.monotonic()
    if done:
        _cond.notify_all()


def mbarrier_init(smem, idx, count):
    """``mbarrier.init``: phase 0, ``count`` arrivals pending (1 .. 2^20 - 1)."""
    me = _me()
    count = int(count)
    if not 0 < count < 1 << 20:
        raise ValueError(f"mbarrier.init: count {count} out of range")
    with _cond:
        words, addr = _bytes(smem, idx)
        blk = _block(me)
        bar = blk.mbarriers[addr] = _MBarrier(count)
        words[:] = bar.signature()
        _progress(blk, True)


def mbarrier_arrive(smem, idx):
    """One arrival: the phase completes with its ``count``-th."""
    me = _me()
    with _cond:
        bar, words = _mbarrier(me, smem, idx)
        bar.pending -= 1
        if bar.pending < 0:
            raise RuntimeError(f"{_where(me)}: more arrivals than the mbarrier at shared "
                               f"element {int(idx)} expects ({bar.count})")
        done = bar.settle()
        words[:] = bar.signature()
        _progress(_block(me), done)


def mbarrier_expect_tx(smem, idx, nbytes):
    """``mbarrier.arrive.expect_tx``: ``nbytes`` more bytes the phase waits for, then one
    arrival."""
    me = _me()
    with _cond:
        bar, _ = _mbarrier(me, smem, idx)
        bar.tx += int(nbytes)
    mbarrier_arrive(smem, idx)


def _complete_tx(smem, idx, nbytes):
    """A bulk copy's ``complete_tx``: ``nbytes`` landed."""
    me = _me()
    with _cond:
        bar, words = _mbarrier(me, smem, idx)
        bar.tx -= int(nbytes)
        done = bar.settle()
        words[:] = bar.signature()
        _progress(_block(me), done)


# --- bulk tensor copies: the simulator's "tensor map" is the copy's geometry in 16 int64
# words, [D, N, H, B, row stride, head stride, batch stride (elements), box columns, box
# rows, source, 0...] (tensor_maps.put writes them; source: the key of the host
# array the map describes, as a map holds its tensor's address: a copy through the wrong
# map reads the wrong tensor here too); the copy is made at once, in the 128-byte swizzle,
# rows past N zero

#: int64 words of one simulated tensor map.
SIM_MAP_WORDS = 16
#: The host arrays simulated maps read, by key (the latest few launches' maps).
_sources: dict = {}
_next_source = [0]


def sim_tensor_map(flat, dims, strides, box) -> np.ndarray:
    """The simulator's tensor map of the flat host array ``flat`` seen as (B, H, N, D) with
    element ``strides`` (batch, head, row; unit along D), ``dims`` (D, N, H, B), ``box``
    (columns, rows)."""
    with _cond:
        key = _next_source[0] = _next_source[0] + 1
        _sources[key] = flat
        for old in [k for k in _sources if k < key - 64]:
            del _sources[old]
    m = np.zeros(SIM_MAP_WORDS, np.int64)
    m[:4] = dims
    m[4:7] = strides
    m[7:9] = box
    m[9] = key
    return m


def fence_tensormap(maps, which):
    """Nothing to order here; the map is checked."""
    m = maps[SIM_MAP_WORDS * int(which):SIM_MAP_WORDS * (int(which) + 1)]
    if m[7] * 2 != 128 or m[0] <= 0:
        raise ValueError(f"tensor map {int(which)}: not a 128-byte-swizzled box: {m}")


def tma_load_4d(smem, sidx, maps, which, src, c0, c1, c2, c3, bar):
    """The box of map ``which`` at (c0, c1, c2, c3) into ``smem[sidx:]`` in the 128-byte
    swizzle (16-byte chunk ``c`` of line ``r`` at chunk ``c ^ (r % 8)``, lines counted from
    a 1024-byte boundary: the destination must start on one, the shared memory counted
    from address 0 as tests/wgmma_emulator.py's), rows at or past N zero; then its bytes
    complete on ``bar``. ``src`` (the kernel's own pointer) is not read: the map says which
    tensor, so a copy through the wrong map reads the wrong one, as on the GPU."""
    w = int(which)
    D, N, H, B, sn, sh, sb, bc, br, key = (int(x) for x in
                                           maps[SIM_MAP_WORDS * w:SIM_MAP_WORDS * w + 10])
    src = _sources[key]  # (the map's tensor, not the kernel's argument)
    sidx, c0, c1, c2, c3 = int(sidx), int(c0), int(c1), int(c2), int(c3)
    if bc * smem.itemsize != 128:
        raise ValueError(f"tensor map {w}: boxes of {bc} columns (128-byte swizzle)")
    if sidx * smem.itemsize % 1024:  # (shared memory starts at address 0 here)
        raise RuntimeError(f"bulk tensor copy to shared element {sidx}: not 1024-byte "
                           "aligned (the 128-byte swizzle's period)")
    if not (0 <= c0 and c0 + bc <= D and 0 <= c2 < H and 0 <= c3 < B):
        raise IndexError(f"bulk tensor copy at ({c0}, {c1}, {c2}, {c3}) outside ({D}, {N}, "
                         f"{H}, {B})")
    lines = smem[sidx:sidx + br * bc].reshape(br, 8, bc // 8)
    for r in range(br):
        n = c1 + r
        row = (src[c3 * sb + c2 * sh + n * sn + c0:][:bc].view(smem.dtype)
               if 0 <= n < N else np.zeros(bc, smem.dtype))
        for c in range(8):
            lines[r, c ^ (r % 8)] = row[8 * c:8 * c + 8]
    _complete_tx(smem, bar, br * bc * smem.itemsize)


def cp_async_arrive(smem, idx):
    """``cp.async.mbarrier.arrive.noinc``: the copies have landed (the simulator's are
    synchronous), so one arrival now, counted against the init count."""
    mbarrier_arrive(smem, idx)


def mbarrier_wait(smem, idx, parity):
    """``mbarrier.try_wait.parity`` until it passes: the phase of parity ``parity`` has
    completed (the current phase's parity is the other)."""
    me = _me()
    parity = int(parity)
    if parity not in (0, 1):
        raise ValueError(f"mbarrier wait: parity {parity}")
    with _cond:
        bar, _ = _mbarrier(me, smem, idx)
        _await(me, _block(me), lambda: (bar.phase & 1) != parity,
               lambda: f"mbarrier at shared element {int(idx)} parity {parity} "
                       f"(phase {bar.phase}, {bar.pending} of {bar.count} pending)")


def _named(id_, count, wait):
    me = _me()
    id_, count = int(id_), int(count)
    if not 0 < id_ < 16:
        raise ValueError(f"named barrier {id_}: 1..15 (0 is syncthreads)")
    if count <= 0 or count % 32:
        raise ValueError(f"named barrier {id_}: {count} threads, not a multiple of 32")
    with _cond:
        blk = _block(me)
        bar = blk.named.get(id_)
        if bar is None:
            bar = blk.named[id_] = _Named()
        if bar.arrived == 0:
            bar.count = count
        elif bar.count != count:
            raise RuntimeError(f"{_where(me)}: named barrier {id_} with {count} threads while "
                               f"{bar.arrived} arrived expecting {bar.count}")
        bar.arrived += 1
        gen = bar.generation
        done = bar.arrived == count
        if done:
            bar.arrived = 0
            bar.generation += 1
        _progress(blk, done)
        if wait:
            _await(me, blk, lambda: bar.generation != gen,
                   lambda: f"bar.sync {id_}, {count} ({bar.arrived} arrived)")


def named_sync(id_, count):
    """``bar.sync id, count``: count this thread and wait until ``count`` have arrived."""
    _named(id_, count, True)


def named_arrive(id_, count):
    """``bar.arrive id, count``: count this thread without waiting."""
    _named(id_, count, False)


def _check_regs(n):
    n = int(n)
    if n % 8 or not 24 <= n <= 256:
        raise ValueError(f"setmaxnreg: {n} registers (a multiple of 8 in 24..256)")


def setmaxnreg_inc(n):
    """A no-op here (the simulator has no register file); ``n`` checked."""
    _check_regs(n)


def setmaxnreg_dec(n):
    """A no-op here (the simulator has no register file); ``n`` checked."""
    _check_regs(n)


# --- bulk reductions: no copy engine here; made at once (under a lock: other blocks add
# into the same elements), and the waits have nothing to wait for

_red_lock = threading.Lock()
#: Words of the simulated maps array before its scheduling counters (three maps).
SIM_COUNTERS = 3 * SIM_MAP_WORDS


def counter_add(maps, n, value):
    """The launch's scheduling counter ``n`` (after the three maps) increased by ``value``,
    atomically; its old value."""
    i = SIM_COUNTERS + int(n)
    with _red_lock:
        old = int(maps[i])
        maps[i] = old + int(value)
    return np.uint32(old)


#: (the simulator's lock already orders every counter operation)
counter_add_acq_rel = counter_add


def counter_store(maps, n, value):
    with _red_lock:
        maps[SIM_COUNTERS + int(n)] = int(value)


def ld_shared_u32(smem, idx):
    i = int(idx)
    return np.array(smem[i:i + 2]).view(np.uint32)[0]


def _st_shared(dtype):
    def st_shared(smem, idx, value):
        i = int(idx)
        smem[i:i + 2] = np.array([value], dtype).view(np.uint16)

    return st_shared


st_shared_f32 = _st_shared(np.float32)
st_shared_u32 = _st_shared(np.uint32)


def ld_shared_f32(smem, idx):
    i = int(idx)
    return np.array(smem[i:i + 2]).view(np.float32)[0]


def bulk_reduce_add_f32(dst, didx, smem, sidx, nbytes):
    n, s, d = int(nbytes) // 4, int(sidx), int(didx)
    assert int(nbytes) % 16 == 0 and s % 8 == 0, "bulk copies move aligned 16-byte units"
    src = np.array(smem[s:s + 2 * n]).view(np.float32)
    with _red_lock:
        dst[d:d + n] += src


def bulk_commit():
    pass


def bulk_wait_read(n):
    pass


def bulk_wait(n):
    pass
