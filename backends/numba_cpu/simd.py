"""SIMD vectors for the CPU kernels: an LLVM vector type in Numba, and the few operations
the tile products need (load, store, broadcast, fused multiply-add).

Numba has no vector type of its own, and LLVM's auto-vectorizer does not keep a block of
accumulators in registers across a reduction loop; the tile products (products.py) write
that register blocking out with these vectors instead. The width is the host's: 256-bit
vectors (8 float32) under AVX2, 512-bit (16 float32) under AVX-512, 128-bit elsewhere
(NEON, SSE); LLVM splits a vector wider than the registers, so any width is correct
everywhere and only its speed depends on the host.
"""
import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def host_vector_bits():
    """Bits of the widest SIMD register the kernels use: that of the CPU Numba compiles for.
    That is the host's, unless ``NUMBA_CPU_NAME`` names another (a portable build, e.g.
    ``generic`` for a disk cache shared by different hosts): then the features of
    ``NUMBA_CPU_FEATURES`` (``+avx2,+fma,...``) where given, else 128 bits (the named CPU's
    own features are LLVM's to know; 128-bit vectors are right for any, if slower)."""
    from numba.core import config

    if config.CPU_FEATURES:
        features = {f[1:]: f[0] == "+" for f in config.CPU_FEATURES.split(",") if f[:1] in "+-"}
    elif config.CPU_NAME not in (None, "host"):
        return 128
    else:
        try:
            features = llvm.get_host_cpu_features()
        except RuntimeError:  # no feature list on this platform
            return 128
    if features.get("avx512f"):
        return 512
    if features.get("avx2") and features.get("fma"):
        return 256
    return 128


VECTOR_BITS = host_vector_bits()


def lanes(itemsize):
    """Elements of ``itemsize`` bytes per vector on this host."""
    return VECTOR_BITS // (8 * itemsize)


class Vec(types.Type):
    """A vector of ``width`` elements of the float type ``dtype`` (an LLVM vector value)."""

    def __init__(self, dtype, width):
        self.dtype = dtype
        self.width = width
        super().__init__(name=f"Vec({dtype}x{width})")


@register_model(Vec)
class VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(elem, fe_type.width))


