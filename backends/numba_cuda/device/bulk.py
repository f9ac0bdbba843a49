"""Bulk asynchronous reductions from shared to global memory (sm_90), inline PTX:

- ``st_shared_f32(smem, idx, value)``: one fp32 store at element ``idx`` of the 16-bit
  shared pointer ``smem`` (``st.shared.f32``; ``idx`` even).
- ``bulk_reduce_add_f32(dst, didx, smem, sidx, nbytes)``:
  ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: ``nbytes`` (a multiple
  of 16) of fp32 from shared element ``sidx`` added, element by element and atomically,
  into ``dst[didx:]`` (a float32 pointer), by the copy engine: the issuing thread goes on at
  once. Shared memory written by ordinary stores must be published to the async proxy
  first (``fence.proxy.async``, then a barrier), as for a wgmma.
- ``bulk_commit()``: closes this thread's bulk group; ``bulk_wait_read(n)`` (a literal)
  waits until at most ``n`` of its groups still read their shared source (the buffer may
  then be written again); ``bulk_wait(n)``: until they are done altogether.

The CUDA simulator has no copy engine: there the reduction is made at once (under a lock,
since other blocks add into the same elements) and the waits do nothing.
"""
from __future__ import annotations

from .convert import SIMULATOR

__all__ = ["bulk_commit", "bulk_reduce_add_f32", "bulk_wait", "bulk_wait_read", "st_shared_f32"]

if SIMULATOR:
    import threading

    import numpy as np

    _lock = threading.Lock()

    def st_shared_f32(smem, idx, value):
        i = int(idx)
        smem[i:i + 2] = np.array([value], np.float32).view(np.uint16)

    def bulk_reduce_add_f32(dst, didx, smem, sidx, nbytes):
        n, s, d = int(nbytes) // 4, int(sidx), int(didx)
        assert int(nbytes) % 16 == 0 and s % 8 == 0, "bulk copies move 16-byte units"
        src = np.array(smem[s:s + 2 * n]).view(np.float32)
        with _lock:
            dst[d:d + n] += src

    def bulk_commit():
        """(nothing to close in the simulator)"""

    def bulk_wait_read(n):
        """(the simulator's reductions are done when issued)"""

    def bulk_wait(n):
        """(the simulator's reductions are done when issued)"""

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def _asm(builder, args, text, constraints):
        fty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
        builder.call(ir.InlineAsm(fty, text, constraints, side_effect=True), args)

    def _shared_u32(builder, ptr, idx):
        p = builder.bitcast(builder.gep(ptr, [idx]), ir.IntType(8).as_pointer())
        s = builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3))
        return builder.ptrtoint(s, ir.IntType(32))

    @intrinsic
    def st_shared_f32(typingctx, smem, idx, value):
        if not isinstance(smem, types.CPointer) or value != types.float32:
            return None

        def codegen(context, builder, sig, args):
            _asm(builder, [_shared_u32(builder, args[0], args[1]), args[2]],
                 "st.shared.f32 [$0], $1;", "r,f,~{memory}")
            return context.get_dummy_value()

        return types.void(smem, idx, value), codegen

    @intrinsic
    def bulk_reduce_add_f32(typingctx, dst, didx, smem, sidx, nbytes):
        if not (isinstance(dst, types.CPointer) and isinstance(smem, types.CPointer)):
            return None

        def codegen(context, builder, sig, args):
            d, di, s, si, n = args
            g = builder.ptrtoint(builder.gep(d, [di]), ir.IntType(64))
            nb = context.cast(builder, n, sig.args[4], types.uint32)
            _asm(builder, [g, _shared_u32(builder, s, si), nb],
                 "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; "
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [ga], [$1], $2; }",
                 "l,r,r,~{memory}")
            return context.get_dummy_value()

        return types.void(dst, didx, smem, sidx, nbytes), codegen

    def _literal_op(make):
        @intrinsic
        def fn(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                return None
            text = make(int(n.literal_value))

            def codegen(context, builder, sig, args):
                _asm(builder, [], text, "~{memory}")
                return context.get_dummy_value()

            return types.void(n), codegen

        return fn

    bulk_wait_read = _literal_op(lambda n: f"cp.async.bulk.wait_group.read {n};")
    bulk_wait = _literal_op(lambda n: f"cp.async.bulk.wait_group {n};")

    @intrinsic
    def bulk_commit(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, [], "cp.async.bulk.commit_group;", "~{memory}")
            return context.get_dummy_value()

        return types.void(), codegen
