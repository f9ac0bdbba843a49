"""Hopper pipelines from Numba: mbarriers, named barriers and register reallocation (inline
PTX), and the ring of shared-memory stages they guard, as plain index arithmetic.

- ``mbarrier_init(smem, idx, count)``: ``mbarrier.init.shared::cta.b64`` of the 8-byte
  barrier at element ``idx`` of the shared pointer ``smem`` (``convert.smem_pointer``),
  expecting ``count`` arrivals per phase. One thread initializes; a ``syncthreads``
  publishes it before anyone arrives or waits.
- ``mbarrier_arrive(smem, idx)``: one arrival (release semantics, CTA scope).
- ``cp_async_arrive(smem, idx)``: ``cp.async.mbarrier.arrive.noinc``: one arrival, made by
  the hardware once every ``cp.async`` this thread issued before it has landed (``noinc``:
  the arrival is one of the ``count`` expected, as a plain arrive). The copies need no
  commit group and no wait in the copying thread.
- ``mbarrier_wait(smem, idx, parity)``: spin on ``mbarrier.try_wait.parity`` until the
  phase of parity ``parity`` (0 or 1, the phase's number mod 2) has completed (acquire
  semantics, CTA scope).
- ``named_sync(id, count)`` / ``named_arrive(id, count)``: ``bar.sync`` / ``bar.arrive`` on
  hardware barrier ``id`` (a literal, 1..15; ``syncthreads`` is 0) with ``count`` threads
  (a literal multiple of 32) taking part: ``bar.arrive`` counts without waiting, so two
  warpgroups can take turns (one waits on its barrier, the other arrives on it).
- ``st_shared_f32(smem, idx, value)``: one ``st.shared.f32`` at 16-bit element ``idx``
  (even) of ``smem``; ``st_shared_u32(smem, idx, bits)`` likewise for a 32-bit word (two
  packed 16-bit elements, ``idx`` low); ``ld_shared_f32(smem, idx)`` reads an fp32 there,
  ``ld_shared_u32(smem, idx)`` a 32-bit word.
- ``counter_add(maps, n, value)``: ``atom.add.u32`` on the launch's scheduling counter
  ``n`` (32-bit words after the three tensor maps at ``maps``: ``COUNTERS_OFFSET``),
  returning the old value; ``counter_add_acq_rel`` the same with ``.acq_rel.gpu``
  semantics; ``counter_store(maps, n, value)`` writes one (``st.u32``).
- ``bulk_reduce_add_f32(dst, didx, smem, sidx, nbytes)``:
  ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: ``nbytes`` (a multiple
  of 16) of fp32 from shared element ``sidx`` added, element by element and atomically,
  into ``dst[didx:]`` (a float32 pointer) by the copy engine; the issuing thread goes on
  at once. Shared memory written by ordinary stores is published to the async proxy first
  (``fence.proxy.async``, then a barrier), as for a wgmma. ``bulk_commit()`` closes this
  thread's bulk group; ``bulk_wait_read(n)`` (a literal) waits until at most ``n`` of its
  groups still read their source (the buffer may be written again); ``bulk_wait(n)``:
  until they are done.
- ``mbarrier_expect_tx(smem, idx, nbytes)``: ``mbarrier.arrive.expect_tx``: one arrival,
  and ``nbytes`` more bytes the phase waits for (the phase completes once its arrivals are
  in and its bulk tensor copies have landed that many bytes).
- ``tma_load_4d(smem, sidx, maps, which, src, c0, c1, c2, c3, bar)``:
  ``cp.async.bulk.tensor.4d`` (the Tensor Memory Accelerator): the box of tensor map
  ``which`` (128-byte maps in global memory from ``maps``, an int32 pointer, on:
  ``tensor_maps.put``) at coordinates ``(c0, c1, c2, c3)`` (innermost first: column, row, head,
  batch) copied into shared memory at 16-bit element ``sidx`` of ``smem``, in the map's
  swizzle (128 bytes: the layout of ``device/wgmma``'s tiles), rows past the tensor's
  extent zero-filled, completing ``nbytes`` on the mbarrier at element ``bar`` (one
  thread issues it). ``src`` is the tensor's own pointer: unused on the GPU, read by the
  simulator's copy. ``fence_tensormap(maps, which)``: ``fence.proxy.tensormap::generic
  .acquire.gpu``, once per block in the issuing thread before its first copy through a map
  the host wrote.
- ``setmaxnreg_inc(n)`` / ``setmaxnreg_dec(n)``: ``setmaxnreg.{inc,dec}.sync.aligned.u32``
  (sm_90a; ``n`` a literal multiple of 8 in 24..256), the warpgroup's registers per thread
  raised or lowered; ptxas honours it only in kernels compiled with a register cap
  (launch bounds with min blocks) where each warpgroup's role is one branch (else warning
  C7508).

The ring: tile ``t`` of a ``STAGES``-deep ring sits in stage ``t % STAGES``
(:func:`stage_of`); the barriers of that stage complete once per use, so the consumer of
tile ``t`` waits for parity ``(t // STAGES) & 1`` of its "full" barrier and the producer of
tile ``t >= STAGES`` for parity ``(t // STAGES - 1) & 1`` of its "empty" barrier (the
release of tile ``t - STAGES``): :func:`full_parity`, :func:`empty_parity`.

A cp.async copy writes through the generic proxy; a wgmma reads through the async proxy: the
consumer runs ``wgmma.fence_proxy_async`` after its wait and before its wgmmas (the copying
threads cannot: they do not wait for their copies).

The CUDA simulator has none of these: there the device names are ``device/sim_pipeline.py``'s
emulations (the same semantics on the simulator's threads, per block; a wait that can never
complete fails instead of hanging; ``setmaxnreg`` does nothing). The ring arithmetic works
everywhere.
"""
from __future__ import annotations

