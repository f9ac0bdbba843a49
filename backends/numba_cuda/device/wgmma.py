"""Hopper warpgroup MMA (``wgmma``) from Numba: intrinsics (inline PTX), shared-memory matrix
descriptors, and the layouts they imply, as plain data.

Target. ``wgmma`` needs the architecture-specific target ``sm_90a``. numba-cuda 0.30.4 gives
it without help when it compiles for the GPU it runs on: ``CUDACodeLibrary._ensure_cc``
turns a device's (9, 0) into (9, 0, "a"), so NVVM gets ``-arch=compute_90a`` and the linker
``sm_90a`` (so, by numba-cuda's code, every kernel ``cuda.jit`` builds on an H100/H200 is
already sm_90a, the mma.sync ones too). Without a GPU, ``cuda.compile_ptx(fn, sig, cc=(9, 0, "a"))`` writes
``.target sm_90a``; ``cc=(9, 0)`` writes ``.target sm_90``, which ptxas refuses for these
instructions ("not supported on .target 'sm_90'"). Beware ``dispatcher.inspect_asm(sig)``:
it passes the device's cc without the suffix, so its PTX says sm_90.

The instructions (PTX ISA 8.0+, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):

- ``wgmma_fence()``: ``wgmma.fence.sync.aligned``, before the first ``wgmma`` of a
  warpgroup and between any ordinary register access to an accumulator (or an A fragment)
  and a ``wgmma`` that uses it. ``wgmma_fence_acc(acc)`` is the same fence with the
  accumulators tied through it, so that their definitions (zeros, a rescale) cannot sink
  past it.
- ``wgmma_ss_bf16 / wgmma_ss_f16(acc, desc_a, desc_b, scale_d, trans_a, trans_b)``:
  ``wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}`` with A and B in shared memory;
  ``N = 2 * len(acc)`` (8 <= N <= 256, N % 8 == 0), ``acc`` a tuple of N/2 float32 per
  thread, returned updated: ``D = A B + (D if scale_d else 0)``. ``trans_a`` / ``trans_b``
  are literals: 0 = K-major, 1 = M-major (A) / N-major (B).
- ``wgmma_rs_bf16 / wgmma_rs_f16(acc, a0, a1, a2, a3, desc_b, scale_d, trans_b)``: the same
  with A from registers (four uint32 of two 16-bit values each, layout :func:`a_coords`).
- ``wgmma_commit_group()``: closes the group of ``wgmma`` issued so far;
  ``wgmma_wait_group(n)`` (``n`` a literal) waits until at most ``n`` groups are pending;
  ``wgmma_wait_group_acc(n, acc)`` is the same wait with the accumulators tied through it,
  so no read of them is scheduled before it. Read accumulators only after such a wait.
- ``fence_proxy_async()``: ``fence.proxy.async.shared::cta``, in every thread that wrote
  shared memory with ordinary stores which a ``wgmma`` reads next (before the barrier).
- ``smem_address(ptr, idx)``: the 32-bit shared-state-space address of ``ptr + idx``;
  ``smem_descriptor(addr, leading_byte_offset, stride_byte_offset, swizzle)``: the 64-bit
  matrix descriptor (uint64 arithmetic; :func:`descriptor_value` is the same code on the
  host).
- ``zero_accumulators(n)``: a tuple of ``n // 2`` float32 zeros (``n`` a literal).
- ``opaque(x)``: the int64 ``x`` through an inline asm that LLVM cannot see through or move:
  what a loop computes from it stays in the loop. Descriptors of a resident tile are loop
  invariant; hoisted out of the loop, each holds two registers for the whole loop (the
  wgmma dK/dV kernel's 16 at D=128 made it spill).
- ``acc_to_local(acc, arr)`` / ``acc_from_local(arr, n)``: the tuple stored into a float32
  local array (register ``i`` at ``arr[i]``) and ``n // 2`` values of one read back as a
  tuple (``n`` a literal): element-wise work (a softmax, a rescale, the stores) is then
  written on arrays with constant indices, which LLVM keeps in registers as it does for the
  mma.sync kernels' fragments.

Accumulator layout (PTX ISA, "Matrix Fragments for wgmma.mma_async.m64nNk16", D): thread
``t`` of the warpgroup (0..127), ``w = t // 32``, ``g = (t % 32) // 4``, ``q = t % 4``; its
register ``i`` (0 .. N/2-1) holds ``D[row, col]`` with
``row = 16 w + g + 8 ((i // 2) % 2)``, ``col = 8 (i // 4) + 2 q + i % 2``: each warp owns
16 rows, and within them every 8 columns repeat mma.sync's m16n8 C layout
(:func:`acc_coords`). Register A fragments (m64nNk16, A): warp ``w`` owns rows
``16 w .. 16 w + 15``, laid out as mma.sync's m16n8k16 A (:func:`a_coords`).

Shared-memory layouts (PTX ISA, "Shared Memory Matrix Layout", its canonical layouts; byte
offsets, 16-bit elements). A *K-major* tile stores each row of A (M x K) or of Bᵀ (N x K)
along K (``trans`` 0); an *MN-major* tile stores each k-row of B (K x N) along N (``trans_b``
1). Either is ``rows`` lines of ``cols`` elements, stored by :func:`tile_offset`:

- no swizzle: 8 x 8 core matrices of 128 contiguous bytes (8 lines of 16 bytes), core
  matrix (i // 8, j // 8) at ``((i // 8) (cols / 8) + j // 8) 128``. K-major: LBO (next 8
  k) = 128, SBO (next 8 rows) = 16 cols. MN-major: LBO (next 8 k) = 16 cols, SBO (next 8
  n) = 128.
- S-byte swizzle (S = 128, 64, 32): blocks of S/2 elements per line, one after another
  (``rows S`` bytes each), line i of a block at ``i S``; then the offset is XOR-swizzled,
  ``Swizzle<log2(S/16), 4, 3>``: its 16-byte chunk bits (4..) ^= the bits from 7 up, the
  line within the 8-line pattern (:func:`swizzle`). K-major: SBO (next 8 rows) = 8 S, LBO
  unused (encoded 1). MN-major: SBO (next 8 k) = 8 S, LBO (next block of n) = ``rows S``.
  The tile must start on its pattern's boundary (1024 bytes for S = 128, 512 for 64, 256
  for 32) so that the descriptor's base offset stays 0.

:func:`layout_strides` gives (LBO, SBO). A ``wgmma`` sub-tile starts at the *unswizzled*
offset of its first element (:func:`tile_start`): stepping K by 16 moves it by 32 bytes in a
swizzled K-major tile (256 with no swizzle), by ``16 S`` bytes in a swizzled MN-major one
(``32 cols`` with no swizzle). tests/test_numba_cuda_wgmma.py reads every such sub-tile back
through the PTX ISA's canonical-layout table; ``tools/wgmma_ceiling.py --check`` checks the
hardware's reading on an H100/H200 (no swizzle and 128B; 64B and 32B follow the same rule
and are not run there).

The CUDA simulator cannot run these instructions: under ``NUMBA_ENABLE_CUDASIM=1`` the
device names raise ``NotImplementedError`` when called; the host helpers work everywhere.
"""
from __future__ import annotations

