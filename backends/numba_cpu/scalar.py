"""Scalar building blocks for the CPU kernels: bit casts, a vectorizable exp2, and the
conversion of float16/bfloat16 storage to and from float32.

Numba has no float16 or bfloat16 on the CPU, so those inputs reach the kernels as raw bits:
bfloat16 as ``uint16`` arrays and float16 as ``int16`` arrays. :func:`load` and
:func:`store` are overloaded on the array's dtype, so one kernel source serves every dtype
and each specialization has no per-element branch on the format.
"""
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic, overload, register_jitable

LOG2E = 1.4426950408889634


@intrinsic
def f32_from_bits(typingctx, u):
    """Reinterpret the 32 bits of an unsigned integer as a float32."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = builder.trunc(args[0], ir.IntType(32)) if u.bitwidth > 32 else args[0]
        if u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def bits_from_f32(typingctx, f):
    """The 32 bits of a float32, as a uint32."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(f), codegen


@register_jitable
def exp2_f32(x):
    """2**x for float32 x <= 0 (scores minus their running max), relative error ~2e-7.

    Range reduction to a power of two (built from bits) times a degree-6 polynomial for
    2**f on [0, 1) (Chebyshev fit; error 8e-9 before float32 rounding). Unlike a call into
    libm this vectorizes. exp2(-inf) and anything under 2**-126 give exactly 0; NaN stays NaN.
    """
    y = max(x, np.float32(-127.0))
    yi = np.floor(y)
    f = y - yi
    p = np.float32(2.1877505e-04)
    p = p * f + np.float32(1.2387822e-03)
    p = p * f + np.float32(9.6845804e-03)
    p = p * f + np.float32(5.5480428e-02)
    p = p * f + np.float32(2.4023050e-01)
    p = p * f + np.float32(6.9314694e-01)
    p = p * f + np.float32(1.0)
    r = p * f32_from_bits(np.uint32((np.int32(yi) + np.int32(127)) << np.int32(23)))
    return np.float32(0.0) if x < np.float32(-126.0) else r


def exp2(x):  # overloaded below: float32 -> exp2_f32, float64 -> math.exp2
    raise NotImplementedError


@overload(exp2)
def _exp2(x):
    if x == types.float32:
        return lambda x: exp2_f32(x)
    return lambda x: math.exp2(x)


#: tanh(x) ~ x P(x^2) / Q(x^2) for |x| <= TANH_CLAMP (tanh(9) is 1 in float32): a
#: rational least-squares fit to the relative error (Sanathanan-Koerner iterations with
#: Lawson weights), max relative error 2.1e-8 in float64 arithmetic on [0, 9]
#: (``tools/fit_tanh.py`` prints these; notes/cpu_softcap_2026-11-28.md).
TANH_P = (0.9999999794412322, 0.13381022329984446, 0.0034955841831992508,
          2.0609016258350066e-05, 1.3354566569857133e-08)
TANH_Q = (1.0, 0.4671433792101114, 0.02587696723627567, 0.00032856283260675591,
          7.7765202357150976e-07)
TANH_CLAMP = 9.0


@register_jitable
def tanh_f32(x):
    """tanh(x) to float32 accuracy (2.1e-8 relative, computed in float64) by a rational
    function: unlike a call into libm's tanh, this vectorizes (the float32 kernels'
    softcap), for finite x (+-inf give +-1; a NaN is not kept)."""
    a = min(max(np.float64(x), -TANH_CLAMP), TANH_CLAMP)
    y = a * a
    p = (((TANH_P[4] * y + TANH_P[3]) * y + TANH_P[2]) * y + TANH_P[1]) * y + TANH_P[0]
    q = (((TANH_Q[4] * y + TANH_Q[3]) * y + TANH_Q[2]) * y + TANH_Q[1]) * y + TANH_Q[0]
    return min(max(a * p / q, -1.0), 1.0)


def tanh_any(x):
    """The float32 kernels' stand-in for a score_mod's ``math.tanh`` / ``np.tanh``
    (masked_kernels.with_tanh): :func:`tanh_f32` of a number, NumPy's tanh of an array
    (a score_mod may take tanh of a mod_args array, as ``np.tanh`` allows)."""
    return np.tanh(x)


@overload(tanh_any)
def _tanh_any(x):
    if isinstance(x, (types.Float, types.Integer, types.Boolean)):
        return lambda x: tanh_f32(x)
    return lambda x: np.tanh(x)


def tanh(x, like):  # overloaded below: a float32 kernel -> tanh_f32, float64 -> math.tanh
    raise NotImplementedError


@overload(tanh)
def _tanh(x, like):
    if like == types.float64:
        return lambda x, like: math.tanh(x)
    return lambda x, like: tanh_f32(x)


@register_jitable
def bf16_to_f32(u):
    return f32_from_bits(np.uint32(u) << np.uint32(16))


@register_jitable
def f16_to_f32(h):
    u = np.uint32(np.uint16(h))
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    e = (u >> np.uint32(10)) & np.uint32(0x1F)
    m = u & np.uint32(0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    if e == 31:  # inf or NaN
        return f32_from_bits(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return f32_from_bits(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@register_jitable
def f32_to_bf16(f):
    """Round to nearest even; NaN stays a quiet NaN."""
    x = bits_from_f32(np.float32(f))
    if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((x >> np.uint32(16)) | np.uint32(0x40))
    x = x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))
    return np.uint16(x >> np.uint32(16))


@register_jitable
def f32_to_f16(f):
    """Round to nearest even, with subnormals, overflow to inf, and NaN kept."""
    f = np.float32(f)
    x = bits_from_f32(f)
    sign = (x >> np.uint32(16)) & np.uint32(0x8000)
    a = x & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf or NaN
        return np.int16(np.int32(sign | np.uint32(0x7C00) | (np.uint32(0x200) if a > np.uint32(0x7F800000) else np.uint32(0))) - (np.int32(65536) if sign else np.int32(0)))
    if a >= np.uint32(0x477FF000):  # rounds to inf
        r = sign | np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # subnormal half: round |f| * 2**24 to an integer
        r = sign | np.uint32(np.rint(abs(f) * np.float32(16777216.0)))
    else:
        a = a - np.uint32(0x38000000)
        a = a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))
        r = sign | (a >> np.uint32(13))
    return np.int16(np.int32(r) - (np.int32(65536) if sign else np.int32(0)))


def load(x):  # overloaded below: storage element -> compute value
    raise NotImplementedError


@overload(load)
def _load(x):
    if x == types.uint16:
        return lambda x: bf16_to_f32(x)
    if x == types.int16:
        return lambda x: f16_to_f32(x)
    return lambda x: x


def store(value, like):  # overloaded below: compute value -> storage element of `like`
    raise NotImplementedError


@overload(store)
def _store(value, like):
    if like == types.uint16:
        return lambda value, like: f32_to_bf16(value)
    if like == types.int16:
        return lambda value, like: f32_to_f16(value)
    if like == types.float32:
        return lambda value, like: np.float32(value)
    return lambda value, like: np.float64(value)
