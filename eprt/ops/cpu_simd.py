"""Sixteen float32 lanes for the compiled CPU kernels: a numba value type held as LLVM's
<16 x float> (a register: one zmm with AVX-512, two ymm with AVX2, four NEON q registers) and
the few operations the kernels use. Multiplies and adds stay apart (no fused multiply-add), as in
NumPy's float32 expressions. ``weights`` reads 16 weights of a panel at its resident precision
(float32, bfloat16 bits, float8_e4m3fn bytes times their block scale) as float32 lanes; sixteen
int32 lanes (``Ints``) hold the int8 kernel's dot products (``dot4``: VNNI where the CPU has it);
``claim``, ``peek`` and ``pause`` are the threads' atomics and spin-wait, ``await_post`` the wait
of cpu_pool's helpers. Imported with the compiled kernels only (it needs numba)."""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_INTS = ir.VectorType(ir.IntType(32), LANES)
VNNI = bool(llvm.get_host_cpu_features().get("avx512vnni", False))  # vpdpbusd on 16 int32 lanes
_TRIPLE = llvm.get_process_triple()


class Lanes(types.Type):
    def __init__(self):
        super().__init__(name=f"float32x{LANES}")


class Ints(types.Type):
    def __init__(self):
        super().__init__(name=f"int32x{LANES}")


lanes = Lanes()
ints = Ints()


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


@register_model(Ints)
class _IntsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _INTS)


def _pointer(context, builder, array_type, array, index, index_types, vector=_VECTOR):
    """A ``vector``* to array[index...] (C order along the last axis; float32 lanes by default)."""
    ary = context.make_array(array_type)(context, builder, array)
    index = [context.cast(builder, v, t, types.intp) for v, t in zip(index, index_types)]
    item = cgutils.get_item_pointer(context, builder, array_type, ary, index)
    return builder.bitcast(item, vector.as_pointer())


@intrinsic
def load(typingctx, array, i, j):
    """array[i, j : j + 16] of a float32 matrix whose rows are contiguous."""

    def codegen(context, builder, signature, args):
        return builder.load(
            _pointer(context, builder, signature.args[0], args[0], args[1:], signature.args[1:]), align=4
        )

    return lanes(array, i, j), codegen


@intrinsic
def store(typingctx, array, i, j, value):
    """array[i, j : j + 16] = value."""

    def codegen(context, builder, signature, args):
        pointer = _pointer(context, builder, signature.args[0], args[0], args[1:3], signature.args[1:3])
        builder.store(args[3], pointer, align=4)
        return context.get_dummy_value()

    return types.void(array, i, j, value), codegen


@intrinsic
def splat(typingctx, x):
    """x (a float32) in every lane."""

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.float32)
        undef = ir.Constant(_VECTOR, ir.Undefined)
        first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

    return lanes(x), codegen


@intrinsic
def splat_at(typingctx, array, i, j):
    """array[i, j] of a float32 matrix in every lane, read through its pointer: i, j >= 0 (no
    negative-index wrap-around, whose selects were half the instructions of a one-row product)."""

    def codegen(context, builder, signature, args):
        pointer = _pointer(context, builder, signature.args[0], args[0], args[1:], signature.args[1:], ir.FloatType())
        value = builder.load(pointer, align=4)
        undef = ir.Constant(_VECTOR, ir.Undefined)
        first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

    if getattr(array, "dtype", None) != types.float32 or getattr(array, "ndim", 0) != 2:
        return None
    return lanes(array, i, j), codegen


@intrinsic
def zeros(typingctx):
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)

    return lanes(), codegen


@intrinsic
def add(typingctx, a, b):
    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return lanes(a, b), codegen


@intrinsic
def mul(typingctx, a, b):
    def codegen(context, builder, signature, args):
        return builder.fmul(args[0], args[1])

    return lanes(a, b), codegen


def _constant(value: float):
    return ir.Constant(_VECTOR, [float(np.float32(value))] * LANES)


_EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp(builder, x):
    """exp(x) in every lane, within 1 ulp of the float64 value on [-87.3, 88.4] (Cephes' expf:
    2^n e^r with |r| <= ln2 / 2 and a degree-6 polynomial); x is clamped to that range first."""
    high, low = _constant(88.3762626647949), _constant(-87.3365447504)
    x = builder.select(builder.fcmp_ordered(">", x, high), high, x)
    x = builder.select(builder.fcmp_ordered("<", x, low), low, x)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR]), "llvm.floor.v16f32")
    n = builder.call(floor, [builder.fadd(builder.fmul(x, _constant(1.44269504088896341)), _constant(0.5))])
    r = builder.fsub(
        builder.fsub(x, builder.fmul(n, _constant(0.693359375))), builder.fmul(n, _constant(-2.12194440e-4))
    )
    p = _constant(_EXP_POLYNOMIAL[0])
    for c in _EXP_POLYNOMIAL[1:]:
        p = builder.fadd(builder.fmul(p, r), _constant(c))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _constant(1.0))
    scale = builder.shl(
        builder.add(builder.fptosi(n, _INTS), ir.Constant(_INTS, [127] * LANES)), ir.Constant(_INTS, [23] * LANES)
    )
    return builder.fmul(p, builder.bitcast(scale, _VECTOR))  # p * 2^n


@intrinsic
def silu_mul(typingctx, gate, up):
    """gate / (1 + exp(-gate)) * up in every lane (SiLU(gate) * up), exp as ``_exp``."""

    def codegen(context, builder, signature, args):
        gate, up = args
        sigmoid_denominator = builder.fadd(_constant(1.0), _exp(builder, builder.fsub(_constant(0.0), gate)))
        return builder.fmul(builder.fdiv(gate, sigmoid_denominator), up)

    return lanes(gate, up), codegen


@intrinsic
def exp(typingctx, x):
    """exp(x) in every lane, as ``_exp``."""

    def codegen(context, builder, signature, args):
        return _exp(builder, args[0])

    return lanes(x), codegen


