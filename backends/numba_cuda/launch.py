"""Host side of the kernels: which variant serves a launch, the variants a case compiles,
and the launches on the caller's stream.

A launch goes (case, buffers) -> plan -> :class:`driver.Prepared` kernels -> launch. The
plan picks the family: the tensor-core kernels (``tensor_core/``) for fp16/bf16 where
:func:`tc_serves` (the wgmma ones, ``hopper/``, where also :func:`hopper_serves` or
:func:`hopper_bwd_serves`), else the SIMT kernels (``simt/``; cp.async tiles for aligned
fp32 rows); it is cached per kind of call (:data:`_PLANS`), so a repeated call only looks
it up. Both families take the same launch arguments. Buffers are ``(handle, strides)``
views: an address (on the GPU) or a flat NumPy array (under the simulator) plus strides in
elements in (B, H, N, D) order, whatever the caller's layout.
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace

from flashcore._memo import Memo, clear_all

from . import driver, tensor_maps, tilings
from .device.convert import SIMULATOR
from .driver import Prepared, device_cc, device_name, prepared
from .hopper import backward as _hop_bwd
from .hopper import forward as _hop_fwd
from .hopper import persistent as _hop_ps
from .hopper import pingpong as _hop_pp
from .launch_args import (  # noqa: F401 (re-exported: launch.no_slopes, ...)
    _grid,
    bhnd,
    host_flat,
    launch_dkdv,
    launch_dq,
    launch_forward,
    launch_preprocess,
    no_classes,
    no_mod_args,
    no_packed,
    no_slopes,
    packed_args,
    rows_aligned,
    signature,
)
from .simt import backward as _simt_bwd
from .simt import cache as _simt_cache
from .simt import classify as _simt_cls
from .simt import dq_convert as _simt_dqc
from .simt import forward as _simt_fwd
from .tensor_core import backward as _tc_bwd
from .tensor_core import forward as _tc_fwd
from .variant import UserMods, Variant

#: Environment switch: the tensor-core kernels serve fp16/bf16 by default;
#: ``FLASHCORE_TENSOR_CORES=0`` selects the SIMT kernels instead.
TC_ENV = "FLASHCORE_TENSOR_CORES"
#: Environment switch: the wgmma forward (hopper/) serves the forwards it can on an sm_90
#: GPU by default (it passed on an H100 and is 1.05-1.36x faster than the mma.sync forward
#: there: notes/hopper_forward_2026-11-24.md); ``FLASHCORE_HOPPER=0`` selects the mma.sync
#: forward instead; read per call.
HOPPER_ENV = "FLASHCORE_HOPPER"
#: Environment switch of the wgmma backward alone (hopper/backward.py): it serves where the
#: wgmma forward would (so ``FLASHCORE_HOPPER=0`` turns both off); ``FLASHCORE_HOPPER_BWD=0``
#: keeps the mma.sync backward while the wgmma forward serves; read per call.
HOPPER_BWD_ENV = "FLASHCORE_HOPPER_BWD"
#: Environment switch of the backward's non-deterministic mode: ``FLASHCORE_DETERMINISTIC=0``
#: lets the wgmma dK/dV kernel add dQ's parts into a float32 accumulator by atomics
#: ("dkdvq", hopper/dq_atomic.py) instead of the dQ kernel recomputing S and dP; dQ may then
#: differ in its last bits from run to run. Read per call; dense calls without a window.
#: Experimental: 1.08-1.29x slower than the deterministic backward on an H100 so far.
DETERMINISTIC_ENV = "FLASHCORE_DETERMINISTIC"
_TC_DTYPES = ("float16", "bfloat16")

#: (family, kernel) -> factory of the Python kernel function of a variant
FACTORIES = {
    ("simt", "forward"): _simt_fwd.make_attn_forward,
    ("simt", "preprocess"): _simt_bwd.make_attn_backward_preprocess,
    ("simt", "dkdv"): _simt_bwd.make_attn_backward_dkdv,
    ("simt", "dq"): _simt_bwd.make_attn_backward_dq,
    ("tensor_core", "forward"): _tc_fwd.make_attn_forward_tc,
    ("tensor_core", "dkdv"): _tc_bwd.make_attn_backward_dkdv_tc,
    ("tensor_core", "dq"): _tc_bwd.make_attn_backward_dq_tc,
    ("hopper", "forward"): lambda var: (_hop_ps.make_attn_forward_wgmma_persistent
                                        if var.tiles.persistent
                                        else _hop_pp.make_attn_forward_wgmma_pingpong
                                        if var.tiles.pingpong
                                        else _hop_fwd.make_attn_forward_wgmma)(var),
    ("hopper", "dkdv"): _hop_bwd.make_attn_backward_dkdv_wgmma,
    ("hopper", "dq"): _hop_bwd.make_attn_backward_dq_wgmma,
    ("hopper", "dkdvq"): _hop_bwd.make_attn_backward_dkdv_wgmma,
    ("simt", "dqconvert"): _simt_dqc.make_dq_convert,
    ("simt", "merge"): _simt_cache.make_attn_merge_splits,
    ("simt", "append"): _simt_cache.make_cache_append,
    ("simt", "classify"): _simt_cls.make_tile_classify,
}


@functools.cache
def build(v: Variant):
    """The Python kernel function of variant ``v`` (one per variant, so numba compiles
    each once per process)."""
    return FACTORIES[v.family, v.kernel](v)


def kernel(v: Variant, device: int) -> Prepared:
    """Variant ``v`` compiled and loaded on GPU ``device`` (once per process)."""
    return prepared((v, device), lambda: Prepared(
        build(v), signature(v.entry, v.dtype, v.user.args if v.user else (), v.split), v.threads,
        v.smem_words, device, v.launch_bounds, cache_key=cache_key(v)))


def cache_key(v: Variant) -> str | None:
    """The disk-cache key of variant ``v``'s kernel (driver.VariantCache): the variant (a
    frozen dataclass of plain values) and the backend's sources; None for a variant with
    the user's mods, which is never cached (its functions are not part of the key)."""
    if v.user is not None:
        return None
    import hashlib

    return hashlib.sha256(f"{v!r}|{driver.sources_digest()}".encode()).hexdigest()