def _vec_of(dtype):
    return Vec(dtype, lanes(dtype.bitwidth // 8))


def _element_ptr(context, builder, arrty, arr, index):
    ary = context.make_array(arrty)(context, builder, value=arr)
    return builder.gep(ary.data, [index])


@intrinsic
def vload(typingctx, arr, index):
    """The vector at ``arr.flat[index:index + width]`` (a C-contiguous array; unaligned)."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.float32, types.float64)
            and arr.layout == "C" and isinstance(index, types.Integer)):
        return None
    vt = _vec_of(arr.dtype)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1])
        vptr = builder.bitcast(ptr, context.get_value_type(vt).as_pointer())
        return builder.load(vptr, align=arr.dtype.bitwidth // 8)

    return vt(arr, index), codegen


@intrinsic
def vstore(typingctx, arr, index, v):
    """``arr.flat[index:index + width] = v`` (a C-contiguous array; unaligned)."""
    if not (isinstance(arr, types.Array) and isinstance(v, Vec) and arr.dtype == v.dtype
            and arr.layout == "C" and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1])
        vptr = builder.bitcast(ptr, args[2].type.as_pointer())
        builder.store(args[2], vptr, align=arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(arr, index, v), codegen


@intrinsic
def splat(typingctx, x):
    """A vector with ``x`` in every element."""
    if x not in (types.float32, types.float64):
        return None
    vt = _vec_of(x)

    def codegen(context, builder, sig, args):
        vty = context.get_value_type(vt)
        one = builder.insert_element(ir.Constant(vty, ir.Undefined), args[0],
                                     ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), vt.width),
                                                  [0] * vt.width))

    return vt(x), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` elementwise, rounded once."""
    if not (isinstance(a, Vec) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        vty = args[0].type
        elem = "f32" if a.dtype == types.float32 else "f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty] * 3),
                                            f"llvm.fma.v{a.width}{elem}")
        return builder.call(fn, args)

    return a(a, b, c), codegen


@intrinsic
def vmul(typingctx, a, b):
    if not (isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(*args)

    return a(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    if not (isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(*args)

    return a(a, b), codegen


@intrinsic
def width_of(typingctx, arr):
    """Vector width (elements) for the array's dtype, as a compile-time constant."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.float32, types.float64)):
        return None
    w = _vec_of(arr.dtype).width

    def codegen(context, builder, sig, args):
        return ir.Constant(cgutils.intp_t, w)

    return types.intp(arr), codegen


@intrinsic
def at(typingctx, arr, index):
    """``arr.flat[index]`` of a C-contiguous array, with no bounds or wraparound logic."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"
            and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1]))

    return arr.dtype(arr, index), codegen


@intrinsic
def vzero(typingctx, arr):
    """A vector of zeros of the array's dtype."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.float32, types.float64)):
        return None
    vt = _vec_of(arr.dtype)

    def codegen(context, builder, sig, args):
        return ir.Constant(context.get_value_type(vt), None)

    return vt(arr), codegen


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


def _const_vec(vty, x):
    return ir.Constant(vty, [ir.Constant(vty.element, x)] * vty.count)


@intrinsic
def vsub(typingctx, a, b):
    if not (isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(*args)

    return a(a, b), codegen


@intrinsic
def vmax(typingctx, a, b):
    """``b > a ? b : a`` elementwise: a NaN in ``b`` is not taken (as ``row_max``)."""
    if not (isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[1], args[0]), args[1], args[0])

    return a(a, b), codegen


@intrinsic
def hmax(typingctx, a):
    """The largest element (NaN elements are skipped unless all are NaN or -inf)."""
    if not isinstance(a, Vec):
        return None

    def codegen(context, builder, sig, args):
        m = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for i in range(1, a.width):
            x = builder.extract_element(args[0], ir.Constant(ir.IntType(32), i))
            m = builder.select(builder.fcmp_ordered(">", x, m), x, m)
        return m

    return a.dtype(a), codegen


@intrinsic
def hsum(typingctx, a):
    """The sum of the elements (pairwise)."""
    if not isinstance(a, Vec):
        return None

    def codegen(context, builder, sig, args):
        xs = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i))
              for i in range(a.width)]
        while len(xs) > 1:
            xs = [builder.fadd(xs[i], xs[i + 1]) for i in range(0, len(xs), 2)]
        return xs[0]

    return a.dtype(a), codegen


#: 2**f on [0, 1): the coefficients of scalar.exp2_f32, highest degree first
_EXP2_POLY = (2.1877505e-04, 1.2387822e-03, 9.6845804e-03, 5.5480428e-02, 2.4023050e-01,
              6.9314694e-01, 1.0)


@intrinsic
def vexp2(typingctx, x):
    """2**x elementwise for float32 vectors: scalar.exp2_f32's algorithm (relative error
    ~2e-7; below -126 exactly 0; NaN stays NaN), branch-free in vector registers."""
    if not (isinstance(x, Vec) and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        (v,) = args
        vty = v.type
        ity = ir.VectorType(ir.IntType(32), vty.count)
        lo = _const_vec(vty, -127.0)
        y = builder.select(builder.fcmp_unordered(">=", v, lo), v, lo)  # NaN kept
        yi = _call(builder, f"llvm.floor.v{vty.count}f32", vty, [y])
        f = builder.fsub(y, yi)
        fma = f"llvm.fma.v{vty.count}f32"
        p = _const_vec(vty, _EXP2_POLY[0])
        for c in _EXP2_POLY[1:]:
            p = _call(builder, fma, vty, [p, f, _const_vec(vty, c)])
        yc = builder.select(builder.fcmp_ordered(">", yi, lo), yi, lo)  # NaN -> -127: no poison
        e = builder.shl(builder.add(builder.fptosi(yc, ity), ir.Constant(ity, [127] * vty.count)),
                        ir.Constant(ity, [23] * vty.count))
        r = builder.fmul(p, builder.bitcast(e, vty))
        tiny = builder.fcmp_ordered("<", v, _const_vec(vty, -126.0))
        return builder.select(tiny, ir.Constant(vty, None), r)

    return x(x), codegen
