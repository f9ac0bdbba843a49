"""Masks and score modifiers: their checks, their static description, and BlockMask.

Per score of query ``i`` and key ``j`` (``i' = i + Nk - Nq``, the bottom-right alignment
``causal`` uses), in this order (:func:`flashcore.attention` documents it for users):

1. ``s = (q_i . k_j) * scale``;
2. ``softcap=c``: ``s = c * tanh(s / c)``;
3. ``alibi_slopes``: ``s += -slope[b, h] * |i' - j|``;
4. ``score_mod(s, b, h, i, j, *mod_args)``;
5. ``-inf`` where ``causal`` and ``j > i'``, where ``window=(left, right)`` and ``j < i' - left``
   or ``j > i' + right``, and where ``mask_mod(b, h, i, j, *mod_args)`` is False.

:class:`Mods` is the static part (hashable: it keys plans and compiled kernels); the arrays
(``alibi_slopes``, ``mod_args``) travel per call on the :class:`~flashcore._case.Case`.

Gradients through ``score_mod`` need ``d score_mod / d s``. flashcore takes it from the
user's function by a fourth-order central difference in float64,
``(8 (f(s+h) - f(s-h)) - (f(s+2h) - f(s-2h))) / 12h`` with ``h = 1e-3 * max(1, |s|)``
(:data:`FD_STEP`): exact for a mod that is linear in ``s`` (biases, masks, scalings) up to
rounding (~1e-13 relative), and within ~1e-12 relative for a smooth one such as
``c * tanh(s / c)``; a mod with a kink gives the one-sided mean at the kink. No derivative
is asked of the user.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np

from . import _interop
from ._memo import Memo, typed

#: Relative step of the finite-difference derivative of score_mod (see the module doc).
FD_STEP = 1e-3
#: Query and key rows per BlockMask tile (FlexAttention's default).
BLOCK = 128
#: Tile classes of a BlockMask.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Mods:
    """The static mask and score options of one call (None: not asked)."""

    window: tuple | None = None  # (left, right), each an int >= 0 or None (unbounded)
    softcap: float | None = None
    alibi: tuple | None = None  # the shape of alibi_slopes: (Hq,) or (B, Hq)
    score_mod: object = None
    mask_mod: object = None
    n_mod_args: int = 0
    block_mask: object = None  # a BlockMask for mask_mod

    def names(self) -> list[str]:
        """The options asked, by argument name (for a backend that declines some)."""
        return [n for n in ("window", "softcap", "alibi_slopes", "score_mod", "mask_mod",
                            "block_mask")
                if getattr(self, "alibi" if n == "alibi_slopes" else n) is not None]

    @property
    def window_ints(self) -> tuple[int, int]:
        """(left, right) with -1 for an unbounded side (no window: (-1, -1))."""
        if self.window is None:
            return -1, -1
        return tuple(-1 if w is None else int(w) for w in self.window)


def options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, block_mask):
    """The mask and score options as make_case takes them; None when none was asked."""
    if (window is None and softcap is None and alibi_slopes is None and score_mod is None
            and mask_mod is None and block_mask is None and not mod_args):
        return None
    return {"window": window, "softcap": softcap, "alibi_slopes": alibi_slopes,
            "score_mod": score_mod, "mask_mod": mask_mod, "mod_args": mod_args,
            "block_mask": block_mask}


def options_key(opts):
    """The options without their arrays' contents: what the checks read of them (array
    kinds, not values). Keys plans; TypeError where a part is unhashable."""
    if opts is None:
        return None
    a = opts["alibi_slopes"]
    return (typed(opts["window"]), typed(opts["softcap"]),  # (1 == True, yet one is refused)
            None if a is None else mod_args_key((a,)), opts["score_mod"], opts["mask_mod"],
            mod_args_key(opts["mod_args"]), opts["block_mask"])



def arrays_of(opts) -> list:
    """The arrays the options carry: the ALiBi slopes (if any), then mod_args."""
    if opts is None:
        return []
    a = opts["alibi_slopes"]
    return ([] if a is None else [a]) + list(opts["mod_args"])


def with_arrays(case, opts):
    """``case`` (perhaps a cached one) carrying this call's option arrays."""
    if case.mods is None or not (opts["alibi_slopes"] is not None or opts["mod_args"]):
        return case
    return replace(case, alibi_slopes=opts["alibi_slopes"], mod_args=tuple(opts["mod_args"]))