# --- which variants serve a case ------------------------------------------------------------


def tc_enabled() -> bool:
    return os.environ.get(TC_ENV, "1") != "0"


def _gpu(device):
    """(compute capability, name) of GPU ``device``; (None, None) in the simulator."""
    if SIMULATOR:
        return None, None
    return device_cc(device), device_name(device)


@functools.cache
def _tc_tiles(kernel, head_dim, dtype, causal, device):
    cc, gpu = _gpu(device)
    return tilings.choose_tc(kernel, head_dim, dtype, causal, cc, gpu=gpu, simulator=SIMULATOR)


def tc_serves(case, device, q, k, v, do=None) -> bool:
    """Whether the tensor-core kernels take this launch (``do`` given: the backward):
    fp16/bf16, a head dim they are built for (tilings.HEAD_DIMS), compute capability 8.0
    or newer, a tiling that fits this GPU for every kernel of the pass, and rows that are
    16-byte aligned with unit stride along the head dim (cp.async copies 16 bytes) for
    every input the kernels copy."""
    if (case.dtype not in _TC_DTYPES or case.head_dim not in tilings.HEAD_DIMS
            or not tc_enabled()):
        return False
    if not SIMULATOR and device_cc(device) < (8, 0):
        return False
    names = ("dkdv", "dq") if do is not None else ("forward",)
    if any(_tc_tiles(n, case.head_dim, case.dtype, case.causal, device) is None
           for n in names):
        return False
    sq = (case.batch, case.heads_q, case.seqlen_q)
    skv = (case.batch, case.heads_kv, case.seqlen_k)
    return (rows_aligned(q, sq, 8) and rows_aligned(k, skv, 8) and rows_aligned(v, skv, 8)
            and (do is None or rows_aligned(do, sq, 8)))


def hopper_serves(case, device) -> bool:
    """Whether the wgmma forward (hopper/forward.py) takes a forward the tensor-core
    kernels take (:func:`tc_serves` first): unless ``FLASHCORE_HOPPER=0``, compute capability
    exactly 9.0 (wgmma is sm_90a only: numba-cuda builds a cc 9.x kernel for sm_9xa, and
    Blackwell has no wgmma), a head dim it is built for, and a dense or varlen call (masks
    and score modifiers included; KV-cache calls go to the mma.sync kernels)."""
    return not (SIMULATOR or os.environ.get(HOPPER_ENV, "1") == "0"
                or case.head_dim not in tilings.HOPPER_HEAD_DIMS
                or device_cc(device) != (9, 0) or packing(case) not in tilings.HOPPER_ROWS)


