"""wgmma for the CUDA simulator: the Hopper kernels (backends/numba_cuda/hopper/) run end to
end on the host, each warpgroup MMA done in NumPy from what the hardware would read.

The simulator runs every thread of a block as a Python thread but has no form of the wgmma
intrinsics (device/wgmma.py raises NotImplementedError there). :func:`install` replaces
them in the kernels' modules:

- an SS wgmma reads A (64 x 16) and B (N x 16 K-major, or 16 x N MN-major) from the block's
  shared memory at the byte addresses its descriptors give, element by element through the
  PTX ISA's canonical layouts (``test_numba_cuda_wgmma._canonical``: the reading an H100
  confirmed, tools/wgmma_ceiling.py --check), so a wrong start, stride, buffer or k-step in
  a kernel reads the wrong numbers here as it would there;
- an RS wgmma gathers A from the registers of the warpgroup's 128 threads (a barrier of the
  warpgroup: the ``.sync.aligned`` instruction) by ``wgmma.a_coords``;
- each thread gets back its own accumulators (``wgmma.acc_coords``), computed in float32
  from the 16-bit inputs, **when the wait that retires its group comes** (commits group a
  thread's products, and ``wait_group(n)`` retires all but the ``n`` newest groups, in
  order): so a product reads its shared-memory operands as late as the hardware may, and
  a kernel that writes a buffer before the product reading it has retired (an overlapped
  or deferred schedule's race) gets wrong numbers here, as it may on the GPU. Until then
  it hands back a :class:`_Pending` that only another product may take as its
  accumulators: reading one (``acc_to_local``) before its wait is an error. A wait is also
  a barrier of the warpgroup, after its products are computed (the hardware's collective
  products have read what they read before any thread's wait returns, so no thread may
  release a buffer that another thread's product has yet to read); fences are no-ops;
  ``smem_address`` puts the dynamic shared memory at address 0 (aligned: the descriptors'
  base offset 0 holds); ``publish`` is the block's barrier.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

#: (name, emulation) pairs are made by :func:`_emulations`; these modules get them
MODULES = ("flashcore.backends.numba_cuda.hopper.forward",
           "flashcore.backends.numba_cuda.hopper.pingpong",
           "flashcore.backends.numba_cuda.hopper.persistent",
           "flashcore.backends.numba_cuda.hopper.backward",
           "flashcore.backends.numba_cuda.hopper.backward_ws",
           "flashcore.backends.numba_cuda.hopper.dq_atomic")

_cond = threading.Condition()
_slots: dict = {}


def _canonical(*args):
    from test_numba_cuda_wgmma import _canonical as canonical

    return canonical(*args)


def _decode(desc):
    """(start address, LBO, SBO, swizzle mode) of a matrix descriptor."""
    d = int(desc)
    return ((d & 0x3FFF) << 4, ((d >> 16) & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4,
            (d >> 62) & 3)


@functools.lru_cache(maxsize=None)
def _offsets(major, desc, rows, cols):
    """Byte addresses of a ``rows x cols`` operand (K-major: rows = M or N, cols = k;
    MN-major: rows = k, cols = N) read through descriptor ``desc``."""
    start, lbo, sbo, mode = _decode(desc)
    if mode == 0:
        raise AssertionError("the kernels use the 128-byte swizzle only")
    return np.array([[_canonical(major, mode, start, lbo, sbo, i, j) for j in range(cols)]
                     for i in range(rows)], np.int64)


@functools.lru_cache(maxsize=None)
def _acc_index(thread, n):
    from flashcore.backends.numba_cuda.device.wgmma import acc_coords

    rc = np.array(acc_coords(thread, n))
    return rc[:, 0], rc[:, 1]


@functools.lru_cache(maxsize=None)
def _a_index():
    """(rows, ks) of the 8 halves of each thread's A registers, shape (128, 8)."""
    from flashcore.backends.numba_cuda.device.wgmma import a_coords

    rc = np.array([a_coords(t) for t in range(128)])
    return rc[..., 0], rc[..., 1]


def _floats(bits, kind):
    bits = np.asarray(bits, np.uint16)
    if kind == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def _me():
    from numba.cuda.simulator.kernel import BlockThread

    me = threading.current_thread()
    if not isinstance(me, BlockThread):
        raise TypeError("the wgmma emulation runs only inside a simulated kernel thread")
    return me