@intrinsic
def total(typingctx, v):
    """The sum of the 16 lanes, halves added pairwise (8 + 8, then 4 + 4, 2 + 2, 1 + 1)."""

    def codegen(context, builder, signature, args):
        v, width = args[0], LANES
        while width > 1:
            half = ir.VectorType(ir.IntType(32), width // 2)
            low = builder.shuffle_vector(v, v, ir.Constant(half, list(range(width // 2))))
            high = builder.shuffle_vector(v, v, ir.Constant(half, list(range(width // 2, width))))
            v, width = builder.fadd(low, high), width // 2
        return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))

    return types.float32(v), codegen


def _int_constant(value: int):
    return ir.Constant(_INTS, [value] * LANES)


def _decode_e4m3(builder, raw):
    """<16 x i8> float8_e4m3fn bytes -> <16 x float>, exactly and with normal numbers only (so a
    denormals-are-zero mode cannot touch it): (m + 8 [e > 0]) 2^(max(e, 1) - 10), then the sign.
    NaN bytes (0x7F, 0xFF) are refused at load and never reach it."""
    v = builder.zext(raw, _INTS)
    e = builder.and_(builder.lshr(v, _int_constant(3)), _int_constant(15))
    normal = builder.icmp_signed("!=", e, _int_constant(0))
    significand = builder.or_(
        builder.and_(v, _int_constant(7)), builder.select(normal, _int_constant(8), _int_constant(0))
    )
    exponent = builder.select(normal, e, _int_constant(1))
    power = builder.bitcast(builder.shl(builder.add(exponent, _int_constant(127 - 10)), _int_constant(23)), _VECTOR)
    magnitude = builder.fmul(builder.sitofp(significand, _VECTOR), power)
    sign = builder.shl(builder.and_(v, _int_constant(0x80)), _int_constant(24))
    return builder.bitcast(builder.or_(builder.bitcast(magnitude, _INTS), sign), _VECTOR)


def _bf16_pair(context, builder, array_type, array, k, k_type):
    """The 64-byte line of a bfloat16 panel holding its rows k - k % 2 and k - k % 2 + 1 (16 uint32
    lanes, the even row's bits in the low halves: ``cpu_weights.pair_rows``), and those rows as
    float32 lanes, exactly (the even row's bits shifted up, the odd row's masked)."""
    even = builder.and_(context.cast(builder, k, k_type, types.intp), ir.Constant(ir.IntType(64), -2))
    index = (even, context.get_constant(types.intp, 0))
    raw = builder.load(_pointer(context, builder, array_type, array, index, (types.intp, types.intp), _INTS), align=4)
    low = builder.bitcast(builder.shl(raw, _int_constant(16)), _VECTOR)
    high = builder.bitcast(builder.and_(raw, _int_constant(-65536)), _VECTOR)
    return low, high


_WIDTHS = {types.float32: 32, types.uint16: 16, types.uint8: 8}  # a panel's dtype -> bits a weight


def _row(context, builder, width, array_type, array, k, k_type, scale):
    """Row k of a [K, 16] panel of ``width``-bit weights as float32 lanes (``weights``)."""
    if width == 16:
        low, high = _bf16_pair(context, builder, array_type, array, k, k_type)
        return builder.select(builder.trunc(context.cast(builder, k, k_type, types.intp), ir.IntType(1)), high, low)
    vector = _VECTOR if width == 32 else ir.VectorType(ir.IntType(width), LANES)
    index = (k, context.get_constant(types.intp, 0))
    pointer = _pointer(context, builder, array_type, array, index, (k_type, types.intp), vector)
    raw = builder.load(pointer, align=4 if width == 32 else 1)
    return raw if width == 32 else builder.fmul(_decode_e4m3(builder, raw), scale)


@intrinsic
def weights(typingctx, panel, k, scale):
    """The 16 weights of row k of a [K, 16] panel as float32 lanes: float32 as stored, bfloat16
    bits (uint16, rows paired: ``cpu_weights.pair_rows``) widened, float8_e4m3fn bytes (uint8)
    decoded and multiplied by ``scale`` (their block's lanes, the product today's load-time
    dequantization rounds the same way); ``scale`` is ignored for the other two."""
    width = _WIDTHS.get(getattr(panel, "dtype", None))
    if width is None:
        return None

    def codegen(context, builder, signature, args):
        return _row(context, builder, width, signature.args[0], args[0], args[1], signature.args[1], args[2])

    return lanes(panel, k, scale), codegen


@intrinsic
def weight_pair(typingctx, panel, k, scale):
    """Rows k and k + 1 (k even) of a [K, 16] panel as two float32 lanes (``weights``): bfloat16
    panels in one 64-byte load, a shift and a mask (their rows are paired), the others two reads."""
    width = _WIDTHS.get(getattr(panel, "dtype", None))
    if width is None:
        return None
    pair = types.UniTuple(lanes, 2)

    def codegen(context, builder, signature, args):
        array_type, k_type = signature.args[0], signature.args[1]
        if width == 16:
            rows = _bf16_pair(context, builder, array_type, args[0], args[1], k_type)
        else:
            k = context.cast(builder, args[1], k_type, types.intp)
            after = builder.add(k, context.get_constant(types.intp, 1))
            rows = [_row(context, builder, width, array_type, args[0], i, types.intp, args[2]) for i in (k, after)]
        return context.make_tuple(builder, pair, rows)

    return pair(panel, k, scale), codegen


@intrinsic
def izeros(typingctx):
    def codegen(context, builder, signature, args):
        return _int_constant(0)

    return ints(), codegen


def _dot4_portable(builder, acc, w, x):
    """acc + per lane the sum of the four products of unsigned bytes w and signed bytes x."""
    wide = ir.VectorType(ir.IntType(32), 4 * LANES)
    bytes_ = ir.VectorType(ir.IntType(8), 4 * LANES)
    products = builder.mul(
        builder.zext(builder.bitcast(w, bytes_), wide), builder.sext(builder.bitcast(x, bytes_), wide)
    )
    total = acc
    for j in range(4):
        part = builder.shuffle_vector(products, products, ir.Constant(_INTS, list(range(j, 4 * LANES, 4))))
        total = builder.add(total, part)
    return total


@intrinsic
def dot4(typingctx, acc, panel, q, x):
    """acc + lane n's dot product of the four int8 weights panel[q, n, :4] (a [K / 4, 16, 4] int8
    panel) with the four int8 activations packed in the int32 ``x``, the weights read as unsigned
    bytes q + 128 (sign bit flipped), so the caller subtracts 128 times the activations' sum: one
    vpdpbusd with AVX512-VNNI, else the same integers from portable vector code (exact either way)."""

    def codegen(context, builder, signature, args):
        zero = context.get_constant(types.intp, 0)
        index_types = (signature.args[2], types.intp, types.intp)
        pointer = _pointer(context, builder, signature.args[1], args[1], (args[2], zero, zero), index_types, _INTS)
        w = builder.xor(builder.load(pointer, align=1), _int_constant(-0x7F7F7F80))  # 0x80808080: q + 128
        value = context.cast(builder, args[3], signature.args[3], types.int32)
        undef = ir.Constant(_INTS, ir.Undefined)
        xs = builder.shuffle_vector(
            builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0)), undef, _int_constant(0)
        )
        if not VNNI:
            return _dot4_portable(builder, args[0], w, xs)
        fnty = ir.FunctionType(_INTS, [_INTS, _INTS, _INTS])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [args[0], w, xs])

    return ints(acc, panel, q, x), codegen


@intrinsic
def scaled(typingctx, acc, correction, scale):
    """float32(acc - correction) * scale in every lane (``correction`` an int32, ``scale`` lanes)."""

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[1], signature.args[1], types.int32)
        undef = ir.Constant(_INTS, ir.Undefined)
        c = builder.shuffle_vector(
            builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0)), undef, _int_constant(0)
        )
        return builder.fmul(builder.sitofp(builder.sub(args[0], c), _VECTOR), args[2])

    return lanes(acc, correction, scale), codegen


def _item_pointer(context, builder, signature, args):
    """A pointer to array[i] of a one-dimensional array (args: the array, i)."""
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, signature.args[0], ary, [index])