def hopper_bwd_serves(case, device) -> bool:
    """Whether the wgmma dK/dV and dQ kernels (hopper/backward.py) take a backward the
    tensor-core kernels take: where the wgmma forward serves (:func:`hopper_serves`), at a
    head dim they are built for (``HOPPER_BWD_HEAD_DIMS``), masks and modifiers included
    and the user's mods (dense and varlen rows), unless ``FLASHCORE_HOPPER_BWD=0``."""
    return not (os.environ.get(HOPPER_BWD_ENV, "1") == "0" or not hopper_serves(case, device)
                or case.head_dim not in tilings.HOPPER_BWD_HEAD_DIMS)


def fused_backward(case, device) -> bool:
    """Whether a backward takes the non-deterministic mode (:data:`DETERMINISTIC_ENV`): the
    wgmma backward serves it (:func:`hopper_bwd_serves`), dense rows, head dims up to 128
    (the dkdvq kernel has no two-pass form), no window (its dkdvq kernel has not run on a
    GPU), no ALiBi (its slopes' arguments carry the dQ accumulator there), no softcap (not
    run on a GPU in that kernel either) and no user mods (it takes none)."""
    m = mask_options(case)
    return (os.environ.get(DETERMINISTIC_ENV, "1") == "0" and not case.packed
            and case.head_dim <= 128 and hopper_bwd_serves(case, device) and m["window"] == ()
            and m["softcap"] == 0.0 and not m["alibi"] and m["user"] is None)


def hopper_variant(head_dim, dtype, causal, kernel="forward", window=(), softcap=0.0,
                   alibi=False, user=None, packed="", split=False, tma_ok=True,
                   long_keys=False):
    """The variant of wgmma kernel ``kernel`` (forward, dkdv, dq) of one case class (the mask
    options of :func:`mask_options`: the forward takes them all, varlen rows too, but a KV
    cache and split-KV; the backward varlen rows, a window, the softcap, ALiBi and the
    user's mods, and the dkdvq kernel none of the modifiers), or None where it has none.
    ``tma_ok`` False (a call below ``tilings.TMA_MIN_WORK``): a table tiling of bulk tensor
    copies is replaced by ``tilings.NO_TMA``'s. ``long_keys`` (a forward of
    ``tilings.LONG_KEYS_MIN`` keys or more, with ``tma_ok``, no masks): ``tilings.LONG_KEYS``'
    tiling where it has one. With ``tma_ok`` the persistent kernel's where they have one:
    ``tilings.PERSISTENT`` (dense rows, no masks), ``WINDOW_PERSISTENT`` (a window alone),
    ``VARLEN_PERSISTENT`` (varlen rows, no masks), ``MASK_MOD_PERSISTENT`` (a mask_mod and
    no score modifier)."""
    mods = bool(softcap) or alibi or user is not None
    masked = bool(window) or mods
    if (packed not in tilings.HOPPER_ROWS or split
            or (kernel == "dkdvq" and (mods or head_dim > 128))):
        return None
    score_mod = user is not None and user.score_mod is not None
    mask_mod = user is not None and user.mask_mod is not None
    t = tilings.choose_hopper(head_dim, causal, kernel, mask_mod, bool(softcap) or score_mod,
                              masked, long_keys and tma_ok and not masked,
                              tma_ok and not (masked or packed), user is not None,
                              packed == "varlen", bool(softcap or score_mod or window or alibi))
    if t is None:
        return None
    if kernel != "forward" and user is not None:  # (two buffers: an empty step is skipped)
        t = replace(t, stages=2)
    mask_alone = mask_mod and not (score_mod or softcap or alibi)  # (its classes cut keys)
    if kernel == "forward" and tma_ok:  # the persistent kernel's: a window alone (its
        # tiles' keys from the window's first tile), varlen rows, a mask_mod alone
        if window and not (mods or packed):
            t = tilings.WINDOW_PERSISTENT.get(head_dim, t)
        if packed == "varlen" and not masked:
            t = tilings.VARLEN_PERSISTENT.get((head_dim, bool(causal)), t)
        if mask_alone:
            t = tilings.MASK_MOD_PERSISTENT.get(head_dim, t)
    if t.persistent and ((mods and not mask_alone) or packed not in ("", "varlen")):
        t = replace(t, persistent=False, dynamic=False)
    if t.tma and not tma_ok:  # (a small call would pay more host time for the tensor maps
        # than they save: TMA_MIN_WORK)
        t = tilings.NO_TMA.get(head_dim, replace(t, tma=False, producer=False,
                                                   persistent=False, dynamic=False))
    if masked and kernel == "forward" and not mask_mod:  # (a mask_mod's: choose_hopper's)
        t = tilings.masked_tiles(t, score_mod, bool(softcap), bool(window), head_dim, alibi)
    return Variant(kernel, "hopper", head_dim, dtype, causal, t, window=window,
                   softcap=softcap, alibi=alibi, user=user, packed=packed)