#: The largest window bound (a side wider than any sequence is unbounded: None says so;
#: larger ints overflowed the kernels' index arithmetic).
MAX_WINDOW = 2**31 - 1


def check_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None; "
                        f"got window={window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window's {side} bound must be an int >= 0 or None; "
                            f"got window={window!r}")
        if w < 0 or w > MAX_WINDOW:
            raise ValueError(f"window's {side} bound must be from 0 to 2**31 - 1 (None for "
                             f"unbounded); got window={window!r}")
        out.append(int(w))
    return None if out == [None, None] else tuple(out)


def check_softcap(softcap):
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None; got softcap={softcap!r}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number; got softcap={softcap!r}")
    return softcap


def _same_place(name, x, library, device):
    lib = _interop.library_of(x)
    if lib is None:
        raise TypeError(f"{name} must be an array of q's library ({library}); got "
                        f"{type(x).__module__}.{type(x).__qualname__}")
    if lib != library:
        raise TypeError(f"{name} must be an array of q's library ({library}); got a {lib} "
                        "array")
    dev = _interop.device_of(x, lib)
    if dev != device:
        raise ValueError(f"{name} must be on q's device ({device}); got {dev}")


def check_alibi(alibi_slopes, library, device, B, Hq):
    if alibi_slopes is None:
        return None
    _same_place("alibi_slopes", alibi_slopes, library, device)
    shape = tuple(int(n) for n in alibi_slopes.shape)
    if shape not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = {(Hq,)} or (B, Hq) = "
                         f"{(B, Hq)}; got alibi_slopes.shape={shape}")
    dt = _interop.dtype_name(alibi_slopes)
    if dt != "float32":
        raise TypeError(f"alibi_slopes must be float32; got alibi_slopes.dtype={dt}")
    return shape


def check_mod_args_tuple(mod_args):
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got "
                        f"{type(mod_args).__qualname__}")


def check_mod_args(mod_args, library, device):
    check_mod_args_tuple(mod_args)
    for n, a in enumerate(mod_args):
        _same_place(f"mod_args[{n}]", a, library, device)
    return tuple(mod_args)


def check_callable(name, fn):
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a Python function or None; got {fn!r}")
    return fn


def mod_args_key(mod_args):
    """What the checks read of mod_args (types, shapes, dtypes, devices), to key plans."""
    return tuple((type(a), tuple(a.shape), str(a.dtype), str(getattr(a, "device", "cpu")))
                 for a in mod_args)


def check_mods(*, window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, block_mask,
               library, device, B, Hq, Nq, Nk):
    """Check every mask and score option against the call; returns :class:`Mods`, or None
    when none was asked (plain attention)."""
    window = check_window(window)
    softcap = check_softcap(softcap)
    alibi = check_alibi(alibi_slopes, library, device, B, Hq)
    score_mod = check_callable("score_mod", score_mod)
    mask_mod = check_callable("mask_mod", mask_mod)
    mod_args = check_mod_args(mod_args, library, device)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask from create_block_mask; got "
                            f"{type(block_mask).__qualname__}")
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
        elif mask_mod is not block_mask.mask_mod:
            raise ValueError("block_mask was made for another mask_mod than the mask_mod "
                             "given")
        block_mask.check_shape(B, Hq, Nq, Nk)
    if mod_args and score_mod is None and mask_mod is None:
        raise ValueError("mod_args were given without a score_mod or mask_mod to read them")
    if (window, softcap, alibi, score_mod, mask_mod) == (None,) * 5:
        return None
    return Mods(window=window, softcap=softcap, alibi=alibi, score_mod=score_mod,
                mask_mod=mask_mod, n_mod_args=len(mod_args), block_mask=block_mask)


# --- BlockMask ----------------------------------------------------------------------------


