"""Sixteen float32 lanes for the compiled CPU kernels: a numba value type held as LLVM's
<16 x float> (a register: one zmm with AVX-512, two ymm with AVX2, four NEON q registers) and
the few operations the kernels use. Multiplies and adds stay apart (no fused multiply-add), as in
NumPy's float32 expressions. Imported with cpu_kernels only (it needs numba)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_INTS = ir.VectorType(ir.IntType(32), LANES)


class Lanes(types.Type):
    def __init__(self):
        super().__init__(name=f"float32x{LANES}")


lanes = Lanes()


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


def _pointer(context, builder, array_type, array, index, index_types):
    """A <16 x float>* to array[index...] (a float32 array, C order along the last axis)."""
    ary = context.make_array(array_type)(context, builder, array)
    index = [context.cast(builder, v, t, types.intp) for v, t in zip(index, index_types)]
    item = cgutils.get_item_pointer(context, builder, array_type, ary, index)
    return builder.bitcast(item, _VECTOR.as_pointer())


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