def _fp32_rows_aligned(case, q, k, v, do=None) -> bool:
    """For fp32 calls, whether the arrays a kernel may stream (K and V; in the backward Q and
    dO too) have 16-byte aligned rows (:func:`rows_aligned`); True for other dtypes, whose
    tiles always go through registers."""
    if case.dtype != "float32":
        return True
    skv = (case.batch, case.heads_kv, case.seqlen_k)
    if not (rows_aligned(k, skv) and rows_aligned(v, skv)):
        return False
    sq = (case.batch, case.heads_q, case.seqlen_q)
    return do is None or (rows_aligned(q, sq) and rows_aligned(do, sq))


def simt_variants(head_dim, dtype, causal, kt, aligned=True, **mask):
    """The SIMT variants of one case class under tilings ``kt`` (tilings.KernelTiles):
    forward, preprocess, dK/dV, dQ. ``mask``: the Variant's mask fields (window, softcap,
    alibi; :func:`mask_options`)."""
    def one(kernel, t):
        return Variant(kernel, "simt", head_dim, dtype, causal, t,
                       tilings.streams(t, dtype, aligned), **mask)
    return [one("forward", kt.forward),
            Variant("preprocess", "simt", head_dim, dtype, False, kt.preprocess),
            one("dkdv", kt.dkdv), one("dq", kt.dq)]


def tc_variants(head_dim, dtype, causal, cc=None, gpu=None, simulator=False, decode=False,
                **mask):
    """The tensor-core variants of one case class (forward, dK/dV, dQ) with the tilings
    chosen for compute capability ``cc`` (the built-in tables if None; ``decode``: the
    forward takes :data:`tilings.DECODE_TC`); kernels without a fitting tiling are left
    out. ``mask`` as in :func:`simt_variants`."""
    out = []
    for name in ("forward", "dkdv", "dq"):
        t = tilings.choose_tc(name, head_dim, dtype, causal, cc, gpu=gpu, simulator=simulator)
        if decode and name == "forward" and t is not None and not simulator:
            t = tilings.DECODE_TC
        if t is not None:
            out.append(Variant(name, "tensor_core", head_dim, dtype, causal, t, **mask))
    return out


def case_variants(head_dim, dtype, causal, cc, aligned=True, **mask):
    """Every variant a case class may launch on compute capability ``cc``: the SIMT ones
    (fp32 streamed where ``aligned``) and, for fp16/bf16 at the head dims they serve, the
    tensor-core ones. The precompile list and the PTX tests enumerate exactly these."""
    kt = tilings.choose_simt(head_dim, dtype, causal, cc)
    out = simt_variants(head_dim, dtype, causal, kt, aligned, **mask)
    if dtype in _TC_DTYPES and head_dim in tilings.HEAD_DIMS:
        out += tc_variants(head_dim, dtype, causal, cc, **mask)
    return out


#: kind of call -> (kernels, block sizes) of its pass; a lookup by a tuple of plain values
_PLANS: dict = {}
#: kind of call -> what serves it (:func:`_serves`)
_SERVES = Memo(1024)


def bulk_copies_ok(case, stream, q, k, v, maps=None) -> bool:
    """Whether a forward may take a table tiling of bulk tensor copies (its tensor maps
    cost host time: tensor_maps.py): work B Hq Nq Nk D of at least
    ``tilings.TMA_MIN_WORK`` (varlen: total_q Hq max_seqlen_k D), views that can be tensor
    maps (``maps``: known already, :func:`_serves`), and (on a GPU) a stream not being
    captured into a CUDA graph (the maps' ring of slots is rewritten call by call, and
    waits on events, which a captured graph cannot take)."""
    rows = case.batch * case.seqlen_q if case.varlen is None else case.varlen.total_q
    return (rows * case.heads_q * case.seqlen_k * case.head_dim >= tilings.TMA_MIN_WORK
            and (maps if maps is not None else tensor_maps.serves(case, q, k, v))
            and (SIMULATOR or not driver.stream_capturing(stream)))


