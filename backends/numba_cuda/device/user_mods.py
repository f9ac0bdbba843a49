"""The user's ``score_mod`` / ``mask_mod`` as device functions the kernels call.

A variant that carries a :class:`~..variant.UserMods` gets four device functions from
:func:`device_mods`, compiled with the kernel (once per variant and process):

- ``views(m0, m1, m2, m3, e)``: the ``mod_args`` as arrays (C-contiguous, at most 4 of at
  most 4 dims; ``e`` holds their 16 extents) from the raw pointers the launch passes;
- ``value(s, b, h, i, j, args)``: ``score_mod(s, b, h, i, j, *args)`` as a float32;
- ``value_slope(s, b, h, i, j, args)``: ``(value(s, ...), d score_mod / d s)``, the score
  and the factor dS takes, in one pass (the backward kernels);
- ``keeps(b, h, i, j, args)``: ``mask_mod(b, h, i, j, *args)`` as a bool.

Precision, decided here (README documents it). The kernels compute scores in float32, and a
Python float constant would make Numba compute the whole mod in float64 (float32 op float64
is float64), which on a GPU costs a float64 tanh per score. So the mod the kernels call is
the user's function with its float constants, float closure variables and float globals
turned into float32 (as Triton, and so FlexAttention, reads them), the *float32 twin*; in
fp16/bf16 variants ``math.tanh`` in it is ``tanh.approx.f32`` (relative error ~2^-11, below
those dtypes' rounding: the built-in softcap makes the same choice). Integers mixed with
floats still promote to float64 (write ``float32(i - j)`` to stay in float32).

The derivative comes from the forward-mode twin of the user's function
(:func:`flashcore._derive.value_and_slope`: the chain rule written into the source, value
and derivative in one pass), itself made a float32 twin as above: in fp16/bf16 variants its
``tanh`` is the approximate one and ``d tanh = 1 - tanh^2`` is taken from it, as the
built-in softcap does; fp32 variants take the value from the float32 twin (as the forward
does) and the derivative from the forward-mode twin of the user's own function in float64
(float32 math loses ~eps / (1 - tanh^2) to cancellation where a softcap saturates: 1e-5
relative in dQ against the built-in in a GPU test).
Where that twin cannot be written (a call of another function on ``s``, no source), a
fourth-order central difference, ``(8 (f(s+h) - f(s-h)) - (f(s+2h) - f(s-2h))) / 12h``,
exact for mods polynomial in ``s`` up to degree 4 but for rounding: in fp16/bf16 variants
on the float32 twin with precise ``tanh`` and ``h = 2^-6 max(1, |s|)`` (relative error
~1e-5, below those dtypes' rounding), in fp32 variants on the user's own function in float64
with ``h = 1e-3 max(1, |s|)`` as on the CPU (``flashcore._mods.FD_STEP``; ~1e-12). The
difference costs four more calls of the function per score in each backward kernel (softcap
as a score_mod: forward+backward 1.52x the built-in on an H100).
"""
from __future__ import annotations

import functools
import math
import types as pytypes

import numpy as np
from numba import cuda, float32, float64

from flashcore._derive import value_and_slope

from .constants import FASTMATH
from .convert import SIMULATOR
from .intrinsics import tanh_approx

#: At most this many mod_args, each of at most MAX_DIMS dims, reach the CUDA kernels.
MAX_ARGS = 4
MAX_DIMS = 4


def python_function(fn):
    """The plain Python function of ``fn`` (a numba dispatcher's ``py_func``)."""
    return getattr(fn, "py_func", fn)


def float32_twin(fn, approx):
    """``fn`` with its float constants, float closure cells and float globals as float32;
    with ``approx``, ``math.tanh`` (by module or by name) is ``tanh.approx.f32``."""
    fn = python_function(fn)
    code = fn.__code__
    code = code.replace(co_consts=tuple(np.float32(c) if type(c) is float else c
                                        for c in code.co_consts))
    g = dict(fn.__globals__)
    for name in code.co_names:
        val = g.get(name)
        if type(val) is float:
            g[name] = np.float32(val)
        elif approx and val is math:
            g[name] = _fast_math()
        elif approx and val is math.tanh:
            g[name] = tanh_approx
    cells = None
    if fn.__closure__ is not None:
        cells = tuple(pytypes.CellType(np.float32(c.cell_contents))
                      if type(c.cell_contents) is float else c for c in fn.__closure__)
    if approx:
        code = _divisions_by_constants_as_products(code, fn.__closure__, g)
    twin = pytypes.FunctionType(code, g, fn.__name__, fn.__defaults__, cells)
    twin.__qualname__ = fn.__qualname__
    return twin