from numba import int32, uint32

from .convert import SIMULATOR, device_function

__all__ = [
    "MBARRIER_BYTES",
    "bulk_commit",
    "bulk_reduce_add_f32",
    "bulk_wait",
    "bulk_wait_read",
    "cp_async_arrive",
    "empty_parity",
    "ld_shared_f32",
    "ld_shared_u32",
    "counter_add",
    "counter_add_acq_rel",
    "counter_store",
    "COUNTERS_OFFSET",
    "full_parity",
    "fence_tensormap",
    "mbarrier_arrive",
    "mbarrier_expect_tx",
    "mbarrier_init",
    "mbarrier_wait",
    "named_arrive",
    "named_sync",
    "setmaxnreg_dec",
    "setmaxnreg_inc",
    "st_shared_f32",
    "st_shared_u32",
    "stage_of",
    "tma_load_4d",
]

#: Bytes of one tensor map (CUtensorMap), 64-byte aligned in global memory.
TENSOR_MAP_BYTES = 128
#: Where a launch's scheduling counters start, after its three tensor maps (bytes).
COUNTERS_OFFSET = 3 * TENSOR_MAP_BYTES

#: Bytes of one mbarrier (8-byte aligned).
MBARRIER_BYTES = 8


@device_function
def stage_of(t, STAGES):
    """The stage that holds tile ``t`` of a ``STAGES``-deep ring. (Tile counts fit 32 bits:
    unsigned 32-bit division by the constant is a multiply-high; the 64-bit signed one
    that ``t``'s own type would take cost ~20 instructions, several times a tile.)"""
    return int32(uint32(t) % uint32(STAGES))