def _serves(direction, case, device, q, k, v, do, tiles, tc_ok) -> tuple:
    """``(tc, hopper, aligned, maps)`` of a call: :func:`tc_serves` (where ``tiles`` is None
    and ``tc_ok``), :func:`hopper_serves` (the forward's) or :func:`hopper_bwd_serves`,
    :func:`_fp32_rows_aligned` (and ``tc_ok``), and whether its views can be tensor maps
    (``tensor_maps.serves``). Every call pays host time (on an H200 host they were 20-25 µs
    of a 160 µs forward call), so the answers are kept per kind of call in
    :data:`_SERVES`, keyed by what those functions read: the case's dtype, head dim,
    causality, row layout and user mods, which of its sizes exceed 1, the device, the
    views' strides and addresses mod 16, and the three switches. (Not the case itself: it
    carries the call's arrays, and new lengths would make new keys.)"""
    if SIMULATOR:  # (a view's handle is an array there: no key)
        return _serves_now(direction, case, device, q, k, v, do, tiles, tc_ok)
    vl, mods = case.varlen, case.mods
    key = (direction, case.dtype, case.head_dim, case.causal, packing(case),
           mods is not None and (mods.score_mod is not None or mods.mask_mod is not None),
           case.batch > 1, case.heads_q > 1, case.heads_kv > 1, case.seqlen_q > 1,
           case.seqlen_k > 1, vl is None or (vl.total_q > 1, vl.total_k > 1), device,
           tiles is None, tc_ok, q[1], k[1], v[1], q[0] & 15, k[0] & 15, v[0] & 15,
           None if do is None else (do[1], do[0] & 15), os.environ.get(TC_ENV),
           os.environ.get(HOPPER_ENV), os.environ.get(HOPPER_BWD_ENV))
    return _SERVES.get_or_build(key, _serves_now, direction, case, device, q, k, v, do,
                                tiles, tc_ok)


def _serves_now(direction, case, device, q, k, v, do, tiles, tc_ok) -> tuple:
    tc = tiles is None and tc_ok and tc_serves(case, device, q, k, v, do)
    if direction == "forward":
        hop = tc and hopper_serves(case, device)
        aligned = tc_ok and _fp32_rows_aligned(case, q, k, v)
    else:
        hop = tc and hopper_bwd_serves(case, device)
        aligned = _fp32_rows_aligned(case, q, k, v, do)
    return tc, hop, aligned, hop and tensor_maps.serves(case, q, k, v)


def _plan(direction, case, device, tiles, aligned, tc, split=False, hopper=False,
          tma_ok=False):
    """``(forward kernel, block_m)`` or ``(preprocess, threads, dkdv, block_m, dq,
    block_m)`` for one kind of call (``split``: the split-KV forward; ``hopper``: the
    wgmma kernels, :func:`hopper_serves` / :func:`hopper_bwd_serves`; ``tma_ok``:
    :func:`bulk_copies_ok`, and then ``tilings.LONG_KEYS``' tiling for calls of
    ``tilings.LONG_KEYS_MIN`` keys or more)."""
    mask = mask_options(case)
    if split:
        mask["split"] = True
    decode = decodes(case)
    tma_ok = bool(tma_ok and hopper and direction == "forward")
    # (dense calls only: a varlen call's longest sequence says little of its others)
    long_keys = tma_ok and case.varlen is None and case.seqlen_k >= tilings.LONG_KEYS_MIN
    key = (direction, case.head_dim, case.dtype, case.causal, device, tiles, aligned, tc,
           decode, hopper, tma_ok, long_keys, *mask.values())
    plan = _PLANS.get(key)
    if plan is None:
        d, dt, c = case.head_dim, case.dtype, case.causal
        kt = tilings.choose_simt(d, dt, c, device_cc(device), simulator=SIMULATOR,
                                 override=tiles)
        simt = simt_variants(d, dt, c, kt, aligned, **mask)
        if tc:
            cc, gpu = _gpu(device)
            fam = tc_variants(d, dt, c, cc, gpu=gpu, simulator=SIMULATOR, decode=decode,
                              **mask)
        else:
            fam = [simt[0], simt[2], simt[3]]
        if hopper:
            pair = ("dkdvq", None) if direction == "fused" else ("dkdv", "dq")
            fam = ([hopper_variant(d, dt, c, **mask, tma_ok=tma_ok, long_keys=long_keys)]
                   if direction == "forward" else
                   [hopper_variant(d, dt, c, k_, **mask) if k_ else
                    Variant("dqconvert", "simt", d, dt, False, 256) for k_ in pair])
        chosen = [fam[0]] if direction == "forward" else [simt[1]] + fam[-2:]
        plan = tuple(x for v in chosen for x in (kernel(v, device), v.block_m))
        if direction == "forward":  # and the blocks of a persistent kernel (0: the grid's),
            # and the key tile of bulk tensor copies (0: none)
            hop = fam[0].family == "hopper"
            plan += (driver.sm_count(device) if hop and fam[0].tiles.persistent else 0,
                     fam[0].tiles.block_n if hop and fam[0].tiles.tma else 0)
        _PLANS[key] = plan
    return plan