def _divisions_by_constants_as_products(code, closure, globals_):
    """``code`` with each ``x / c``, where ``c`` is a float constant, a float closure
    variable or a float global, turned into ``x * (1 / c)`` (``1 / c`` rounded to float32: within an ulp of
    float32 division, far below fp16/bf16 rounding). A division costs a MUFU reciprocal per
    score, as much as the softmax's exp2 (``s / cap`` in a softcap made it 1.38x the built-in
    softcap's forward on an H100); NVVM keeps ``div.approx`` even under "arcp". Only the
    bytecode ``LOAD_CONST c``, ``LOAD_DEREF c`` or ``LOAD_GLOBAL c`` right before
    ``BINARY_OP /`` is rewritten, in place: ``LOAD_CONST`` takes the load's first code unit
    and a global's inline cache units become ``NOP``, so no offset moves; anything else is
    left as written."""
    import dis
    import opcode

    ops = [sym for _, sym in getattr(dis, "_nb_ops", ())]
    if "/" not in ops or "*" not in ops or "LOAD_CONST" not in opcode.opmap:
        return code
    div, mul = ops.index("/"), ops.index("*")
    raw = bytearray(code.co_code)
    consts = list(code.co_consts)
    free = {name: i for i, name in enumerate(code.co_freevars)}
    ins = list(dis.get_instructions(code))
    caches = getattr(opcode, "_inline_cache_entries", None)
    for a, b in zip(ins, ins[1:]):
        if b.opname != "BINARY_OP" or b.arg != div or b.is_jump_target:
            continue
        c = None
        if a.opname == "LOAD_CONST":
            c = a.argval
        elif a.opname == "LOAD_DEREF" and closure is not None and a.argval in free:
            c = closure[free[a.argval]].cell_contents
        elif a.opname == "LOAD_GLOBAL" and not a.arg & 1 and caches is not None:
            c = globals_.get(a.argval)  # (its inline cache units become NOPs below)
        if not isinstance(c, (float, np.float32)) or not math.isfinite(c) or c == 0:
            continue
        if len(consts) > 255 or raw[b.offset + 1] != div or (
                a.offset >= 2 and raw[a.offset - 2] == opcode.opmap["EXTENDED_ARG"]):
            continue
        units = 1
        if a.opname == "LOAD_GLOBAL":
            units += caches[a.opname] if isinstance(caches, dict) else caches[a.opcode]
        if a.offset + 2 * units != b.offset:
            continue
        consts.append(np.float32(1.0 / float(c)))
        raw[a.offset] = opcode.opmap["LOAD_CONST"]
        raw[a.offset + 1] = len(consts) - 1
        for u in range(1, units):
            raw[a.offset + 2 * u] = opcode.opmap["NOP"]
            raw[a.offset + 2 * u + 1] = 0
        raw[b.offset + 1] = mul
    return code.replace(co_code=bytes(raw), co_consts=tuple(consts))


@functools.cache
def _fast_math():
    """A stand-in for the ``math`` module whose ``tanh`` is ``tanh.approx.f32``."""
    shim = pytypes.ModuleType("math")
    shim.__dict__.update({n: getattr(math, n) for n in dir(math) if not n.startswith("__")})
    shim.tanh = tanh_approx
    return shim


def _device(fn):
    """A device function with the kernels' fastmath flags (a device function keeps its own
    flags when inlined: without "arcp", ``s / cap`` stays a ``div.full`` per score)."""
    return fn if SIMULATOR else cuda.jit(device=True, forceinline=True, fastmath=FASTMATH)(fn)


def _views_source(args):
    """Source of ``views``: a tuple of the mod_args as arrays."""
    parts = []
    for n, (_, ndim) in enumerate(args):
        shape = ", ".join(f"e[{4 * n + d}]" for d in range(ndim)) + ","
        if SIMULATOR:  # (a flat NumPy array stands for the pointer)
            parts.append(f"m{n}.reshape(({shape}))")
        else:
            parts.append(f"carray(m{n}, ({shape}))")
    return ("def views(m0, m1, m2, m3, e):\n"
            f"    return ({', '.join(parts)}{',' if parts else ''})\n")


def _call(name, first, n):
    return f"{name}({first}{''.join(f', a[{x}]' for x in range(n))})"


