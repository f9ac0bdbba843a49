"""Element conversions between the stored dtypes and fp32, for kernels and the simulator.

Kernels receive raw pointers: ``float32*``, ``float16*``, and for bfloat16 ``uint16*`` (the
raw bits), so that one code path serves the GPU and the CUDA simulator, which has no bf16
arithmetic. ``load_f32(x)`` widens one stored element to fp32; ``store_f32(ptr, i, v)``
rounds an fp32 value to the stored dtype (bf16: round to nearest even) and writes it.

On the GPU these are typed ``@overload``s (the pointer type picks the conversion at
compile time); under ``NUMBA_ENABLE_CUDASIM=1`` they are plain Python on NumPy arrays.
The same holds for the few other helpers every kernel family (SIMT and tensor-core) uses:
``device_function``, ``smem_pointer``, ``ld4``, ``copy16`` and ``dot16``.
Import this module only after that choice is fixed (it imports numba.cuda).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

SIMULATOR = bool(cuda.config.ENABLE_CUDASIM)

if SIMULATOR:

    def device_function(fn):
        """A helper that kernels call: plain Python under the simulator."""
        return fn

    def smem_pointer(arr):
        """The shared array itself: simulator kernels index it like a pointer."""
        return arr

    def ld4(p, i):
        """Four consecutive words ``p[i:i+4]`` (one 16-byte load on the GPU, which must be
        16-byte aligned: checked here, as the GPU would fault)."""
        assert i % 4 == 0, f"ld4 at word {i}: not 16-byte aligned"
        return p[i], p[i + 1], p[i + 2], p[i + 3]

    def copy16(dst, di, src, si):
        """Eight 16-bit elements ``src[si:si+8]`` to ``dst[di:di+8]`` (one 16-byte load and
        one 16-byte store on the GPU; both ends 16-byte aligned: checked here, as the GPU
        would fault)."""
        assert di % 8 == 0 and si % 8 == 0, f"copy16 {si} -> {di}: not 16-byte aligned"
        dst[di:di + 8] = np.asarray(src[si:si + 8]).view(dst.dtype)  # (the bits, as on a GPU)

    def dot16(p, i, q, j):
        """``sum(p[i+e] * q[j+e])`` in fp32 over the elements of 16 bytes (8 16-bit, 4
        fp32), products added in order (one 16-byte load of each on the GPU; both ends
        16-byte aligned: checked here, as the GPU would fault)."""
        n = 16 // p.itemsize
        assert i % n == 0 and j % n == 0, f"dot16 at {i}, {j}: not 16-byte aligned"
        acc = np.float32(load_f32(p[i]) * load_f32(q[j]))
        for e in range(1, n):
            acc = np.float32(acc + np.float32(load_f32(p[i + e]) * load_f32(q[j + e])))
        return acc

    def load_f32(x):
        if x.dtype == np.uint16:
            return np.array(int(x) << 16, dtype=np.uint32).view(np.float32)[()]
        return np.float32(x)

    def store_f32(ptr, i, v):
        if ptr.dtype == np.uint16:
            bits = int(np.array(v, dtype=np.float32).view(np.uint32))
            if math.isnan(v):  # NaN stays NaN
                ptr[i] = 0x7FC0
            else:
                ptr[i] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        else:
            ptr[i] = v

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic, overload

    def device_function(fn):
        """A helper that kernels call: a device function that LLVM inlines (``forceinline``),
        so that after inlining its sizes are the caller's constants, its loops unroll and the
        local arrays passed in stay in registers. (Numba asks the current GPU for its compute
        capability while compiling it, so compile_ptx without a GPU must answer for it; see
        tests/test_numba_cuda_ptx.py.)"""
        return cuda.jit(device=True, forceinline=True)(fn)

    @intrinsic
    def smem_pointer(typingctx, arr):
        """A raw pointer to a shared array's data. Indexing it skips the negative-index
        wraparound that array indexing compiles to (five 64-bit integer instructions per
        access in the hot loops), and NVVM still emits ``ld.shared`` through it."""
        sig = types.CPointer(arr.dtype)(arr)

        def codegen(context, builder, signature, args):
            return context.make_array(signature.args[0])(context, builder, args[0]).data

        return sig, codegen

    @intrinsic
    def ld4(typingctx, ptr, idx):
        """``(p[i], p[i+1], p[i+2], p[i+3])`` of a float32 pointer as one 16-byte vector
        load (``ld.shared.v4.f32``); ``p + i`` must be 16-byte aligned."""
        rt = types.UniTuple(types.float32, 4)
        sig = rt(ptr, idx)

        def codegen(context, builder, signature, args):
            p, i = args
            vty = ir.VectorType(ir.FloatType(), 4)
            vp = builder.bitcast(builder.gep(p, [i]), vty.as_pointer())
            v = builder.load(vp, align=16)
            vals = [builder.extract_element(v, ir.Constant(ir.IntType(32), n))
                    for n in range(4)]
            return context.make_tuple(builder, rt, vals)

        return sig, codegen

    @intrinsic
    def copy16(typingctx, dst, di, src, si):
        """``dst[di:di+8] = src[si:si+8]`` for 16-bit element pointers as one 16-byte vector
        load and one 16-byte vector store (``ld.shared.v4`` from a shared pointer,
        ``st.global.v4`` to a kernel's array); both ends must be 16-byte aligned."""
        if not (isinstance(dst, types.CPointer) and isinstance(src, types.CPointer)
                and dst.dtype.bitwidth == 16 and src.dtype.bitwidth == 16):
            return None
        sig = types.void(dst, di, src, si)

        def codegen(context, builder, signature, args):
            d, i, s_, j = args
            vty = ir.VectorType(ir.IntType(32), 4).as_pointer()
            v = builder.load(builder.bitcast(builder.gep(s_, [j]), vty), align=16)
            builder.store(v, builder.bitcast(builder.gep(d, [i]), vty), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def dot16(typingctx, p, i, q, j):
        """``sum(p[i+e] * q[j+e])`` in fp32 over the elements of 16 bytes (8 16-bit, 4
        fp32), products added in order, from one 16-byte ``ld.global.v4`` of each pointer
        (float32, float16, or uint16 holding bf16 bits); both ends 16-byte aligned."""
        kinds = {types.float32: "f32", types.float16: "f16", types.uint16: "bf16"}
        if not (isinstance(p, types.CPointer) and isinstance(q, types.CPointer)
                and p.dtype == q.dtype and p.dtype in kinds):
            return None
        kind = kinds[p.dtype]
        sig = types.float32(p, i, q, j)

        def codegen(context, builder, signature, args):
            words = ir.VectorType(ir.IntType(32), 4)
            f32, i16 = ir.FloatType(), ir.IntType(16)

            def elements(ptr, idx):
                at = builder.bitcast(builder.gep(ptr, [idx]), words.as_pointer())
                vec = builder.load(builder.addrspacecast(at, words.as_pointer(1)), align=16)
                out = []
                for n in range(4):
                    w = builder.extract_element(vec, ir.Constant(ir.IntType(32), n))
                    if kind == "f32":
                        out.append(builder.bitcast(w, f32))
                    elif kind == "bf16":  # (the element's bits are a float32's high half)
                        out.append(builder.bitcast(builder.shl(w, w.type(16)), f32))
                        out.append(builder.bitcast(builder.and_(w, w.type(0xFFFF0000)), f32))
                    else:
                        for half in (w, builder.lshr(w, w.type(16))):
                            h = builder.bitcast(builder.trunc(half, i16), ir.HalfType())
                            out.append(builder.fpext(h, f32))
                return out

            a = elements(args[0], args[1])
            b = elements(args[2], args[3])
            acc = builder.fmul(a[0], b[0])
            for x, y in zip(a[1:], b[1:]):
                acc = builder.fadd(acc, builder.fmul(x, y))
            return acc

        return sig, codegen

    @intrinsic
    def _bits_to_f32(typingctx, x):
        sig = types.float32(types.uint32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen

    @intrinsic
    def _f32_to_bits(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    def load_f32(x):  # replaced by the overload below inside kernels
        raise NotImplementedError

    def store_f32(ptr, i, v):  # replaced by the overload below inside kernels
        raise NotImplementedError

    @overload(load_f32, target="cuda", inline="always")
    def _load_f32(x):
        if x == types.uint16:
            def impl(x):
                return _bits_to_f32(types.uint32(x) << types.uint32(16))
            return impl

        def impl(x):
            return types.float32(x)
        return impl

    @overload(store_f32, target="cuda", inline="always")
    def _store_f32(ptr, i, v):
        if ptr.dtype == types.uint16:
            def impl(ptr, i, v):
                bits = _f32_to_bits(types.float32(v))
                # (v != v, not math.isnan: isnan's libdevice call made LLVM stop unrolling
                # the callers' store loops, which sent a register tile to local memory)
                if v != v:  # noqa: PLR0124
                    ptr[i] = types.uint16(0x7FC0)
                else:
                    rounded = bits + types.uint32(0x7FFF) + ((bits >> types.uint32(16))
                                                             & types.uint32(1))
                    ptr[i] = types.uint16(rounded >> types.uint32(16))
            return impl
        if ptr.dtype == types.float16:
            def impl(ptr, i, v):
                ptr[i] = types.float16(v)
            return impl

        def impl(ptr, i, v):
            ptr[i] = types.float32(v)
        return impl
