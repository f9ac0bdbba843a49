"""A mask_mod's tile classes as the kernels read them (``flashcore._mods``: EMPTY, PARTIAL
or FULL per ``BLOCK x BLOCK`` tile of one batch entry and head).

- A BlockMask's classes are uploaded once per GPU and adapter (:data:`_UPLOADED`).
- Without one, a call evaluates them on the GPU (:func:`launch_classify`, the kernel of
  ``simt/classify.py``) on its stream, before the attention kernels that read them: no copy
  of the mod_args to the host, no wait for the GPU (nothing in it stands in the way of
  capturing the step in a CUDA graph; not tested). Only the batch entries and heads the mask reads are evaluated
  (``_mods.class_shape``: a document mask that never reads ``h`` is evaluated once for
  all heads). Past :data:`DEVICE_EVALS` evaluations per call the classes are kept by the
  contents of the mod_args instead (a mask that reads ``h``, at B=4 H=16 N=8192, would
  take ~10 ms per call), evaluated on the GPU where they are new.
- A varlen call's classes are evaluated inside each sequence's own ends (the offsets
  bound its rows and keys, as the attention kernels ask the mask), one table per
  sequence; tiles past a sequence's end are EMPTY.
- An adapter that cannot allocate (JAX under ``jit``: XLA lends every buffer) evaluates
  them on the host from copies of the mod_args (``_mods.block_classes``, kept by their
  contents), then uploads them.
"""
from __future__ import annotations

import numpy as np

from flashcore import _interop, _mods
from flashcore._memo import Memo
from flashcore._packed_checks import sequence_lengths

from . import launch, launch_args
from .driver import synchronize
from .variant import UserMods, Variant

#: Calls whose classes take more evaluations of the mask than this (batch entries x heads x
#: Nq x Nk, of those the mask reads: ``_mods.class_shape``; about 1 ms of an H200) keep them
#: by the contents of their mod_args instead (``_mods.block_classes``: a copy to the host and
#: a wait per call, then no evaluation where the arrays repeat; a miss is evaluated on the
#: GPU and its classes copied back to be kept).
DEVICE_EVALS = 1 << 30
#: Fewest threads per block of the classification kernel (one block per tile, at least a
#: thread per key of it; the simulator runs each thread as a Python thread).
MIN_THREADS = 32


