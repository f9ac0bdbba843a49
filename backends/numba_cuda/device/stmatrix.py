"""``stmatrix`` (sm_90): four 8x8 matrices of 16-bit values stored from the registers of a
warp, as :func:`..intrinsics.ldmatrix_x4` loads them: lanes ``8m .. 8m+7`` give the
addresses (element offsets into a uint16 shared array) of the eight 16-byte rows of matrix
``m``, and register ``m`` of lane ``l`` (two 16-bit values, the first in the low half) is
written to row ``l >> 2``, elements ``2(l & 3)`` and ``2(l & 3) + 1``; with ``.trans``, to
elements ``(2(l & 3), l >> 2)`` and ``(2(l & 3) + 1, l >> 2)`` (column ``l >> 2``). An
accumulator's pairs, rounded to 16 bits, go to shared memory in four instructions (dS of a
FlashAttention-3-style backward; cuDNN's STSM). Under the simulator, plain Python through
the warp rendezvous of ``intrinsics``.
"""
from __future__ import annotations

from .convert import SIMULATOR

__all__ = ["stmatrix_x4", "stmatrix_x4_trans"]

if SIMULATOR:
    from .intrinsics import _warp_exchange

    def _stmatrix(smem, idx, regs, trans):
        def store_all(ops):  # (once, when the warp's 32 lanes have handed theirs in)
            for lane, (_, _, rr) in enumerate(ops):
                g, t = lane >> 2, lane & 3
                for m in range(4):
                    lo, hi = int(rr[m]) & 0xFFFF, int(rr[m]) >> 16
                    if trans:
                        s0, i0 = ops[8 * m + 2 * t][:2]
                        s1, i1 = ops[8 * m + 2 * t + 1][:2]
                        s0[i0 + g], s1[i1 + g] = lo, hi
                    else:
                        s, i = ops[8 * m + g][:2]
                        s[i + 2 * t], s[i + 2 * t + 1] = lo, hi
            return None

        _warp_exchange((smem, int(idx), tuple(int(r) for r in regs)), store_all)

    def stmatrix_x4(smem, idx, r0, r1, r2, r3):
        """Four 8x8 b16 matrices to shared memory (``stmatrix...x4.shared.b16``): the
        inverse of :func:`ldmatrix_x4` on the same addresses."""
        _stmatrix(smem, idx, (r0, r1, r2, r3), False)

    def stmatrix_x4_trans(smem, idx, r0, r1, r2, r3):
        """Four 8x8 b16 matrices, each stored transposed (``stmatrix...x4.trans``): the
        inverse of :func:`ldmatrix_x4_trans`."""
        _stmatrix(smem, idx, (r0, r1, r2, r3), True)

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .intrinsics import _asm, _shared_u32

    def _stmatrix_intrinsic(trans):
        suffix = ".trans" if trans else ""
        text = (f"stmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 "
                "[$0], {$1, $2, $3, $4};")

        @intrinsic
        def stm(typingctx, ptr, idx, r0, r1, r2, r3):
            if not isinstance(ptr, types.CPointer) or not isinstance(idx, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                addr = _shared_u32(builder, args[0], args[1])
                regs = [context.cast(builder, v, t, types.uint32)
                        for v, t in zip(args[2:], sig.args[2:])]
                _asm(builder, ir.VoidType(), [addr, *regs], text, "r,r,r,r,r,~{memory}")
                return context.get_dummy_value()

            return types.void(ptr, idx, r0, r1, r2, r3), codegen

        return stm

    stmatrix_x4 = _stmatrix_intrinsic(False)
    stmatrix_x4_trans = _stmatrix_intrinsic(True)
