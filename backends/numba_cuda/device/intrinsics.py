"""Warp-level tensor-core primitives as Numba intrinsics (inline PTX), with plain-Python
equivalents for the CUDA simulator.

Numba has no tensor-core API; each primitive here is an ``@intrinsic`` that emits one PTX
instruction through ``llvmlite.ir.InlineAsm``. Under ``NUMBA_ENABLE_CUDASIM=1`` the same
names are plain Python functions that compute each lane's registers exactly as the
hardware lays them out (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point
type" and "ldmatrix"); lanes of a warp trade their operands through a rendezvous, since
the simulator runs each thread as a Python thread and has no warp-level operations.

Registers holding two 16-bit values are ``uint32`` with the lower-indexed element in the
low half. Fragment layouts (``g = lane >> 2``, ``t = lane & 3``):

- A (16 x 16, row-major), 4 registers: ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``,
  ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]``.
- B (16 x 8, "col": stored as Bᵀ rows), 2 registers: ``b0 = B[2t:2t+2, g]``,
  ``b1 = B[2t+8:2t+10, g]``.
- C and D (16 x 8, fp32), 4 values: ``c0, c1 = C[g, 2t:2t+2]``, ``c2, c3 = C[g+8, 2t:2t+2]``.

``ldmatrix_x4(smem, i)``: lanes ``8m .. 8m+7`` give the addresses (element offsets into a
uint16 shared array) of the eight 16-byte rows of matrix ``m``; register ``m`` of lane
``l`` receives row ``l >> 2``, elements ``2(l & 3)`` and ``2(l & 3) + 1`` of matrix ``m``.
With ``.trans`` it receives elements ``(2(l & 3), l >> 2)`` and ``(2(l & 3) + 1, l >> 2)``
(column ``l >> 2`` of the stored rows): this turns a row-major ``[k][n]`` tile into B
fragments. Loading a row-major A tile with lanes pointing at row ``l % 16``, column
``8 (l // 16)`` gives exactly ``a0..a3``. ``device/stmatrix.py`` has the stores that undo
them (sm_90).

``cp_async16(smem, i, src, j, nbytes)`` copies 16 bytes global -> shared without going
through registers (``cp.async.cg``; the first ``nbytes`` copied, the rest zero-filled:
rows past the end, a row's last partial chunk; the tensor-core kernels' b16 tiles and the
SIMT kernels' fp32 rows); ``cp_async4(smem, i, src, j, nbytes)`` copies one fp32 element
``src[j]`` (``nbytes`` 4, or 0: zero) to 16-bit element ``i`` (even) of ``smem``
(``cp.async.ca``, 4 bytes); ``cp_async_commit()`` closes a group and
``cp_async_wait(n)`` (``n`` a literal) waits until at most ``n`` groups are in flight. A
``syncthreads`` must follow before other threads read the copied data. Under the simulator
the copy is immediate.

Pointers are the kernels' raw pointers (``convert.smem_pointer`` for shared memory, the
launch's typed pointers for global memory); under the simulator they are NumPy arrays.
Needs sm_80 or newer (cp.async, bf16 MMA, cvt to bf16x2).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import cuda

from .convert import SIMULATOR

__all__ = [
    "SIMULATOR",
    "cp_async16",
    "cp_async4",
    "cp_async_commit",
    "cp_async_wait",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "mma_bf16",
    "mma_f16",
    "pack_bf16x2",
    "pack_f16x2",
    "shfl_xor_f32",
    "warp_first",
    "warp_inclusive_sum",
    "warp_lane_value",
    "warp_uniform",
    "tanh_approx",
]


# --- the layouts, as plain data (used by the simulator and the tests) ----------------------

def a_coords(lane):
    """``[(row, col), ...]`` of the 8 A elements lane ``lane`` holds, register by register
    (two per register, low half first)."""
    g, t = lane >> 2, lane & 3
    out = []
    for r in range(4):
        row = g + 8 * (r & 1)
        col = 2 * t + 8 * (r >> 1)
        out += [(row, col), (row, col + 1)]
    return out


def b_coords(lane):
    """``[(k, n), ...]`` of the 4 B elements of ``lane`` (b0 low, b0 high, b1 low, b1 high)."""
    g, t = lane >> 2, lane & 3
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def c_coords(lane):
    """``[(row, col), ...]`` of the 4 C/D elements of ``lane`` (c0, c1, c2, c3)."""
    g, t = lane >> 2, lane & 3
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def bits_to_float(bits, kind):
    """A 16-bit pattern as a float: ``kind`` "bf16" or "f16"."""
    bits = int(bits) & 0xFFFF
    if kind == "bf16":
        return float(np.array(bits << 16, dtype=np.uint32).view(np.float32))
    return float(np.array(bits, dtype=np.uint16).view(np.float16))


def float_to_bits(x, kind):
    """Round ``x`` (taken as fp32) to bf16 or fp16, nearest even; the 16-bit pattern."""
    x = np.float32(x)
    if kind == "f16":
        return int(np.array(x, dtype=np.float16).view(np.uint16))
    if x != x:  # noqa: PLR0124  (NaN stays a quiet NaN)
        return 0x7FC0
    b = int(np.array(x, dtype=np.float32).view(np.uint32))
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


#: ``exp2_fma``'s polynomial: 2^f on [-1/2, 1/2], degree 5 (Chebyshev interpolation
#: rounded to float32; relative error 2.4e-7 in float32 Horner, about ``ex2.approx``'s),
#: lowest power first; and the bound below which it returns 0 (2^-126, fp32's smallest
#: normal: below it the exponent arithmetic would wrap).
EXP2_POLY = (1.0000001, 0.6931472, 0.24022107, 0.05550357, 0.00967603, 0.00133909)
EXP2_FLOOR = -126.0
#: 1.5 * 2^23: adding it rounds an fp32 of magnitude < 2^22 to an integer, which its low
#: mantissa bits then hold.
ROUND_MAGIC = 12582912.0


def exp2_fma_model(x):
    """``exp2_fma`` on the host, operation by operation in float32 (NumPy; any shape): x
    rounded to j, 2^(x - j) by the polynomial, j added to its exponent bits; 0 below
    :data:`EXP2_FLOOR` (and for -inf); NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    xc = np.fmax(x, np.float32(EXP2_FLOOR)).astype(np.float32)  # (NaN: the floor, as PTX)
    t = (xc + np.float32(ROUND_MAGIC)).astype(np.float32)
    j = (t - np.float32(ROUND_MAGIC)).astype(np.float32)
    f = (xc - j).astype(np.float32)
    p = np.full_like(f, np.float32(EXP2_POLY[-1]))
    for c in EXP2_POLY[-2::-1]:
        p = (p * f + np.float32(c)).astype(np.float32)  # (an fma rounds once: close enough)
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    out = bits.astype(np.uint32).view(np.float32)
    out = np.where(x < np.float32(EXP2_FLOOR), np.float32(0.0), out)
    return np.where(np.isnan(x), x, out).astype(np.float32)