class BlockMask:
    """Which (query tile, key tile) pairs of a ``mask_mod`` are empty, partial or full.

    ``classes[b, h, qt, kt]`` is :data:`EMPTY`, :data:`PARTIAL` or :data:`FULL` for query
    rows ``qt*BLOCK ...`` and keys ``kt*BLOCK ...`` (``b``, ``h`` of size 1 when made with
    ``B`` or ``H`` None: the mask is the same for every batch entry or head). Compared by
    identity: one BlockMask serves every call (every layer) with its mask.
    """

    __slots__ = ("mask_mod", "shape", "block", "classes", "device")

    def __init__(self, mask_mod, shape, block, classes, device):
        self.mask_mod = mask_mod
        self.shape = shape  # (B or None, H or None, Nq, Nk)
        self.block = block
        self.classes = classes  # NumPy int8 (B or 1, H or 1, ceil(Nq/block), ceil(Nk/block))
        self.device = device

    def check_shape(self, B, Hq, Nq, Nk):
        mb, mh, mq, mk = self.shape
        if (mq, mk) != (Nq, Nk) or mb not in (None, B) or mh not in (None, Hq):
            raise ValueError(f"block_mask was made for (B, H, Nq, Nk) = {self.shape}; this "
                             f"call has {(B, Hq, Nq, Nk)}")

    def sparsity(self) -> float:
        """The fraction of tiles skipped (empty)."""
        return float(np.mean(self.classes == EMPTY)) if self.classes.size else 0.0

    def __repr__(self):
        return (f"BlockMask(shape={self.shape}, block={self.block}, "
                f"sparsity={self.sparsity():.2f})")


def compiled(fn):
    """``fn`` compiled by Numba for the CPU (once per function), or TypeError saying why
    it does not compile."""
    import numba

    if isinstance(fn, numba.core.registry.CPUDispatcher):
        return fn
    return _COMPILED.get_or_build(fn, numba.njit, fn)


#: compiled(): one dispatcher per user function, bounded (closures made in a loop, say a
#: softcap per step, would otherwise keep every compiled copy alive).
_COMPILED = Memo(256, plans=False)


def checked(name, fn, leading, args):
    """``fn`` compiled by Numba for the CPU for ``(leading..., b, h, i, j, *args)`` (types
    of ``leading``, arrays ``args``), or TypeError: it does not compile, or a score_mod
    (``leading`` the score's type) does not return a number."""
    import numba
    from numba import types

    disp = compiled(fn)
    try:
        sig = (*leading, types.int64, types.int64, types.int64, types.int64,
               *(numba.typeof(a) for a in args))
        disp.compile(sig)
    except Exception as err:  # typing errors, or a signature the function does not take
        raise compile_error(name, fn, err) from None
    # (a score must be a number; a mask's result is taken as true or false)
    wanted = (types.Integer, types.Float) + (() if leading else (types.Boolean,))
    got = next((s.return_type for s in disp.nopython_signatures if s.args == tuple(sig)),
               None)
    if got is not None and not isinstance(got, wanted):
        raise TypeError(f"{name} {getattr(fn, '__qualname__', fn)!r} must return "
                        f"{'a number' if leading else 'a bool'}; Numba types what it "
                        f"returns as {got}")
    return disp


def check_compiles(score_mod, mask_mod, mod_args):
    """The user's mods compiled for host arrays of ``mod_args``' types and shapes (NumPy
    arrays, possibly stand-ins of no bytes): TypeError where one does not compile, before
    a framework traces the call into a graph whose host callback would only say so later."""
    import numba

    check_callable("score_mod", score_mod)
    check_callable("mask_mod", mask_mod)
    if score_mod is None and mask_mod is None:
        return
    args = tuple(np.empty((0,) * len(a.shape), np.dtype(a.dtype)) for a in mod_args)
    if score_mod is not None:
        checked("score_mod", score_mod, (numba.float64,), args)
    if mask_mod is not None:
        checked("mask_mod", mask_mod, (), args)


def compile_error(name, fn, err) -> TypeError:
    return TypeError(f"{name} {getattr(fn, '__qualname__', fn)!r} does not compile with "
                     f"Numba: {str(err).strip().splitlines()[0] if str(err).strip() else err}"
                     f"\n{err}")