@device_function
def full_parity(t, STAGES):
    """The parity of the "full" phase that says tile ``t`` has landed."""
    return int32((uint32(t) // uint32(STAGES)) & uint32(1))


@device_function
def empty_parity(t, STAGES):
    """The parity of the "empty" phase that frees tile ``t``'s stage for it (``t >=
    STAGES``: the release of tile ``t - STAGES``)."""
    return int32(((uint32(t) // uint32(STAGES)) + uint32(1)) & uint32(1))


if SIMULATOR:
    # (the same semantics on the simulator's threads: device/sim_pipeline.py)
    from .sim_pipeline import (  # noqa: F401
        bulk_commit,
        bulk_reduce_add_f32,
        bulk_wait,
        bulk_wait_read,
        counter_add,
        counter_add_acq_rel,
        counter_store,
        cp_async_arrive,
        fence_tensormap,
        ld_shared_f32,
        ld_shared_u32,
        mbarrier_arrive,
        mbarrier_expect_tx,
        mbarrier_init,
        mbarrier_wait,
        named_arrive,
        named_sync,
        setmaxnreg_dec,
        setmaxnreg_inc,
        st_shared_f32,
        st_shared_u32,
        tma_load_4d,
    )

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)

    def _asm(builder, args, text, constraints):
        fty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
        builder.call(ir.InlineAsm(fty, text, constraints, side_effect=True), args)

    def _shared_u32(builder, ptr, idx):
        p = builder.bitcast(builder.gep(ptr, [idx]), ir.IntType(8).as_pointer())
        s = builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3))
        return builder.ptrtoint(s, _I32)

    def _literal(x):
        if isinstance(x, (types.IntegerLiteral, types.BooleanLiteral)):
            return int(x.literal_value)
        return None

    def _barrier_op(text, nargs, doc):
        """An intrinsic ``fn(smem, idx[, value])``: ``text`` with ``$0`` the barrier's
        32-bit shared address and ``$1`` the value (an int32)."""
        if nargs == 2:
            @intrinsic
            def fn(typingctx, smem, idx):
                if not isinstance(smem, types.CPointer) or not isinstance(idx, types.Integer):
                    return None

                def codegen(context, builder, sig, args):
                    _asm(builder, [_shared_u32(builder, args[0], args[1])], text,
                         "r,~{memory}")
                    return context.get_dummy_value()

                return types.void(smem, idx), codegen
        else:
            @intrinsic
            def fn(typingctx, smem, idx, value):
                if (not isinstance(smem, types.CPointer) or not isinstance(idx, types.Integer)
                        or not isinstance(value, types.Integer)):
                    return None

                def codegen(context, builder, sig, args):
                    v = context.cast(builder, args[2], sig.args[2], types.int32)
                    _asm(builder, [_shared_u32(builder, args[0], args[1]), v], text,
                         "r,r,~{memory}")
                    return context.get_dummy_value()

                return types.void(smem, idx, value), codegen

        fn.__doc__ = doc
        return fn

    mbarrier_init = _barrier_op("mbarrier.init.shared::cta.b64 [$0], $1;", 3,
                                "Initialize the mbarrier for ``value`` arrivals a phase.")
    mbarrier_arrive = _barrier_op("mbarrier.arrive.shared::cta.b64 _, [$0];", 2,
                                  "One arrival on the mbarrier.")
    mbarrier_expect_tx = _barrier_op(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", 3,
        "One arrival, and ``value`` bytes of bulk copies the phase waits for.")
    cp_async_arrive = _barrier_op("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", 2,
                                  "One arrival once this thread's cp.async copies landed.")
    # (the labels are local to the braces: every inlined copy has its own)
    mbarrier_wait = _barrier_op(
        "{ .reg .pred P1; LAB_WAIT: "
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [$0], $1; "
        "@P1 bra DONE; bra LAB_WAIT; DONE: }", 3,
        "Wait until the phase of parity ``value`` has completed.")

    def _literal_op(make, doc):
        """An intrinsic of one or two literal ints: the void asm ``make(*values)``."""
        def typer(*lits):
            vals = [_literal(x) for x in lits]
            if any(v is None for v in vals):
                return None
            text = make(*vals)

            def codegen(context, builder, sig, args):
                _asm(builder, [], text, "~{memory}")
                return context.get_dummy_value()

            return types.void(*lits), codegen

        if make.__code__.co_argcount == 1:
            @intrinsic
            def fn(typingctx, a):
                return typer(a)
        else:
            @intrinsic
            def fn(typingctx, a, b):
                return typer(a, b)

        fn.__doc__ = doc
        return fn

    named_sync = _literal_op(lambda i, n: f"bar.sync {i}, {n};",
                             "``bar.sync id, count``: wait on named barrier ``id``.")
    named_arrive = _literal_op(lambda i, n: f"bar.arrive {i}, {n};",
                               "``bar.arrive id, count``: count on ``id`` without waiting.")
    setmaxnreg_inc = _literal_op(lambda n: f"setmaxnreg.inc.sync.aligned.u32 {n};",
                                 "Raise this warpgroup's registers per thread to ``n``.")
    setmaxnreg_dec = _literal_op(lambda n: f"setmaxnreg.dec.sync.aligned.u32 {n};",
                                 "Lower this warpgroup's registers per thread to ``n``.")
    bulk_wait_read = _literal_op(lambda n: f"cp.async.bulk.wait_group.read {n};",
                                 "Wait until at most ``n`` bulk groups read their source.")
    bulk_wait = _literal_op(lambda n: f"cp.async.bulk.wait_group {n};",
                            "Wait until at most ``n`` bulk groups are pending.")

    @intrinsic
    def bulk_commit(typingctx):
        """Close this thread's bulk group."""
        def codegen(context, builder, sig, args):
            _asm(builder, [], "cp.async.bulk.commit_group;", "~{memory}")
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def ld_shared_f32(typingctx, smem, idx):
        """The fp32 at 16-bit element ``idx`` (even) of ``smem`` (``ld.shared.f32``)."""
        if not isinstance(smem, types.CPointer):
            return None

        def codegen(context, builder, sig, args):
            p = builder.bitcast(builder.gep(args[0], [args[1]]), ir.FloatType().as_pointer())
            return builder.load(p, align=4)

        return types.float32(smem, idx), codegen

    @intrinsic
    def ld_shared_u32(typingctx, smem, idx):
        """The 32-bit word at 16-bit element ``idx`` (even) of ``smem``."""
        if not isinstance(smem, types.CPointer):
            return None

        def codegen(context, builder, sig, args):
            p = builder.bitcast(builder.gep(args[0], [args[1]]), _I32.as_pointer())
            return builder.load(p, align=4)

        return types.uint32(smem, idx), codegen

    def _counter_address(context, builder, sig, maps, n):
        """The 64-bit generic address of counter ``n`` after the tensor maps at ``maps``."""
        base = builder.ptrtoint(maps, ir.IntType(64))
        w = context.cast(builder, n, sig.args[1], types.int64)
        return builder.add(base, builder.add(ir.Constant(ir.IntType(64), COUNTERS_OFFSET),
                                             builder.mul(w, ir.Constant(ir.IntType(64), 4))))

    def _counter_op(text, returns):
        """An intrinsic ``fn(maps, n, value)``: inline PTX ``text`` on counter ``n`` (its
        address, then ``value`` as a u32; ``returns``: the instruction's u32 result)."""
        @intrinsic
        def op(typingctx, maps, n, value):
            if not isinstance(maps, types.CPointer):
                return None

            def codegen(context, builder, sig, args):
                addr = _counter_address(context, builder, sig, args[0], args[1])
                v = context.cast(builder, args[2], sig.args[2], types.uint32)
                if not returns:
                    _asm(builder, [addr, v], text, "l,r,~{memory}")
                    return context.get_dummy_value()
                fty = ir.FunctionType(_I32, [addr.type, _I32])
                return builder.call(ir.InlineAsm(fty, text, "=r,l,r,~{memory}",
                                                 side_effect=True), [addr, v])

            return (types.uint32 if returns else types.void)(maps, n, value), codegen

        return op

    #: ``atom.add.u32`` on counter ``n``: its old value.
    counter_add = _counter_op("atom.add.u32 $0, [$1], $2;", True)
    #: the same with acquire-release semantics at GPU scope (a block's count of its end,
    #: ordered after its own takes from counter 0 for the last block's reset)
    counter_add_acq_rel = _counter_op("atom.acq_rel.gpu.add.u32 $0, [$1], $2;", True)
    #: ``st.u32`` of ``value`` into counter ``n``.
    counter_store = _counter_op("st.u32 [$0], $1;", False)

    def _st_shared(ty, kind, reg):
        """An intrinsic ``fn(smem, idx, value)``: ``st.shared.{kind}`` of a ``ty`` at 16-bit
        element ``idx`` of ``smem`` (``reg``: the value's inline-asm constraint)."""
        text = f"st.shared.{kind} [$0], $1;"

        @intrinsic
        def fn(typingctx, smem, idx, value):
            if not isinstance(smem, types.CPointer) or value != ty:
                return None

            def codegen(context, builder, sig, args):
                _asm(builder, [_shared_u32(builder, args[0], args[1]), args[2]], text,
                     f"r,{reg},~{{memory}}")
                return context.get_dummy_value()

            return types.void(smem, idx, value), codegen

        return fn

    st_shared_u32 = _st_shared(types.uint32, "b32", "r")
    st_shared_f32 = _st_shared(types.float32, "f32", "f")

    @intrinsic
    def bulk_reduce_add_f32(typingctx, dst, didx, smem, sidx, nbytes):
        """``dst[didx:] += `` ``nbytes`` of fp32 at shared element ``sidx`` (bulk, async)."""
        if not (isinstance(dst, types.CPointer) and isinstance(smem, types.CPointer)):
            return None

        def codegen(context, builder, sig, args):
            d, di, sm, si, n = args
            g = builder.ptrtoint(builder.gep(d, [di]), ir.IntType(64))
            nb = context.cast(builder, n, sig.args[4], types.uint32)
            _asm(builder, [g, _shared_u32(builder, sm, si), nb],
                 "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; "
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [ga], [$1], $2; }",
                 "l,r,r,~{memory}")
            return context.get_dummy_value()

        return types.void(dst, didx, smem, sidx, nbytes), codegen

    def _map_address(context, builder, sig, maps, which, i_maps, i_which):
        """The 64-bit generic address of tensor map ``which`` of the array at ``maps``."""
        base = builder.ptrtoint(maps, ir.IntType(64))
        w = context.cast(builder, which, sig.args[i_which], types.int64)
        return builder.add(base, builder.mul(w, ir.Constant(ir.IntType(64),
                                                             TENSOR_MAP_BYTES)))

    @intrinsic
    def tma_load_4d(typingctx, smem, sidx, maps, which, src, c0, c1, c2, c3, bar):
        """Tensor map ``which``'s box at (c0, c1, c2, c3) into ``smem[sidx:]`` (async;
        completes bytes on the mbarrier at ``smem[bar]``)."""
        if not (isinstance(smem, types.CPointer) and isinstance(maps, types.CPointer)):
            return None

        def codegen(context, builder, sig, args):
            sm, si, mp, wh, _, x0, x1, x2, x3, bi = args
            addr = _map_address(context, builder, sig, mp, wh, 2, 3)
            # (the coordinates are 32-bit operands: cut inside the asm, so that no 32-bit
            # copy of a 64-bit index is left where address arithmetic could pick it up)
            xs = [context.cast(builder, x, sig.args[5 + n], types.int64)
                  for n, x in enumerate((x0, x1, x2, x3))]
            _asm(builder, [_shared_u32(builder, sm, si), addr, *xs,
                           _shared_u32(builder, sm, bi)],
                 "{ .reg .b32 c<4>; cvt.u32.u64 c0, $2; cvt.u32.u64 c1, $3; "
                 "cvt.u32.u64 c2, $4; cvt.u32.u64 c3, $5; "
                 "cp.async.bulk.tensor.4d.shared::cluster.global.tile"
                 ".mbarrier::complete_tx::bytes [$0], [$1, {c0, c1, c2, c3}], [$6]; }",
                 "r,l,l,l,l,l,r,~{memory}")
            return context.get_dummy_value()

        return types.void(smem, sidx, maps, which, src, c0, c1, c2, c3, bar), codegen

    @intrinsic
    def fence_tensormap(typingctx, maps, which):
        """Acquire tensor map ``which`` (written by the host) for this thread's copies."""
        if not isinstance(maps, types.CPointer):
            return None

        def codegen(context, builder, sig, args):
            addr = _map_address(context, builder, sig, args[0], args[1], 0, 1)
            _asm(builder, [addr], "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                 "l,~{memory}")
            return context.get_dummy_value()

        return types.void(maps, which), codegen