def _operand(smem, major, desc, rows, cols, kind):
    return _floats(smem[_offsets(major, int(desc), rows, cols) // 2], kind)


def _operand_b(smem, desc_b, n, trans_b, kind):
    """B (16 x ``n``) of a product: MN-major (``trans_b``) or K-major, transposed."""
    if trans_b:
        return _operand(smem, "mn", desc_b, 16, n, kind)
    return _operand(smem, "k", desc_b, n, 16, kind).T


class _Pending:
    """A product issued and not yet retired by a wait: ``compute()`` reads its operands and
    gives its accumulators, once (:func:`_wait`)."""

    __slots__ = ("compute", "n", "value")

    def __init__(self, compute, n):
        self.compute, self.n, self.value = compute, n, None

    def __len__(self):
        return self.n

    def resolve(self):
        if self.value is None:
            self.value = self.compute()
        return self.value


def _value(acc, what):
    """The accumulators ``acc`` (a :class:`_Pending` must have been retired)."""
    if isinstance(acc, _Pending):
        if acc.value is None:
            raise AssertionError(f"{what}: accumulators read before the wait that retires "
                                 f"their product")
        return acc.value
    return acc


def _issue(me, compute, n):
    """A product of this thread, pending in its open group until a commit."""
    p = _Pending(compute, n)
    if not hasattr(me, "_wgmma_open"):
        me._wgmma_open, me._wgmma_groups = [], []
    me._wgmma_open.append(p)
    return p


def _result(me, acc, full, scale_d):
    rows, cols = _acc_index(me.thread_id % 128, 2 * len(acc))
    out = full[rows, cols].astype(np.float32)
    if scale_d:  # (an earlier product of the chain: retired first, groups retire in order)
        base = acc.resolve() if isinstance(acc, _Pending) else acc
        out = out + np.asarray(base, np.float32)
    return out


def _ss(kind):
    def wgmma_ss(acc, desc_a, desc_b, scale_d, trans_a, trans_b):
        me = _me()
        n = 2 * len(acc)
        smem = me._wgmma_smem

        def compute():  # (at the wait that retires it)
            if trans_a:  # (M-major A: Kᵀ in the dkdvq kernel's dQᵀ = Kᵀ dSᵀ)
                a = _operand(smem, "mn", desc_a, 16, 64, kind).T
            else:
                a = _operand(smem, "k", desc_a, 64, 16, kind)
            return _result(me, acc, a @ _operand_b(smem, desc_b, n, trans_b, kind), scale_d)

        return _issue(me, compute, len(acc))

    return wgmma_ss


def _warpgroup_exchange(me, value):
    """Every thread of the calling warpgroup hands in ``value``; returns the 128 values."""
    seq = getattr(me, "_wgmma_seq", 0)
    me._wgmma_seq = seq + 1
    key = (id(me._manager), tuple(me.blockIdx), me.thread_id // 128, seq)
    with _cond:
        slot = _slots.setdefault(key, [[None] * 128, 0, 0])
        slot[0][me.thread_id % 128] = value
        slot[1] += 1
        if slot[1] == 128:
            _cond.notify_all()
        while slot[1] < 128:
            _cond.wait(timeout=0.5)
            if me.abort:
                raise RuntimeError("another simulated thread failed")
        out = list(slot[0])
        slot[2] += 1
        if slot[2] == 128:
            del _slots[key]
    return out


def _rs(kind):
    def wgmma_rs(acc, a0, a1, a2, a3, desc_b, scale_d, trans_b):
        me = _me()
        n = 2 * len(acc)
        regs = np.array(_warpgroup_exchange(me, (int(a0), int(a1), int(a2), int(a3))),
                        np.uint32)  # (128, 4)
        halves = np.stack([regs & 0xFFFF, regs >> 16], axis=-1).reshape(128, 8)
        rows, ks = _a_index()
        a = np.zeros((64, 16), np.float32)
        a[rows, ks] = _floats(halves, kind)  # (the registers, as issued)
        smem = me._wgmma_smem

        def compute():  # (B at the wait that retires it)
            return _result(me, acc, a @ _operand_b(smem, desc_b, n, trans_b, kind), scale_d)

        return _issue(me, compute, len(acc))

    return wgmma_rs


def smem_address(ptr, idx):
    """The dynamic shared memory at address 0; remembered for the wgmmas of this thread."""
    me = _me()
    me._wgmma_smem = ptr
    return np.uint32(int(idx) * ptr.itemsize)


def zero_accumulators(n):
    return np.zeros(int(n) // 2, np.float32)


def acc_to_local(acc, arr):
    arr[:len(acc)] = _value(acc, "acc_to_local")


def acc_from_local(arr, n):
    return np.array(arr[:int(n) // 2], np.float32)


def _same(acc, *rest):
    return acc


def _commit():
    """``wgmma.commit_group``: this thread's products since the last commit, one group."""
    me = _me()
    if getattr(me, "_wgmma_open", None):
        me._wgmma_groups.append(me._wgmma_open)
        me._wgmma_open = []


def _wait(n, acc):
    """``wgmma.wait_group n`` (with the accumulators it hands back): the groups but the
    ``n`` newest retire, in order, each product reading its shared-memory operands now.
    The simulated threads of a warpgroup do not keep in step, and each computes its own
    products; on the hardware the warpgroup's products read shared memory together and a
    wait returns once they have: so the warpgroup meets here after its products are
    computed, and no thread goes past a wait (to release a stage that a producer then
    overwrites) before every thread of its warpgroup has read what its products read."""
    me = _me()
    groups = getattr(me, "_wgmma_groups", [])
    cut = max(0, len(groups) - int(n))
    for group in groups[:cut]:
        for p in group:
            p.resolve()
    if groups:
        me._wgmma_groups = groups[cut:]
    _warpgroup_exchange(me, None)
    return acc


def _wait_only(n):
    _wait(n, None)


def _nothing(*args):
    return None


def publish():
    """``hopper.forward.publish`` (fence, then the block's barrier) for a kernel of another
    module: the simulator swaps in each thread's view of ``cuda`` for the kernel's own
    module only."""
    _me().syncthreads()


def _emulations():
    return {"publish": publish, "wgmma_ss_bf16": _ss("bf16"), "wgmma_ss_f16": _ss("f16"),
            "wgmma_rs_bf16": _rs("bf16"), "wgmma_rs_f16": _rs("f16"),
            "smem_address": smem_address, "zero_accumulators": zero_accumulators,
            "acc_to_local": acc_to_local, "acc_from_local": acc_from_local,
            "wgmma_fence_acc": _same, "wgmma_wait_group_acc": _wait,
            "wgmma_fence": _nothing, "wgmma_wait_group": _wait_only,
            "wgmma_commit_group": _commit, "fence_proxy_async": _nothing}


def install(monkeypatch):
    """Put the emulations in place of the intrinsics wherever the Hopper kernels look them
    up (their modules' globals: the simulator runs the kernels as Python)."""
    import importlib

    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, fn in _emulations().items():
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, fn)