def create_block_mask(mask_mod, B, H, Nq, Nk, *, mod_args=(), device=None):
    """Evaluate ``mask_mod(b, h, i, j, *mod_args)`` once per element and classify each
    (query tile, key tile) pair of :data:`BLOCK` rows as empty, partial or full.

    ``B`` or ``H`` may be None when the mask does not depend on them. ``mod_args`` are
    arrays of any library: where they are on a CUDA GPU (one library, one device;
    ``device`` None or that device) and numba_cuda runs there, the mask is evaluated on the
    GPU, else on the host. Pass the result as ``block_mask=`` to
    :func:`flashcore.attention` so repeated calls skip this evaluation; tiles that are
    empty are skipped and full tiles skip the per-element mask either way.
    """
    check_callable("mask_mod", mask_mod)
    if mask_mod is None:
        raise TypeError("mask_mod must be a Python function; got None")
    for name, n in (("Nq", Nq), ("Nk", Nk)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{name} must be an int >= 0; got {name}={n!r}")
    for name, n in (("B", B), ("H", H)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral)
                              or n < 1):
            raise ValueError(f"{name} must be an int >= 1 or None; got {name}={n!r}")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got "
                        f"{type(mod_args).__qualname__}")
    libs = []
    for n, a in enumerate(mod_args):
        lib = _interop.library_of(a)
        if lib is None:
            raise TypeError(f"mod_args[{n}] must be an array; got "
                            f"{type(a).__module__}.{type(a).__qualname__}")
        libs.append(lib)
    Bc, Hc = class_shape(mask_mod, 1 if B is None else B, 1 if H is None else H)
    classes = _gpu_classes(mask_mod, (Bc, Hc, -(-Nq // BLOCK), -(-Nk // BLOCK)), Nq, Nk,
                           tuple(mod_args), libs, device)
    if classes is None:
        host = tuple(np.ascontiguousarray(_interop.copy_to_host(a, lib))
                     for a, lib in zip(mod_args, libs))
        classes = block_classes(mask_mod, Bc, Hc, Nq, Nk, BLOCK, host)
    return BlockMask(mask_mod, (B, H, Nq, Nk), BLOCK, classes, device)


def _gpu_classes(mask_mod, shape, Nq, Nk, mod_args, libs, device):
    """create_block_mask's classes evaluated on the GPU where its mod_args live (one
    library, one CUDA device; ``device`` None or that device), by a backend that offers it
    (the ``block_classes`` hook of the contract, flashcore._dispatch); None: on the host."""
    if not mod_args or len(set(libs)) != 1 or libs[0] == "numpy":
        return None
    where = {_interop.device_of(a, libs[0]) for a in mod_args}
    if len(where) != 1 or not next(iter(where)).startswith("cuda") or (
            device is not None and str(device) not in where
            and not (str(device) == "cuda" and "cuda:0" in where)):
        return None
    from . import _dispatch
    from ._errors import BackendUnavailableError

    try:
        hook = getattr(_dispatch.load("numba_cuda"), "block_classes", None)
    except BackendUnavailableError:
        return None
    return None if hook is None else hook(mask_mod, shape, Nq, Nk, BLOCK, mod_args, libs[0],
                                          next(iter(where)))


#: Tile classes a call computed without a BlockMask, by mask_mod, sizes, dtypes and shapes
#: of its arrays, oldest first: up to ``_PER_KEY`` (host copies of the arrays, classes)
#: pairs each, the arrays compared bit for bit (a 512 KiB id table: ~20 µs, where a digest
#: of it took ~575): the next call with the same mask skips the evaluation, as if given the
#: BlockMask. The copies kept take at most ``_MAX_KEPT`` bytes in all (the oldest keys go
#: first); arrays above ``_MAX_REMEMBERED`` are keyed by a digest of their bytes instead.
_CLASSES: dict = {}
_MAX_CLASSES = 32
_PER_KEY = 4
_MAX_REMEMBERED = 64 << 20
_MAX_KEPT = 256 << 20


def _probe(host_args):
    """How the cache knows a call's arrays again: the arrays themselves, compared bit for
    bit (copies of them are kept: a NumPy mod_args array reaches here as the caller's own),
    or, where they take more than ``_MAX_REMEMBERED`` in all, digests of their bytes."""
    if sum(a.nbytes for a in host_args) > _MAX_REMEMBERED:
        import hashlib

        return tuple(hashlib.blake2b(a.tobytes(), digest_size=16).digest() for a in host_args)
    return host_args


def _same(mark, probe) -> bool:
    """Whether a kept mark (a copy or a digest) is the call's :func:`_probe` part: its
    bytes, NaN payloads and signed zeros included."""
    if isinstance(mark, bytes):
        return mark == probe
    return np.array_equal(mark.reshape(-1).view(np.uint8), probe.reshape(-1).view(np.uint8))


def _kept_bytes() -> int:
    return sum(m.nbytes for seen in _CLASSES.values() for marks, _ in seen for m in marks
               if isinstance(m, np.ndarray))


def _remember(key, entry):
    """Keeps ``entry`` first under ``key`` (its older pairs after it, ``_PER_KEY`` in all),
    then drops the oldest keys while there are too many or their copies take too much."""
    seen = _CLASSES.pop(key, [])
    _CLASSES[key] = [entry, *seen][:_PER_KEY]
    while len(_CLASSES) > 1 and (len(_CLASSES) > _MAX_CLASSES or _kept_bytes() > _MAX_KEPT):
        del _CLASSES[next(iter(_CLASSES))]


def reads_batch_head(fn) -> tuple[bool, bool]:
    """Whether ``fn(b, h, i, j, ...)`` (a mask_mod) may read ``b``, and ``h``: False only
    where its code never loads that parameter (no load of the local, no closure capturing
    it), so that its value cannot change the result and one batch entry's (one head's)
    tile classes serve all. A function whose code cannot be read (a builtin, a callable
    object, a bound method, ``*args`` in place of ``b, h``) may read both."""
    import inspect

    code = getattr(getattr(fn, "py_func", fn), "__code__", None)
    if code is None or code.co_argcount < 2 or inspect.ismethod(fn):
        return True, True  # (a method's code names ``self`` first)
    return _READS.get_or_build(code, _reads, code)


#: reads_batch_head's answers by code object (reading the bytecode takes ~70 µs, per call
#: otherwise), bounded.
_READS = Memo(256, plans=False)


def _reads(code):
    import dis

    names = code.co_varnames[:2]
    seen = set(code.co_cellvars) & set(names)
    for ins in dis.get_instructions(code):
        if "FAST" in ins.opname or "DEREF" in ins.opname or "CLOSURE" in ins.opname:
            val = ins.argval
            seen.update(val if isinstance(val, tuple) else (val,))
    return names[0] in seen, names[1] in seen


def class_shape(mask_mod, B, H) -> tuple[int, int]:
    """The batch and head extents of ``mask_mod``'s tile classes for ``B`` batch entries
    (or sequences) and ``H`` query heads: 1 where the mask never reads that index
    (:func:`reads_batch_head`), so the classes are evaluated once for all of them and the
    kernels read them with stride 0."""
    rb, rh = reads_batch_head(mask_mod)
    return (B if rb else 1), (H if rh else 1)


def block_classes(mask_mod, B, H, Nq, Nk, block, host_args, remember=False, evaluate=None,
                  lengths=None):
    """The (B or 1, H or 1, q tiles, k tiles) classes of ``mask_mod`` (host arrays for
    mod_args; 1 where the mask never reads ``b`` or ``h``, :func:`class_shape`); with
    ``remember``, kept with copies of the arrays (or digests of large ones) for the next
    call, and ``evaluate()`` (where given) evaluates them when they are new (a GPU's
    kernel) instead of the host. ``lengths``: a varlen call's rows and keys per sequence
    (two int64 arrays of B): each sequence's mask is asked only inside them (as the
    kernels ask it; tiles past a sequence's end are EMPTY), one table per sequence, and
    the kept classes are keyed by them too."""
    B, H = class_shape(mask_mod, B, H)
    if lengths is not None:
        lengths = tuple(np.ascontiguousarray(x, np.int64) for x in lengths)
        B = len(lengths[0])
    if remember:
        host_args = tuple(np.ascontiguousarray(a) for a in host_args)
        marked = host_args + (lengths or ())
        key = (mask_mod, B, H, Nq, Nk, block, lengths is not None,
               tuple((a.dtype.str, a.shape) for a in marked))
        probe = _probe(marked)
        for marks, classes in _CLASSES.get(key, []):
            if all(_same(m, p) for m, p in zip(marks, probe)):
                return classes
        classes = (block_classes(mask_mod, B, H, Nq, Nk, block, host_args, lengths=lengths)
                   if evaluate is None else evaluate())
        _remember(key, (tuple(p if isinstance(p, bytes) else p.copy() for p in probe),
                        classes))
        return classes
    from ._block_eval import classify

    fn = compiled(mask_mod)
    nqt, nkt = -(-Nq // block), -(-Nk // block)
    classes = np.zeros((B, H, nqt, nkt), np.int8)
    none = np.zeros(0, np.int64)
    if classes.size:
        try:
            classify(fn, classes, Nq, Nk, block, host_args, EMPTY, PARTIAL, FULL,
                     *(lengths or (none, none)))
        except Exception as err:  # numba's typing errors
            if type(err).__module__.startswith("numba"):
                raise compile_error("mask_mod", mask_mod, err) from None
            raise
    return classes