def mask_options(case) -> dict:
    """The call's mask options as the Variant fields that take them, in a fixed order:
    ``window`` (() for none, else (left, right) with -1 for an unbounded side),
    ``softcap`` (0.0: none), ``alibi`` (whether the call has slopes), ``user`` (the
    score_mod / mask_mod and their arrays' kinds, a UserMods, or None)."""
    mods = case.mods
    window = () if mods is None or mods.window is None else mods.window_ints
    cap = 0.0 if mods is None or mods.softcap is None else float(mods.softcap)
    user = None
    if mods is not None and (mods.score_mod is not None or mods.mask_mod is not None):
        user = UserMods(mods.score_mod, mods.mask_mod, mod_arg_kinds(case.mod_args))
    return {"window": window, "softcap": cap, "alibi": case.alibi_slopes is not None,
            "user": user, "packed": packing(case)}


def decodes(case) -> bool:
    """Whether a forward is a decoding step that takes :data:`tilings.DECODE_TC`: a KV-cache
    call with at most 16 query rows per head (after the grouped heads are packed)."""
    return (case.kvcache is not None and case.seqlen_q <= 16
            and os.environ.get(tilings.DECODE_ENV, "1") != "0")


def packing(case) -> str:
    """The call's row layout as :attr:`Variant.packed`: "" (a dense batch), "varlen",
    "cache" or "paged"."""
    if case.varlen is not None:
        return "varlen"
    if case.kvcache is not None:
        return "paged" if case.kvcache.paged else "cache"
    return ""


def mod_arg_kinds(mod_args) -> tuple:
    """``(dtype name, ndim)`` of each mod_args array, as UserMods keeps them."""
    from flashcore._interop import dtype_name

    return tuple((dtype_name(a), len(a.shape)) for a in mod_args)


def forget_plans():
    """Drop the cached plans (after the autotuner wrote new tilings): also every Memo's
    (_SERVES, packed's kernel shapes, the front end's)."""
    _PLANS.clear()
    clear_all()
    _tc_tiles.cache_clear()
    tilings.forget_tuned()


def run_forward(case, device, stream, q, k, v, o, lse, tiles=None, slopes=None,
                margs=None, classes=None, packed=None, split=None, tc_ok=True):
    """Launch the forward: the tensor-core kernel where :func:`tc_serves`, else the SIMT
    kernel (always the SIMT kernel with an explicit SIMT ``tiles``); arguments as in
    :func:`launch_forward` (``slopes`` None: the call has no ALiBi; ``margs`` None: no
    mod_args). ``split``: ``(splits, chunk)`` of :func:`split_plan` (o and lse are then the
    float32 partials, ``packed`` carries their split strides). ``tc_ok`` False: a layout
    the alignment checks of the arrays alone do not see (a paged cache's page stride) rules
    out the 16-byte copies."""
    tc, hop, aligned, maps = _serves("forward", case, device, q, k, v, None, tiles, tc_ok)
    hop = hop and split is None
    kern, bm, ctas, tma = _plan("forward", case, device, tiles, aligned, tc,
                                split is not None, hop,
                                hop and maps and case.kvcache is None
                                and bulk_copies_ok(case, stream, q, k, v, True))
    slot = None
    if tma:  # (dense or varlen rows: the tensor maps where the block table goes)
        packed = list(no_packed(lse) if packed is None else packed)
        packed[3], slot = tensor_maps.put(case, device, stream, q, k, v, tma)
    try:
        launch_forward(kern, bm, case, stream, q, k, v, o, lse, slopes or no_slopes(lse),
                       margs or no_mod_args(lse), classes or no_classes(lse), packed,
                       1 if split is None else split[0], ctas)
    finally:  # (a slot is marked read by this launch whether or not it was queued)
        tensor_maps.used(device, stream, slot)