@intrinsic
def claim(typingctx, counters, i):
    """counters[i] += 1 atomically (sequentially consistent); returns the value before: the
    number of the chunk of work this thread takes (or, on a done counter, counts one done)."""

    def codegen(context, builder, signature, args):
        pointer = _item_pointer(context, builder, signature, args)
        return builder.atomic_rmw("add", pointer, ir.Constant(ir.IntType(64), 1), "seq_cst")

    if getattr(counters, "dtype", None) != types.int64:
        return None
    return types.int64(counters, i), codegen


@intrinsic
def peek(typingctx, counters, i):
    """counters[i], read atomically (acquire): a value another thread writes, read afresh each time."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_item_pointer(context, builder, signature, args), "acquire", 8)

    if getattr(counters, "dtype", None) != types.int64:
        return None
    return types.int64(counters, i), codegen


@intrinsic
def pause(typingctx):
    """A spin-wait hint: x86's pause, AArch64's yield, else nothing."""

    def codegen(context, builder, signature, args):
        if _TRIPLE.startswith(("x86_64", "i686", "i386")):
            name, operands = "llvm.x86.sse2.pause", []
        elif _TRIPLE.startswith(("aarch64", "arm64")):
            name, operands = "llvm.aarch64.hint", [ir.Constant(ir.IntType(32), 1)]  # hint #1: yield
        else:
            return context.get_dummy_value()
        fnty = ir.FunctionType(ir.VoidType(), [o.type for o in operands])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), operands)
        return context.get_dummy_value()

    return types.void(), codegen


WATCH_SPINS = 40000  # spin-wait hints a pool helper watches for the next call (~1 ms on this machine)


@njit(nogil=True, cache=True)
def await_post(posted, seen):  # pragma: no cover - compiled
    """Returns when posted[0] != seen (``cpu_pool``: a call was posted) or after WATCH_SPINS
    spin-wait hints, the GIL released."""
    for _ in range(WATCH_SPINS):
        if peek(posted, 0) != seen:
            return
        pause()