from numba import uint64

from .convert import SIMULATOR

__all__ = [
    "SWIZZLE_32B",
    "SWIZZLE_64B",
    "SWIZZLE_128B",
    "SWIZZLE_NONE",
    "a_coords",
    "acc_coords",
    "acc_from_local",
    "acc_to_local",
    "descriptor_value",
    "fence_proxy_async",
    "layout_strides",
    "opaque",
    "smem_address",
    "smem_descriptor",
    "swizzle",
    "tile_offset",
    "tile_start",
    "wgmma_commit_group",
    "wgmma_fence",
    "wgmma_fence_acc",
    "wgmma_rs_bf16",
    "wgmma_rs_f16",
    "wgmma_ss_bf16",
    "wgmma_ss_f16",
    "wgmma_wait_group",
    "wgmma_wait_group_acc",
    "zero_accumulators",
]

#: The descriptor's swizzle field (bits 62-63).
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3
#: Bytes of one swizzled row (the swizzle block's width) per mode; 16 for none (a core row).
SWIZZLE_BYTES = {SWIZZLE_NONE: 16, SWIZZLE_128B: 128, SWIZZLE_64B: 64, SWIZZLE_32B: 32}
#: The N of m64nNk16 that a tuple of float32 accumulators may have.
VALID_N = tuple(range(8, 257, 8))


# --- layouts as plain data (host side: the tools, the tests, future kernels' setup) --------

def _descriptor(addr, leading_byte_offset, stride_byte_offset, swizzle):
    u = uint64
    return ((u(addr) & u(0x3FFFF)) >> u(4)
            | ((u(leading_byte_offset) & u(0x3FFFF)) >> u(4)) << u(16)
            | ((u(stride_byte_offset) & u(0x3FFFF)) >> u(4)) << u(32)
            | (u(swizzle) & u(3)) << u(62))