def kernel_mods(v):
    """``(SMOD, MMOD, views, value, value_slope, keeps)`` of variant ``v``: whether it has a
    score_mod, a mask_mod, and the device functions of :func:`device_mods` (trivial ones
    where it has neither)."""
    u = v.user
    fns = device_mods(u, v.dtype != "float32")
    return (u is not None and u.score_mod is not None, u is not None and u.mask_mod is not None,
            *fns)


@functools.cache
def device_mods(spec, half):
    """``(views, value, value_slope, keeps)`` device functions of ``spec`` (a UserMods, or None)
    for a variant whose inputs are 16-bit (``half``) or fp32."""
    if spec is None:
        return _NO_MODS
    n = len(spec.args)
    ns = {"float32": float32, "float64": float64, "abs": abs, "max": max}
    if not SIMULATOR:
        from numba.cuda.np.numpy_support import carray

        ns["carray"] = carray
    src = [_views_source(spec.args)]
    if spec.score_mod is not None:
        ns["F"] = _device(float32_twin(spec.score_mod, half))
        src.append("def value(s, b, h, i, j, a):\n"
                   f"    return float32({_call('F', 's, b, h, i, j', n)})\n")
        src.append(_value_slope_source(spec.score_mod, half, n, ns))
    else:
        src.append("def value(s, b, h, i, j, a):\n    return s\n")
        src.append("def value_slope(s, b, h, i, j, a):\n    return s, float32(1.0)\n")
    if spec.mask_mod is not None:
        ns["M"] = _device(float32_twin(spec.mask_mod, half))
        src.append("def keeps(b, h, i, j, a):\n"
                   f"    return bool({_call('M', 'b, h, i, j', n)})\n")
    else:
        src.append("def keeps(b, h, i, j, a):\n    return True\n")
    exec(compile("".join(src), f"<flashcore user mods {spec.label}>", "exec"), ns)  # noqa: S102
    return tuple(_device(ns[name]) for name in ("views", "value", "value_slope", "keeps"))


def _value_slope_source(score_mod, half, n, ns):
    """Source of ``value_slope``: ``(value, d value / d s)`` from the forward-mode twin of
    the user's function (:mod:`flashcore._derive`, as a float32 twin), or where that cannot
    be written from a fourth-order central difference (module doc); puts the functions it
    calls in ``ns``."""
    twin = value_and_slope(score_mod)
    if twin is not None and half:
        ns["VS"] = _device(float32_twin(twin, True))
        return ("def value_slope(s, b, h, i, j, a):\n"
                f"    v, d = {_call('VS', 's, b, h, i, j', n)}\n"
                "    return float32(v), float32(d)\n")
    if twin is not None:  # fp32: the value as the forward takes it, d/ds in float64
        ns["VS"] = _device(twin)
        return ("def value_slope(s, b, h, i, j, a):\n"
                f"    v, d = {_call('VS', 'float64(s), b, h, i, j', n)}\n"
                f"    return float32({_call('F', 's, b, h, i, j', n)}), float32(d)\n")
    if half:
        ns["G"] = _device(float32_twin(score_mod, False))
        step, t, one = "float32(0.015625)", "float32", "float32(1.0)"
    else:
        ns["G"] = _device(python_function(score_mod))
        step, t, one = "1e-3", "float64", "1.0"
    return ("def value_slope(s, b, h, i, j, a):\n"
            f"    x = {t}(s)\n"
            f"    st = {step} * max({one}, abs(x))\n"
            "    st2 = st + st\n"
            f"    d1 = {t}({_call('G', 'x + st, b, h, i, j', n)}) - "
            f"{t}({_call('G', 'x - st, b, h, i, j', n)})\n"
            f"    d2 = {t}({_call('G', 'x + st2, b, h, i, j', n)}) - "
            f"{t}({_call('G', 'x - st2, b, h, i, j', n)})\n"
            f"    return float32({_call('F', 's, b, h, i, j', n)}), float32(({t}(8.0) * d1 - d2) / "
            f"({t}(12.0) * st))\n")


def _trivial():
    def views(m0, m1, m2, m3, e):
        return ()

    def value(s, b, h, i, j, a):
        return s

    def value_slope(s, b, h, i, j, a):
        return s, float32(1.0)

    def keeps(b, h, i, j, a):
        return True

    return tuple(_device(f) for f in (views, value, value_slope, keeps))


_NO_MODS = _trivial()