def tile_classes(ad, case, like, keep, margs):
    """``(handle, batch stride, head stride, query-block stride)`` of the call's tile
    classes for adapter ``ad`` (``like``: an input on the call's device; ``margs``: the
    mod_args as the kernels take them, ``launch_args.mod_args``, or None), or None
    without a mask_mod."""
    m = case.mods
    if m is None or m.mask_mod is None:
        return None
    if m.block_mask is not None:
        host = m.block_mask.classes
    else:
        block = _mods.BLOCK
        nb, nh = _mods.class_shape(m.mask_mod, case.batch, case.heads_q)
        varlen = case.varlen is not None and ad.allocates
        if varlen:  # (the GPU asks each sequence inside its own ends: classes per sequence)
            nb = case.batch
        shape = (nb, nh, -(-case.seqlen_q // block), -(-case.seqlen_k // block))
        if ad.allocates and nb * nh * case.seqlen_q * case.seqlen_k <= DEVICE_EVALS:
            return _evaluated(ad, case, like, keep, margs, shape)[1]
        evaluate = lengths = None
        if ad.allocates:  # (a miss: evaluated here, then copied to the host to be kept)
            def evaluate():
                buf = _evaluated(ad, case, like, keep, margs, shape)[0]
                dev = ad.device_index(case)
                synchronize(ad.stream(like, dev), dev)  # (JAX copies on a stream of its own)
                return np.ascontiguousarray(ad.host_copy(buf, case), np.int8)
            if varlen:  # (such classes depend on the sequences' lengths: kept by them too)
                lengths = sequence_lengths(case.varlen, case.library)
        args = tuple(np.ascontiguousarray(ad.host_copy(a, case)) for a in case.mod_args)
        host = _mods.block_classes(m.mask_mod, case.batch, case.heads_q, case.seqlen_q,
                                   case.seqlen_k, block, args, remember=True,
                                   evaluate=evaluate, lengths=lengths)
    key = (id(host), type(ad).__name__, case.device)
    hit = _UPLOADED.get(key)
    if hit is None or hit[0] is not host:
        if len(_UPLOADED) >= _UPLOADED.max_size:
            _UPLOADED.clear()
        hit = (host, ad.upload(host, like))
        _UPLOADED[key] = hit
    keep.append(hit[1])
    return (ad.address(hit[1], keep), *_strides(host.shape))


#: (id of host classes, adapter, device) -> (host classes, device copy), bounded.
_UPLOADED = Memo(64)


def _strides(shape):
    """The batch, head and query-block strides of classes of ``shape`` (0 along an axis of
    one: every batch entry or head reads the same classes)."""
    nb, nh, nq, nk = shape
    return 0 if nb == 1 else nh * nq * nk, 0 if nh == 1 else nq * nk, nk


def _evaluated(ad, case, like, keep, margs, shape):
    """The classes of ``shape`` evaluated on the GPU on the call's stream (a varlen call's
    inside each sequence's ends): ``(buffer, (handle, strides...))``."""
    dev = ad.device_index(case)
    buf = ad.empty(like, shape, "int8", dev, poison=False)
    keep.append(buf)
    at = ad.address(buf, keep)
    if int(np.prod(shape)):
        vl = case.varlen
        cu = None if vl is None else (ad.int32(vl.cu_seqlens_q, keep),
                                      ad.int32(vl.cu_seqlens_k, keep))
        launch_classify(case.mods.mask_mod, launch.mod_arg_kinds(case.mod_args), case.dtype,
                        case.seqlen_q, case.seqlen_k, dev, ad.stream(like, dev), at, shape,
                        _mods.BLOCK, margs or launch_args.no_mod_args(at), cu)
    return buf, (at, *_strides(shape))


def launch_classify(mask_mod, kinds, dtype, Nq, Nk, device, stream, classes, shape, block,
                    margs, cu=None):
    """Launch the classification of ``mask_mod`` (mod_args of ``kinds``, as the attention
    kernels of ``dtype`` ask it) on ``Nq`` query rows and ``Nk`` keys into ``classes``
    (the handle of a C-contiguous int8 buffer of ``shape``, tiles of ``block`` rows and
    keys, a power of two); ``cu``: the handles of a varlen call's int32 offsets, whose
    sequences bound each batch entry's rows and keys instead. A mask_mod that does not
    compile for the GPU is a TypeError saying so."""
    v = classify_variant(mask_mod, kinds, dtype, block, varlen=cu is not None)
    try:
        kern = launch.kernel(v, device)
    except Exception as err:  # numba's typing and lowering errors
        if type(err).__module__.startswith("numba"):
            raise _mods.compile_error("mask_mod", mask_mod, err) from None
        raise
    if cu is None:
        cu = (launch_args.no_slopes(classes)[0],) * 2  # (never read)
    nb, nh, nq, nk = shape
    kern((nb * nh * nq * nk, 1), stream, (classes, nb, nh, Nq, Nk, nq, nk,
                                          block.bit_length() - 1, *margs, *cu))


def on_device(ad, mask_mod, shape, Nq, Nk, block, mod_args, library, device):
    """The classes of ``shape`` of ``mask_mod`` evaluated on GPU ``device`` (an index)
    where its ``mod_args`` (arrays of ``library``, at least one) live, copied to the host
    (create_block_mask's evaluation: one wait)."""
    keep = []
    like = mod_args[0]
    buf = ad.empty(like, shape, "int8", device, poison=False)
    at = ad.address(buf, keep)
    if int(np.prod(shape)):
        stream = ad.stream(like, device)
        launch_classify(mask_mod, launch.mod_arg_kinds(mod_args), "float32", Nq, Nk, device,
                        stream, at, shape, block, ad.mod_arrays(mod_args, keep))
        synchronize(stream, device)  # (JAX copies on a stream of its own)
    return np.ascontiguousarray(_interop.copy_to_host(buf, library), np.int8)


def classify_variant(mask_mod, kinds, dtype, block, varlen=False):
    """The classification kernel's variant for ``mask_mod`` with mod_args of ``kinds``
    (``launch.mod_arg_kinds``) in a call of ``dtype``, for tiles of ``block`` keys (a power
    of two): the twin of the mask the attention kernels of that dtype ask (fp16 and bf16
    share one), a thread per key; ``varlen``: bounded by each sequence's offsets."""
    return Variant("classify", "simt", 0, "float32" if dtype == "float32" else "float16",
                   False, max(MIN_THREADS, block), user=UserMods(None, mask_mod, kinds),
                   packed="varlen" if varlen else "")