def descriptor_value(addr, leading_byte_offset, stride_byte_offset, swizzle):
    """The 64-bit matrix descriptor as a Python int (the device's :func:`smem_descriptor`):
    bits 0-13 ``addr >> 4``, 16-29 ``LBO >> 4``, 32-45 ``SBO >> 4``, 49-51 base offset (0:
    the tile starts on its swizzle pattern's boundary), 62-63 ``swizzle``."""
    return int(_descriptor(addr, leading_byte_offset, stride_byte_offset, swizzle))


def swizzle(offset, mode):
    """The byte offset where the swizzle ``mode`` stores what sits at linear byte ``offset``
    (``Swizzle<B, 4, 3>``: 16-byte chunk bits 4.. XOR the bits from 7 up; B = 3, 2, 1 for
    128, 64, 32 bytes). Offsets are relative to a tile aligned to the pattern (1024 bytes
    for 128B)."""
    if mode == SWIZZLE_128B:
        return offset ^ ((offset >> 3) & 0x70)
    if mode == SWIZZLE_64B:
        return offset ^ ((offset >> 3) & 0x30)
    if mode == SWIZZLE_32B:
        return offset ^ ((offset >> 3) & 0x10)
    return offset


def tile_start(i, j, rows, cols, mode):
    """The unswizzled byte offset of element (i, j) of one of this module's tiles: ``rows``
    lines of ``cols`` 16-bit elements (a K-major tile: line = M or N row, element = k; an
    MN-major tile: line = k, element = n). A descriptor of the sub-tile that starts at (i, j)
    starts here (the hardware applies the swizzle)."""
    if mode == SWIZZLE_NONE:
        # core matrices of 8 lines x 8 elements, row-major over (line // 8, element // 8)
        return ((i // 8) * (cols // 8) + j // 8) * 128 + (i % 8) * 16 + (j % 8) * 2
    width = SWIZZLE_BYTES[mode] // 2  # elements per swizzled line
    return (j // width) * rows * 2 * width + i * 2 * width + (j % width) * 2


def tile_offset(i, j, rows, cols, mode):
    """Where element (i, j) of the tile is stored: :func:`tile_start` swizzled."""
    return swizzle(tile_start(i, j, rows, cols, mode), mode)


def layout_strides(major, rows, cols, mode):
    """``(leading_byte_offset, stride_byte_offset)`` for a descriptor of this module's
    ``rows x cols`` tiles: ``major`` "k" for K-major (A as M x K, Bᵀ as N x K; trans 0), "mn"
    for MN-major (B as K x N; trans 1)."""
    s = SWIZZLE_BYTES[mode]
    if major == "k":
        return (128, 16 * cols) if mode == SWIZZLE_NONE else (16, 8 * s)
    if major == "mn":
        return (16 * cols, 128) if mode == SWIZZLE_NONE else (rows * s, 8 * s)
    raise ValueError(f"{major=} must be 'k' or 'mn'")


def acc_coords(thread, n):
    """``[(row, col), ...]`` of the ``n // 2`` float32 accumulators of warpgroup thread
    ``thread`` (0..127) for m64nNk16, register by register."""
    w, lane = thread // 32, thread % 32
    g, q = lane // 4, lane % 4
    return [(16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * q + i % 2)
            for i in range(n // 2)]


def a_coords(thread):
    """``[(row, k), ...]`` of the 8 A elements warpgroup thread ``thread`` holds for
    m64nNk16 with A in registers: four registers, two elements each (low half first)."""
    w, lane = thread // 32, thread % 32
    g, q = lane // 4, lane % 4
    out = []
    for r in range(4):
        row = 16 * w + g + 8 * (r & 1)
        k = 2 * q + 8 * (r >> 1)
        out += [(row, k), (row, k + 1)]
    return out


if SIMULATOR:

    def _unavailable(name):
        def stub(*args, **kwargs):
            raise NotImplementedError(
                f"{name}: wgmma and its fences are Hopper (sm_90a) instructions; the CUDA "
                "simulator cannot run them (run on an H100/H200, or use the mma.sync "
                "kernels)")
        stub.__name__ = name
        return stub

    smem_descriptor = _descriptor

    def opaque(x):
        return x

    for _name in __all__:
        if _name.startswith(("wgmma_", "fence_", "zero_", "smem_address", "acc_to_local",
                             "acc_from_local")):
            globals()[_name] = _unavailable(_name)
    del _name

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .convert import device_function

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    smem_descriptor = device_function(_descriptor)

    def _asm(builder, ret, args, text, constraints):
        fty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fty, text, constraints, side_effect=True), args)

    def _void_intrinsic(text, doc):
        @intrinsic
        def fn(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], text, "~{memory}")
                return context.get_dummy_value()

            return sig, codegen

        fn.__doc__ = doc
        return fn

    wgmma_fence = _void_intrinsic("wgmma.fence.sync.aligned;",
                                  "Order register accesses before the next wgmma.")
    wgmma_commit_group = _void_intrinsic("wgmma.commit_group.sync.aligned;",
                                         "Close the group of wgmma issued so far.")
    fence_proxy_async = _void_intrinsic(
        "fence.proxy.async.shared::cta;",
        "Make this thread's ordinary shared-memory writes visible to the async proxy.")

    def _acc_count(acc):
        """N/2 of a float32 accumulator tuple, or None where ``acc`` is not one."""
        if (isinstance(acc, types.UniTuple) and acc.dtype == types.float32
                and 2 * acc.count in VALID_N):
            return acc.count
        return None

    def _literal(x):
        if isinstance(x, (types.IntegerLiteral, types.BooleanLiteral)):
            return int(x.literal_value)
        return None

    def _tied(context, builder, rt, acc_val, text, extra=(), extra_cons=()):
        """Inline asm ``text`` whose first operands are the tuple's float32 values, as
        outputs tied to inputs (``+f``), then ``extra``; returns the new tuple."""
        m = rt.count
        vals = [builder.extract_value(acc_val, i) for i in range(m)]
        cons = ",".join(["=f"] * m + [str(i) for i in range(m)] + list(extra_cons)
                        + ["~{memory}"])
        st = _asm(builder, ir.LiteralStructType([_F32] * m), vals + list(extra), text, cons)
        return context.make_tuple(builder, rt, [builder.extract_value(st, i)
                                                for i in range(m)])

    @intrinsic
    def opaque(typingctx, x):
        """``x`` (an int64), unchanged, through an inline asm with side effects."""
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], types.int64)
            return _asm(builder, _I64, [v], "mov.b64 $0, $1;", "=l,l")

        return types.int64(x), codegen

    @intrinsic
    def zero_accumulators(typingctx, n):
        """A tuple of ``n // 2`` float32 zeros (``n`` a literal in VALID_N)."""
        nv = _literal(n)
        if nv not in VALID_N:
            return None
        rt = types.UniTuple(types.float32, nv // 2)

        def codegen(context, builder, sig, args):
            zero = ir.Constant(_F32, 0.0)
            return context.make_tuple(builder, rt, [zero] * (nv // 2))

        return rt(n), codegen

    @intrinsic
    def acc_to_local(typingctx, acc, arr):
        """``arr[i] = acc[i]`` for every accumulator (``arr`` a float32 local array)."""
        m = _acc_count(acc)
        if m is None or not isinstance(arr, types.Array) or arr.dtype != types.float32:
            return None

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[1])(context, builder, args[1]).data
            for i in range(m):
                builder.store(builder.extract_value(args[0], i),
                              builder.gep(data, [ir.Constant(_I32, i)]))
            return context.get_dummy_value()

        return types.void(acc, arr), codegen

    @intrinsic
    def acc_from_local(typingctx, arr, n):
        """``(arr[0], ..., arr[n // 2 - 1])`` as an accumulator tuple (``n`` a literal in
        VALID_N, the N of the wgmma it feeds)."""
        nv = _literal(n)
        if (nv not in VALID_N or not isinstance(arr, types.Array)
                or arr.dtype != types.float32):
            return None
        rt = types.UniTuple(types.float32, nv // 2)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            vals = [builder.load(builder.gep(data, [ir.Constant(_I32, i)]))
                    for i in range(nv // 2)]
            return context.make_tuple(builder, rt, vals)

        return rt(arr, n), codegen

    @intrinsic
    def wgmma_fence_acc(typingctx, acc):
        """``wgmma.fence`` with the accumulators tied through it: returns ``acc``."""
        m = _acc_count(acc)
        if m is None:
            return None

        def codegen(context, builder, sig, args):
            return _tied(context, builder, acc, args[0], "wgmma.fence.sync.aligned;")

        return acc(acc), codegen

    @intrinsic
    def wgmma_wait_group(typingctx, n):
        """Wait until at most ``n`` (a literal) wgmma groups are pending."""
        nv = _literal(n)
        if nv is None:
            return None
        text = f"wgmma.wait_group.sync.aligned {nv};"

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}")
            return context.get_dummy_value()

        return types.void(n), codegen

    @intrinsic
    def wgmma_wait_group_acc(typingctx, n, acc):
        """``wgmma_wait_group(n)`` with the accumulators tied through it: returns ``acc``,
        which nothing then reads before the wait."""
        nv, m = _literal(n), _acc_count(acc)
        if nv is None or m is None:
            return None
        text = f"wgmma.wait_group.sync.aligned {nv};"

        def codegen(context, builder, sig, args):
            return _tied(context, builder, acc, args[1], text)

        return acc(n, acc), codegen

    @intrinsic
    def smem_address(typingctx, ptr, idx):
        """The 32-bit shared-state-space address of ``ptr + idx`` (``ptr`` a generic pointer
        into shared memory, as ``convert.smem_pointer`` gives)."""
        if not isinstance(ptr, types.CPointer) or not isinstance(idx, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            p = builder.bitcast(builder.gep(args[0], [args[1]]), ir.IntType(8).as_pointer())
            s = builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3))
            return builder.ptrtoint(s, _I32)

        return types.uint32(ptr, idx), codegen

    def _as(context, builder, val, fromty, toty):
        return context.cast(builder, val, fromty, toty)

    def _ss_intrinsic(kind):
        @intrinsic
        def wgmma_ss(typingctx, acc, desc_a, desc_b, scale_d, trans_a, trans_b):
            m = _acc_count(acc)
            ta, tb = _literal(trans_a), _literal(trans_b)
            if (m is None or ta not in (0, 1) or tb not in (0, 1)
                    or not isinstance(desc_a, types.Integer)
                    or not isinstance(desc_b, types.Integer)
                    or not isinstance(scale_d, (types.Integer, types.Boolean))):
                return None
            d = ", ".join(f"${i}" for i in range(m))
            text = ("{ .reg .pred p; "
                    f"setp.ne.b32 p, ${2 * m + 2}, 0; "
                    f"wgmma.mma_async.sync.aligned.m64n{2 * m}k16.f32.{kind}.{kind} "
                    f"{{{d}}}, ${2 * m}, ${2 * m + 1}, p, 1, 1, {ta}, {tb}; }}")
            sig = acc(acc, desc_a, desc_b, scale_d, trans_a, trans_b)

            def codegen(context, builder, sig, args):
                a, b, s = (_as(context, builder, args[i], sig.args[i], t)
                           for i, t in ((1, types.uint64), (2, types.uint64),
                                        (3, types.int32)))
                return _tied(context, builder, acc, args[0], text, [a, b, s], "llr")

            return sig, codegen

        wgmma_ss.__doc__ = (f"m64nNk16 {kind} wgmma, A and B from shared-memory descriptors; "
                            "N = 2 len(acc); returns the new accumulators.")
        return wgmma_ss

    def _rs_intrinsic(kind):
        @intrinsic
        def wgmma_rs(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d, trans_b):
            m = _acc_count(acc)
            tb = _literal(trans_b)
            if (m is None or tb not in (0, 1)
                    or not all(isinstance(x, types.Integer) for x in (a0, a1, a2, a3, desc_b))
                    or not isinstance(scale_d, (types.Integer, types.Boolean))):
                return None
            d = ", ".join(f"${i}" for i in range(m))
            a = ", ".join(f"${2 * m + i}" for i in range(4))
            text = ("{ .reg .pred p; "
                    f"setp.ne.b32 p, ${2 * m + 5}, 0; "
                    f"wgmma.mma_async.sync.aligned.m64n{2 * m}k16.f32.{kind}.{kind} "
                    f"{{{d}}}, {{{a}}}, ${2 * m + 4}, p, 1, 1, {tb}; }}")
            sig = acc(acc, a0, a1, a2, a3, desc_b, scale_d, trans_b)

            def codegen(context, builder, sig, args):
                regs = [_as(context, builder, args[1 + i], sig.args[1 + i], types.uint32)
                        for i in range(4)]
                b = _as(context, builder, args[5], sig.args[5], types.uint64)
                s = _as(context, builder, args[6], sig.args[6], types.int32)
                return _tied(context, builder, acc, args[0], text, [*regs, b, s], "rrrrlr")

            return sig, codegen

        wgmma_rs.__doc__ = (f"m64nNk16 {kind} wgmma, A from registers (a_coords), B from a "
                            "shared-memory descriptor; returns the new accumulators.")
        return wgmma_rs

    wgmma_ss_bf16 = _ss_intrinsic("bf16")
    wgmma_ss_f16 = _ss_intrinsic("f16")
    wgmma_rs_bf16 = _rs_intrinsic("bf16")
    wgmma_rs_f16 = _rs_intrinsic("f16")