if SIMULATOR:
    from numba.cuda.simulator.kernel import BlockThread

    _cond = threading.Condition()
    _slots: dict = {}

    def _warp_exchange(value, combine=None):
        """Every lane of the calling warp hands in ``value``; returns ``(lane, the 32
        values)``, or ``(lane, combine(the 32 values))`` computed once for the warp. All 32
        lanes must call (as the ``.sync.aligned`` instructions require)."""
        me = threading.current_thread()
        if not isinstance(me, BlockThread):
            raise TypeError("warp primitives run only inside a simulated kernel thread")
        lane = me.thread_id % 32
        seq = getattr(me, "_flashcore_seq", 0)
        me._flashcore_seq = seq + 1
        key = (id(me._manager), tuple(me.blockIdx), me.thread_id // 32, seq)
        with _cond:
            slot = _slots.setdefault(key, [[None] * 32, 0, 0, None])
            slot[0][lane] = value
            slot[1] += 1
            if slot[1] == 32:
                slot[3] = slot[0] if combine is None else combine(slot[0])
                _cond.notify_all()
            while slot[1] < 32:
                _cond.wait(timeout=0.5)
                if me.abort:
                    raise RuntimeError("another simulated thread failed")
            out = slot[3]
            slot[2] += 1
            if slot[2] == 32:
                del _slots[key]
        return lane, out

    def _u16(x):
        return int(x) & 0xFFFF

    def _ldmatrix(smem, idx, trans):
        lane, addrs = _warp_exchange((smem, int(idx)))
        g, t = lane >> 2, lane & 3
        regs = []
        for m in range(4):
            if trans:
                s0, i0 = addrs[8 * m + 2 * t]
                s1, i1 = addrs[8 * m + 2 * t + 1]
                lo, hi = _u16(s0[i0 + g]), _u16(s1[i1 + g])
            else:
                s, i = addrs[8 * m + g]
                lo, hi = _u16(s[i + 2 * t]), _u16(s[i + 2 * t + 1])
            regs.append(np.uint32(lo | (hi << 16)))
        return tuple(regs)

    def ldmatrix_x4(smem, idx):
        """Four 8x8 b16 matrices from shared memory (``ldmatrix...x4.shared.b16``)."""
        return _ldmatrix(smem, idx, False)

    def ldmatrix_x4_trans(smem, idx):
        """Four 8x8 b16 matrices, each transposed (``ldmatrix...x4.trans.shared.b16``)."""
        return _ldmatrix(smem, idx, True)

    def _coord_index(coords, ncols):
        """Flat tile index of element ``e`` of lane ``l``: array [32, n]."""
        return np.array([[i * ncols + j for i, j in coords(ln)] for ln in range(32)])

    _A_IDX = _coord_index(a_coords, 16)
    _B_IDX = _coord_index(b_coords, 8)
    _C_IDX = _coord_index(c_coords, 8)

    def _decode(regs, kind):
        """[32, n] uint32 registers -> [32, 2n] floats (low half first)."""
        r = np.asarray(regs, dtype=np.uint32)
        bits = np.stack([r & 0xFFFF, r >> 16], axis=-1).reshape(r.shape[0], -1)
        if kind == "bf16":
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)

    def _mma_combine(kind):
        def combine(ops):
            A = np.zeros(256)
            B = np.zeros(128)
            C = np.zeros(128)
            A[_A_IDX] = _decode([o[0] for o in ops], kind)
            B[_B_IDX] = _decode([o[1] for o in ops], kind)
            C[_C_IDX] = np.array([o[2] for o in ops], dtype=np.float64)
            D = (A.reshape(16, 16) @ B.reshape(16, 8) + C.reshape(16, 8)).astype(np.float32)
            return D.ravel()[_C_IDX]
        return combine

    _COMBINE = {"bf16": _mma_combine("bf16"), "f16": _mma_combine("f16")}

    def _mma(kind, a, b, c):
        lane, d = _warp_exchange((tuple(int(x) for x in a), tuple(int(x) for x in b),
                                  tuple(float(x) for x in c)), _COMBINE[kind])
        return tuple(d[lane])

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``D = A B + C``, m16n8k16, bf16 inputs, fp32 accumulators (``mma.sync``)."""
        return _mma("bf16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``D = A B + C``, m16n8k16, fp16 inputs, fp32 accumulators (``mma.sync``)."""
        return _mma("f16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def pack_bf16x2(lo, hi):
        """Two fp32 values rounded to bf16 (nearest even) in one register, ``lo`` low."""
        return np.uint32(float_to_bits(lo, "bf16") | (float_to_bits(hi, "bf16") << 16))

    def pack_f16x2(lo, hi):
        """Two fp32 values rounded to fp16 (nearest even) in one register, ``lo`` low."""
        return np.uint32(float_to_bits(lo, "f16") | (float_to_bits(hi, "f16") << 16))

    def shfl_xor_f32(v, mask):
        """``v`` of lane ``lane ^ mask`` (all 32 lanes take part)."""
        lane, vals = _warp_exchange(np.float32(v))
        return vals[lane ^ int(mask)]

    def warp_uniform(x):
        """``x``, the same in every lane of the warp (the GPU's version only tells ptxas)."""
        return x

    def warp_inclusive_sum(v):
        """The sum of ``v`` (int64) over lanes ``0 .. lane`` (all 32 lanes take part)."""
        lane, vals = _warp_exchange(int(v))
        return np.int64(sum(vals[:lane + 1]))

    def warp_first(pred):
        """The first lane whose ``pred`` holds, 32 where none does (all 32 lanes)."""
        _, vals = _warp_exchange(bool(pred))
        return np.int32(next((n for n, p in enumerate(vals) if p), 32))

    def warp_lane_value(v, src):
        """``v`` (int64) of lane ``src`` (all 32 lanes take part)."""
        _, vals = _warp_exchange(int(v))
        return np.int64(vals[int(src)])

    def tanh_approx(x):
        """tanh of an fp32 (``tanh.approx.f32`` on the GPU: max relative error ~2^-11)."""
        return np.float32(np.tanh(np.float32(x)))

    def exp2_fma(x):
        """2^x by fp32 arithmetic instead of the MUFU unit (``exp2_fma_model``)."""
        return np.float32(exp2_fma_model(np.float32(x))[()])

    def cp_async16(smem, sidx, src, gidx, nbytes):
        """16 bytes (8 b16 or 4 fp32 elements, by ``smem``'s dtype) from ``src[gidx:]`` to
        ``smem[sidx:]``: the first ``nbytes`` copied, the rest zero-filled (``nbytes`` 0:
        all zeros). Both addresses must be 16-byte aligned."""
        sidx, n = int(sidx), 16 // smem.itemsize
        assert sidx % n == 0, f"cp.async 16 to word {sidx}: not 16-byte aligned"
        smem[sidx:sidx + n] = 0
        m = int(nbytes) // smem.itemsize
        if m:
            gidx = int(gidx)
            smem[sidx:sidx + m] = src[gidx:gidx + m].view(smem.dtype)

    def cp_async4(smem, sidx, src, gidx, nbytes):
        """One fp32 element ``src[gidx]`` (``nbytes`` 4; 0: zero) to 16-bit elements
        ``smem[sidx:sidx + 2]`` (``sidx`` even)."""
        sidx = int(sidx)
        assert sidx % 2 == 0, f"cp.async 4 to element {sidx}: not 4-byte aligned"
        v = np.float32(src[int(gidx)]) if int(nbytes) else np.float32(0.0)
        smem[sidx:sidx + 2] = np.array([v], np.float32).view(np.uint16)

    def cp_async_commit():
        """Close the current group of cp.async copies (a no-op in the simulator)."""

    def cp_async_wait(n):
        """Wait until at most ``n`` groups are in flight (a no-op in the simulator)."""

else:
    from llvmlite import ir
    from numba import int32
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _asm(builder, ret, args, text, constraints, side_effect=True):
        """Inline PTX; ``side_effect=False`` for pure register arithmetic, which LLVM may
        then merge where the same operands repeat (the packs of a reused P fragment)."""
        fty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fty, text, constraints, side_effect=side_effect),
                            args)

    def _shared_u32(builder, ptr, idx):
        """The 32-bit shared-state-space address of ``ptr + idx`` (a generic pointer into
        shared memory)."""
        p = builder.bitcast(builder.gep(ptr, [idx]), ir.IntType(8).as_pointer())
        s = builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3))
        return builder.ptrtoint(s, _I32)

    def _generic_u64(builder, ptr, idx):
        return builder.ptrtoint(builder.gep(ptr, [idx]), ir.IntType(64))

    def _tuple(context, builder, rt, st, n):
        vals = [builder.extract_value(st, i) for i in range(n)]
        return context.make_tuple(builder, rt, vals)

    def _ldmatrix_intrinsic(trans):
        suffix = ".trans" if trans else ""
        text = (f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 "
                "{$0, $1, $2, $3}, [$4];")

        @intrinsic
        def ldm(typingctx, ptr, idx):
            if not isinstance(ptr, types.CPointer) or not isinstance(idx, types.Integer):
                return None
            rt = types.UniTuple(types.uint32, 4)

            def codegen(context, builder, sig, args):
                addr = _shared_u32(builder, args[0], args[1])
                st = _asm(builder, ir.LiteralStructType([_I32] * 4), [addr], text,
                          "=r,=r,=r,=r,r,~{memory}")
                return _tuple(context, builder, rt, st, 4)

            return rt(ptr, idx), codegen

        return ldm

    ldmatrix_x4 = _ldmatrix_intrinsic(False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(True)

    def _mma_intrinsic(kind):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
        u, f = types.uint32, types.float32

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            rt = types.UniTuple(f, 4)
            sig = rt(u, u, u, u, u, u, f, f, f, f)

            def codegen(context, builder, sig, args):
                st = _asm(builder, ir.LiteralStructType([_F32] * 4), list(args), text,
                          "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                return _tuple(context, builder, rt, st, 4)

            return sig, codegen

        return mma

    mma_bf16 = _mma_intrinsic("bf16")
    mma_f16 = _mma_intrinsic("f16")

    def _pack_intrinsic(kind):
        # cvt puts its first source in the upper half: pass (hi, lo)
        text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig, args):
                lo_v, hi_v = args
                return _asm(builder, _I32, [hi_v, lo_v], text, "=r,f,f", side_effect=False)

            return sig, codegen

        return pack

    pack_bf16x2 = _pack_intrinsic("bf16")
    pack_f16x2 = _pack_intrinsic("f16")

    @intrinsic
    def tanh_approx(typingctx, x):
        """tanh of an fp32 in one MUFU instruction (``tanh.approx.f32``, sm_75+; max
        relative error ~2^-11, FlashAttention's softcap uses the same)."""
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            return _asm(builder, _F32, [args[0]], "tanh.approx.f32 $0, $1;", "=f,f",
                        side_effect=False)

        return sig, codegen

    def _f32_hex(x):
        return "0f" + np.array(x, dtype=np.float32).view(np.uint32).tobytes()[::-1].hex()

    _EXP2_PTX = (
        "{ .reg .f32 xc, t, j, f, p; .reg .b32 ti, pi; .reg .pred lo, nan; "
        f"max.f32 xc, $1, {_f32_hex(EXP2_FLOOR)}; "
        f"add.rn.f32 t, xc, {_f32_hex(ROUND_MAGIC)}; "
        f"sub.rn.f32 j, t, {_f32_hex(ROUND_MAGIC)}; "
        "sub.rn.f32 f, xc, j; "
        f"fma.rn.f32 p, f, {_f32_hex(EXP2_POLY[5])}, {_f32_hex(EXP2_POLY[4])}; "
        + "".join(f"fma.rn.f32 p, p, f, {_f32_hex(c)}; " for c in EXP2_POLY[3::-1])
        + "mov.b32 ti, t; shl.b32 ti, ti, 23; mov.b32 pi, p; add.s32 pi, pi, ti; "
        f"setp.lt.f32 lo, $1, {_f32_hex(EXP2_FLOOR)}; setp.nan.f32 nan, $1, $1; "
        "mov.b32 $0, pi; @lo mov.f32 $0, 0f00000000; @nan mov.f32 $0, $1; }")

    @intrinsic
    def exp2_fma(typingctx, x):
        """2^x in fp32 arithmetic, without the MUFU unit (``ex2.approx`` there): x rounded
        to an integer j by the 1.5 * 2^23 trick, 2^(x - j) by a degree-5 polynomial (5
        FMAs), j added to its exponent bits; 0 below 2^-126 (-inf too). A kernel whose
        MUFU unit is the bottleneck (the softcap's tanh beside the softmax's exp2) takes
        some of its exponentials here, on the FMA pipe (FlashAttention 4's trick)."""
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            return _asm(builder, _F32, [args[0]], _EXP2_PTX, "=f,f", side_effect=False)

        return sig, codegen

    def _cp_async_intrinsic(nbytes, cache):
        text = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                f"cp.async.{cache}.shared.global [$0], [ga], {nbytes}, $2; }}")

        @intrinsic
        def cp_async(typingctx, smem, sidx, src, gidx, nbytes):
            """``src`` is a raw pointer (the kernels) or a device array (its data pointer)."""
            if not (isinstance(smem, types.CPointer)
                    and isinstance(src, (types.CPointer, types.Array))):
                return None
            sig = types.void(smem, sidx, src, gidx, types.uint32)

            def codegen(context, builder, sig, args):
                s, si, g, gi, n = args
                if isinstance(sig.args[2], types.Array):
                    g = context.make_array(sig.args[2])(context, builder, g).data
                saddr = _shared_u32(builder, s, si)
                gaddr = _generic_u64(builder, g, gi)
                _asm(builder, ir.VoidType(), [saddr, gaddr, n], text, "r,l,r,~{memory}")
                return context.get_dummy_value()

            return sig, codegen

        return cp_async

    cp_async16 = _cp_async_intrinsic(16, "cg")
    cp_async4 = _cp_async_intrinsic(4, "ca")

    @intrinsic
    def cp_async_commit(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}")
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        text = f"cp.async.wait_group {int(n.literal_value)};"
        sig = types.void(n)

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}")
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, forceinline=True)
    def shfl_xor_f32(v, mask):
        """``v`` of lane ``lane ^ mask`` (all 32 lanes take part)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, mask)

    @cuda.jit(device=True, forceinline=True)
    def warp_uniform(x):
        """``x`` (an int32 the same in every lane of the warp, e.g. a warpgroup index), as
        lane 0's through a shuffle, so that ptxas knows it is uniform and keeps what derives
        from it (wgmma descriptors) in uniform registers, without an R2UR move per use (all
        32 lanes take part; CUTLASS broadcasts its warpgroup index the same way)."""
        return cuda.shfl_sync(0xFFFFFFFF, x, 0)

    def _shfl_i64_intrinsic(mode, clamp):
        """A 64-bit ``shfl.sync`` (``mode`` up or idx) as two 32-bit shuffles of its halves,
        unpacked and packed by ``mov.b64`` (the value moves whole: no conversion narrows
        it, which tests/ptx_addresses.py would take for a truncation)."""
        text = ("{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; "
                f"shfl.sync.{mode}.b32 lo, lo, $2, {clamp}, -1; "
                f"shfl.sync.{mode}.b32 hi, hi, $2, {clamp}, -1; mov.b64 $0, {{lo, hi}}; }}")

        @intrinsic
        def shfl(typingctx, v, d):
            sig = types.int64(types.int64, types.int32)

            def codegen(context, builder, sig, args):
                return _asm(builder, ir.IntType(64), list(args), text, "=l,l,r")

            return sig, codegen

        return shfl

    _shfl_up_i64 = _shfl_i64_intrinsic("up", 0)
    _shfl_idx_i64 = _shfl_i64_intrinsic("idx", 31)

    @cuda.jit(device=True, forceinline=True)
    def warp_inclusive_sum(v):
        """The sum of ``v`` (int64) over lanes ``0 .. lane``: five ``shfl.up`` steps (all
        32 lanes take part)."""
        lane = cuda.laneid
        for d in (1, 2, 4, 8, 16):
            y = _shfl_up_i64(v, int32(d))
            if lane >= d:
                v += y
        return v

    @cuda.jit(device=True, forceinline=True)
    def warp_first(pred):
        """The first lane whose ``pred`` holds, 32 where none does: a ballot's trailing
        zeros, as the leading zeros of its bits reversed (all 32 lanes take part)."""
        return cuda.clz(cuda.brev(cuda.ballot_sync(0xFFFFFFFF, pred)))

    @cuda.jit(device=True, forceinline=True)
    def warp_lane_value(v, src):
        """``v`` (int64) of lane ``src`` (all 32 lanes take part)."""
        return _shfl_idx_i64(v, int32(src))