def forward_shape(case, device, q, k, v, tc_ok=True) -> tuple:
    """``(block_m, block_n, warps)`` of the forward kernel :func:`run_forward` would launch:
    query rows per block, keys per tile (split-KV ranges are whole tiles), warps per
    block."""
    if tc_ok and tc_serves(case, device, q, k, v):
        if hopper_serves(case, device):
            u = mask_options(case)["user"]
            t = tilings.choose_hopper(case.head_dim, case.causal, "forward",
                                      u is not None and u.mask_mod is not None)
            return t.block_m, t.block_n, t.warps
        t = (tilings.DECODE_TC if decodes(case) and not SIMULATOR
             else _tc_tiles("forward", case.head_dim, case.dtype, case.causal, device))
        return t.block_m, t.block_n, t.warps
    t = tilings.choose_simt(case.head_dim, case.dtype, case.causal, device_cc(device),
                            simulator=SIMULATOR).forward
    return t.block_m, t.block_n, -(-t.threads // 32)


#: Warps per multiprocessor the split-KV heuristic aims for. A decode step streams K and
#: V and does little arithmetic; its speed is the bytes in flight, i.e. the warps issuing
#: copies. On an H100 at B=8 Hkv=8 and 32k keys (64 one-warp blocks before splitting),
#: 2 blocks per multiprocessor (5 splits) read at 0.57-0.69 of the copy bandwidth and
#: 16-32 splits were up to 15% faster (notes/packed_cuda_2026-11-23.md).
SPLIT_WARPS_PER_SM = 8


def split_plan(case, shape, want, sms, longest=None) -> tuple:
    """``(splits, chunk)`` for a KV-cache forward whose kernel has ``shape`` (of
    :func:`forward_shape`): ``want`` splits (0: the heuristic) of ``chunk`` keys each, a
    multiple of the key tile, over the ``longest`` key range (None: the case's
    ``max_seqlen_k``). The heuristic: enough splits that the blocks put
    ``SPLIT_WARPS_PER_SM`` warps on every one of the GPU's ``sms`` multiprocessors, at
    most 64, and at least 4 key tiles per split; 1 (no split) when the (query tile, head)
    blocks alone do."""
    block_m, block_n, warps = shape
    longest = max(1, case.kvcache.max_seqlen_k if longest is None else longest)
    tiles = -(-longest // block_n)
    if want == 0:
        blocks = case.batch * case.heads_q * -(-case.seqlen_q // block_m)
        need = -(-SPLIT_WARPS_PER_SM * sms // warps)
        want = max(1, min(64, -(-need // max(1, blocks)), tiles // 4))
    want = max(1, min(want, tiles))
    chunk = -(-tiles // want) * block_n
    return -(-longest // chunk), chunk


def run_merge(case, device, stream, opart, lpart, o, lse, splits):
    """Merge ``splits`` float32 partials (``opart`` ``(S, rows, D)``, ``lpart`` ``(S,
    rows)`` handles, rows = B Hq Nq) into ``o`` (a (handle, strides4) pair) and ``lse`` (a
    handle of a float32 (rows,) buffer)."""
    v = Variant("merge", "simt", case.head_dim, case.dtype, False, 256)
    kern = kernel(v, device)
    rows = case.batch * case.heads_q * case.seqlen_q
    kern(((rows * case.head_dim + 255) // 256, 1), stream,
         (opart, lpart, o[0], lse, splits, rows, case.heads_q, case.seqlen_q, *o[1]))


def run_append(case, device, stream, ksrc, kdst, vsrc, vdst, seqlens, table, page,
               ends=None):
    """Write ``ksrc`` and ``vsrc`` (handle, strides in (B, N, H, D) order) pairs into the
    caches ``kdst`` and ``vdst`` (likewise; a paged pool's page stride first) at each
    sequence's ``seqlens[b]`` onward, in one launch: ``table`` is ``(handle, batch stride)``
    of the block table where the cache is paged. ``ends``: the handle of an int32 ``(B,)``
    buffer the kernel fills with ``seqlens + Nnew`` (None: the caller has them)."""
    kc = case.kvcache
    v = Variant("append", "simt", case.head_dim, case.dtype, False, 256,
                packed="paged" if kc.paged else "cache")
    kern = kernel(v, device)
    B, H, D = case.batch, case.heads_kv, case.head_dim
    n = B * kc.n_new * H * D
    pg = kc.paged  # (then the batch strides are 0, the page strides apart)
    kds, vds = ((0, *x[1][1:]) if pg else x[1] for x in (kdst, vdst))
    kpsp, vpsp = (x[1][0] if pg else 0 for x in (kdst, vdst))
    kern(((n + 255) // 256, 1), stream,
         (ksrc[0], kdst[0], vsrc[0], vdst[0], seqlens, seqlens if ends is None else ends,
          table[0], B, kc.n_new, H, D, *ksrc[1], *kds, *vsrc[1], *vds, table[1], page, kpsp,
          vpsp, int(ends is not None)))


def run_backward(case, device, stream, do, q, k, v, o, lse, delta, dq, dk, dv, tiles=None,
                 slopes=None, margs=None, classes=None, packed=None, dq_acc=None):
    """Launch the preprocess kernel, then the dK/dV and dQ kernels (tensor-core ones where
    :func:`tc_serves`, wgmma ones where also :func:`hopper_bwd_serves`, as in
    :func:`run_forward`). Arrays are (handle, strides) pairs; lse
    has three strides; delta is a handle of a contiguous float32 (B, Hq, Nq) scratch
    buffer ((Hq, total_q) for varlen, whose preprocess runs over the packed rows as one
    batch entry). ``dq_acc``: the handle of a float32 (B, Hq, Nq, D) buffer where
    :func:`fused_backward` holds: the non-deterministic mode, dK/dV and dQ in one pass
    (:func:`run_fused_backward`)."""
    tc, hop, aligned, _ = _serves("backward", case, device, q, k, v, do, tiles, True)
    if hop and dq_acc is not None:
        return run_fused_backward(case, device, stream, do, q, k, v, o, lse, delta, dq, dk,
                                  dv, dq_acc)
    pre, pre_rows, dkdv, dkdv_bm, dqk, dq_bm = _plan("backward", case, device, tiles,
                                                     aligned, tc, hopper=hop)
    launch_preprocess(pre, pre_rows, case, stream, o, do, delta)
    slopes = slopes or no_slopes(delta)
    margs = margs or no_mod_args(delta)
    classes = classes or no_classes(delta)
    launch_dkdv(dkdv, dkdv_bm, case, stream, q, k, v, do, lse, delta, dk, dv, slopes, margs,
                classes, packed, tilings.dkdv_passes(case.head_dim) if hop else 1)
    launch_dq(dqk, dq_bm, case, stream, q, k, v, do, lse, delta, dq, slopes, margs, classes,
              packed)


def run_fused_backward(case, device, stream, do, q, k, v, o, lse, delta, dq, dk, dv, dq_acc):
    """The non-deterministic mode (:func:`fused_backward`): the accumulator ``dq_acc`` (a
    handle of a float32 (B, Hq, Nq, D) buffer) zeroed, the preprocess, the dkdvq kernel
    (dK, dV, and dQ's parts added into the accumulator), then dQ = accumulator × scale."""
    pre, pre_rows, dkdvq, bm, conv, ct = _plan("fused", case, device, None, True, True,
                                         hopper=True)
    B, Hq, Nq, D = case.batch, case.heads_q, case.seqlen_q, case.head_dim
    rows = B * Hq * Nq
    strides = (Hq * Nq * D, Nq * D, D)
    grid = ((Nq * D + ct - 1) // ct, Hq, B)  # (simt/dq_convert.py)
    conv(grid, stream, (dq_acc, dq[0], 1, rows, Hq, Nq, *strides, *dq[1], 1.0))
    launch_preprocess(pre, pre_rows, case, stream, o, do, delta)
    launch_dkdv(dkdvq, bm, case, stream, q, k, v, do, lse, delta, dk, dv,
                (dq_acc, strides[:2]), no_mod_args(delta), no_classes(delta))
    conv(grid, stream, (dq_acc, dq[0], 0, rows, Hq, Nq, *strides, *dq[1], float(case.scale)))
