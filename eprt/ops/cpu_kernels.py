"""Compiled CPU kernels (numba, the ``cpu`` extra): the matrix products (dense and experts),
decode attention, norms and rotations. Imported only when NumpyOps takes the numba path
(importing numba takes about a second).

Weights are read from panels (``cpu_weights``: 16 output columns' weights contiguous over k, at
the resident precision: float32, bfloat16, FP8 with block scales, int8 with group scales), four
rows at a time against each panel with their sums in registers (``cpu_simd``), so a matrix
streams once, in memory order, for all its rows. Element (r, n) of a product is summed over k in
fours in one order whatever the rows in the call, with multiplies and adds rounded apart (no
fused multiply-add), so a row's bits do not depend on its batch-mates; bfloat16 and FP8 weights
become the float32 weights of a load-time upcast in registers, so their products have the same
bits as float32 panels. A call's threads split the panels (and decode attention's rows), never
k, so a row's bits do not depend on the thread count either. The first start compiles for tens
of seconds; numba caches the result.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from eprt.ops import cpu_simd as simd
from eprt.ops.cpu_pool import POOL, new_counters, share, spans, threads_for
from eprt.ops.cpu_weights import LANES, ScaledPanels, unit_scales


class _HideScipyLinalg:
    """An import finder that refuses scipy.linalg (``_numba_array_math``)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "scipy.linalg" or name.startswith("scipy.linalg."):
            raise ImportError("eprt: scipy.linalg hidden while numba's array math loads")
        return None


def _numba_array_math() -> None:
    """Load numba's array-math lowering (which its first compile or cache load needs) without
    scipy.linalg: numba imports it only to learn whether np.dot and np.linalg can compile, which no
    kernel here uses, and that import was half of numba's 1.4 s first call on this machine (0.5 -
    0.7 s). In this process numba's np.dot / np.linalg then need scipy already imported."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    sys.meta_path.insert(0, _HideScipyLinalg)
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        sys.meta_path.remove(_HideScipyLinalg)


_numba_array_math()

# numba keys this file's cached kernels on its text alone: the sha256 of cpu_simd.py (whose intrinsics
# they compile) is written here, so an edit there changes this file too (tests/test_code_shape.py checks)
SIMD_SOURCE = "ab745cec771954dc"
PANEL_PREFETCH_BYTES = 32768  # the first rows' pass over a panel asks for the weights this far ahead
KV_PREFETCH_POSITIONS = 8  # _decode_attention asks for the keys this many positions ahead
VERSION = numba.__version__


@intrinsic
def _prefetch(typingctx, array, i, j):
    """Ask the CPU to bring array[i, j]'s cache line into L2 (llvm.prefetch: read, locality 2)."""

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
        pointer = cgutils.get_item_pointer(context, builder, signature.args[0], ary, index)
        byte = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [byte, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")  # LLVM adds the overload suffix
        flags = [ir.Constant(ir.IntType(32), v) for v in (0, 2, 1)]  # read, L2, data
        builder.call(fn, [builder.bitcast(pointer, byte), *flags])
        return context.get_dummy_value()

    return types.void(array, i, j), codegen


@njit(nogil=True, cache=True, inline="always")
def _quad(acc, x, r, k, v0, v1, v2, v3):  # pragma: no cover - compiled
    """acc + ((x[r, k] v0 + x[r, k+1] v1) + (x[r, k+2] v2 + x[r, k+3] v3)), 16 lanes."""
    a0, a1 = simd.mul(simd.splat_at(x, r, k), v0), simd.mul(simd.splat_at(x, r, k + 1), v1)
    a2, a3 = simd.mul(simd.splat_at(x, r, k + 2), v2), simd.mul(simd.splat_at(x, r, k + 3), v3)
    return simd.add(acc, simd.add(simd.add(a0, a1), simd.add(a2, a3)))


@intrinsic
def _prefetch_rows(typingctx, lines, i):
    """Ask for the 64-byte lines holding rows lines[i : i + 4] of a [n, 16] view into L2 (one
    llvm.prefetch per line: 4 for float32 rows, 2 bfloat16, 1 FP8, the count fixed at compile time)."""
    if getattr(lines, "ndim", 0) != 2:
        return None
    span = 4 * LANES * lines.dtype.bitwidth // 8  # bytes of four rows

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        index = [context.cast(builder, args[1], signature.args[1], types.intp), context.get_constant(types.intp, 0)]
        byte = ir.IntType(8).as_pointer()
        start = builder.bitcast(cgutils.get_item_pointer(context, builder, signature.args[0], ary, index), byte)
        fnty = ir.FunctionType(ir.VoidType(), [byte, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")
        flags = [ir.Constant(ir.IntType(32), v) for v in (0, 2, 1)]  # read, L2, data
        for offset in range(0, span, 64):
            builder.call(fn, [builder.gep(start, [ir.Constant(ir.IntType(64), offset)]), *flags])
        return context.get_dummy_value()

    return types.void(lines, i), codegen


@njit(nogil=True, cache=True, inline="always")
def _ahead(lines, i):  # pragma: no cover - compiled
    """Ask for the lines holding rows lines[i : i + 4] of a [n, 16] view into L2, if there."""
    if i + 4 <= lines.shape[0]:
        _prefetch_rows(lines, i)


@njit(nogil=True, cache=True, inline="always")
def _four_rows(panel, k, scale):  # pragma: no cover - compiled
    """Rows k .. k + 3 (k a multiple of 4) of a [K, 16] panel as float32 lanes (``simd.weight_pair``)."""
    v0, v1 = simd.weight_pair(panel, k, scale)
    v2, v3 = simd.weight_pair(panel, k + 2, scale)
    return v0, v1, v2, v3


@njit(nogil=True, cache=True, inline="always")
def _float_panel(x, p, s, block, y, lo, hi, n, lines, ahead):  # pragma: no cover - compiled
    """y[lo:hi, n : n + 16] = x[lo:hi] @ panel p [K, 16] (float32, bfloat16 or FP8 with scales s
    [K / block, 16] per ``block`` k's; float32 and bfloat16 have one block). Four rows' sums stay in
    registers over the whole of k, every element summed in one order (acc = 0, then acc += (x0 w0
    + x1 w1) + (x2 w2 + x3 w3) over k in fours, then the K % 4 rest one at a time) whatever rows or
    threads share the call; the first rows' pass asks for the weights PANEL_PREFETCH_BYTES ahead."""
    K = p.shape[0]
    K4 = K - K % 4
    r = lo
    while r + 4 <= hi:  # four rows share each weight load
        s0, s1, s2, s3 = simd.zeros(), simd.zeros(), simd.zeros(), simd.zeros()
        for k0 in range(0, K4, block):
            scale = simd.load(s, k0 // block, 0)
            for k in range(k0, min(k0 + block, K4), 4):
                if r == lo:  # the later rows find the panel in cache
                    _ahead(lines, ahead + k)
                v0, v1, v2, v3 = _four_rows(p, k, scale)
                s0 = _quad(s0, x, r, k, v0, v1, v2, v3)
                s1 = _quad(s1, x, r + 1, k, v0, v1, v2, v3)
                s2 = _quad(s2, x, r + 2, k, v0, v1, v2, v3)
                s3 = _quad(s3, x, r + 3, k, v0, v1, v2, v3)
        for k in range(K4, K):
            v = simd.weights(p, k, simd.load(s, k // block, 0))
            s0 = simd.add(s0, simd.mul(simd.splat_at(x, r, k), v))
            s1 = simd.add(s1, simd.mul(simd.splat_at(x, r + 1, k), v))
            s2 = simd.add(s2, simd.mul(simd.splat_at(x, r + 2, k), v))
            s3 = simd.add(s3, simd.mul(simd.splat_at(x, r + 3, k), v))
        simd.store(y, r, n, s0)
        simd.store(y, r + 1, n, s1)
        simd.store(y, r + 2, n, s2)
        simd.store(y, r + 3, n, s3)
        r += 4
    last = lines.shape[0] - ahead - 4  # the last k whose lines ahead exist
    while r < hi:
        s0 = simd.zeros()
        for k0 in range(0, K4, block):
            scale = simd.load(s, k0 // block, 0)
            end = min(k0 + block, K4)
            mid = min(end, k0 + (last - k0) // 4 * 4 + 4) if r == lo and last >= k0 else k0  # k < mid prefetch
            for k in range(k0, mid, 4):  # (the bound checked once, not in the loop)
                _prefetch_rows(lines, ahead + k)
                v0, v1, v2, v3 = _four_rows(p, k, scale)
                s0 = _quad(s0, x, r, k, v0, v1, v2, v3)
            for k in range(mid, end, 4):
                v0, v1, v2, v3 = _four_rows(p, k, scale)
                s0 = _quad(s0, x, r, k, v0, v1, v2, v3)
        for k in range(K4, K):
            s0 = simd.add(s0, simd.mul(simd.splat_at(x, r, k), simd.weights(p, k, simd.load(s, k // block, 0))))
        simd.store(y, r, n, s0)
        r += 1


@njit(nogil=True, cache=True)
def _float_panels(x, w, s, block, y, lo, hi, c0, c1):  # pragma: no cover - compiled
    """Panels c0..c1 of w [C, K, 16] (scales s [C, K / block, 16]) for rows lo..hi (``_float_panel``)."""
    C, K = w.shape[0], w.shape[1]
    lines = w.reshape(C * K, 16)  # [C K, 16] one k of a panel per row
    ahead = PANEL_PREFETCH_BYTES // (16 * w.itemsize)  # rows of lines
    for c in range(c0, c1):
        _float_panel(x, w[c], s[c], block, y, lo, hi, 16 * c, lines, c * K + ahead)


@njit(nogil=True, cache=True)
def _q8_panels(xq, xs, xc, w, s, group, y, lo, hi, c0, c1):  # pragma: no cover - compiled
    """y[lo:hi, 16 c : 16 c + 16] for panels c0..c1 of int8 w [C, K / 4, 16, 4] (scales s [C, K /
    group, 16]) and rows quantized per group (xq [T, K / 4] four int8 per int32, xs [T, K / group]
    their scales, xc 128 times their sums): per group, four rows' exact integer dot products
    (``simd.dot4``), then acc += float32(dot) * (w scale * x scale), groups in order, whatever rows
    or threads share the call."""
    C, Kq = w.shape[0], w.shape[1]
    per, groups = group // 4, w.shape[1] * 4 // group
    lines = w.reshape(C * Kq, 64)  # [C K / 4, 64] one 64-byte line per quad of k
    for c in range(c0, c1):
        p, n, ahead = w[c], 16 * c, c * Kq + PANEL_PREFETCH_BYTES // 64
        r = lo
        while r < hi:
            m = min(4, hi - r)  # rows in this pass: four share each weight line
            f0, f1, f2, f3 = simd.zeros(), simd.zeros(), simd.zeros(), simd.zeros()
            for g in range(groups):
                a0, a1, a2, a3 = simd.izeros(), simd.izeros(), simd.izeros(), simd.izeros()
                for q in range(g * per, g * per + per):
                    if r == lo and ahead + q < lines.shape[0]:
                        _prefetch(lines, ahead + q, 0)
                    a0 = simd.dot4(a0, p, q, xq[r, q])
                    if m == 4:
                        a1 = simd.dot4(a1, p, q, xq[r + 1, q])
                        a2 = simd.dot4(a2, p, q, xq[r + 2, q])
                        a3 = simd.dot4(a3, p, q, xq[r + 3, q])
                ws = simd.load(s[c], g, 0)
                f0 = simd.add(f0, simd.scaled(a0, xc[r, g], simd.mul(ws, simd.splat(xs[r, g]))))
                if m == 4:
                    f1 = simd.add(f1, simd.scaled(a1, xc[r + 1, g], simd.mul(ws, simd.splat(xs[r + 1, g]))))
                    f2 = simd.add(f2, simd.scaled(a2, xc[r + 2, g], simd.mul(ws, simd.splat(xs[r + 2, g]))))
                    f3 = simd.add(f3, simd.scaled(a3, xc[r + 3, g], simd.mul(ws, simd.splat(xs[r + 3, g]))))
            simd.store(y, r, n, f0)
            if m == 4:
                simd.store(y, r + 1, n, f1)
                simd.store(y, r + 2, n, f2)
                simd.store(y, r + 3, n, f3)
                r += 4
            else:
                r += 1


@njit(nogil=True, cache=True)
def _quantize_rows(x, group, xq, xs, xc, lo, hi):  # pragma: no cover - compiled
    """Rows lo..hi of x[T, K] as symmetric int8 per group of ``group`` along k (K padded with
    zeros): xs[r, g] = max |x| / 127, q = rint(x 127 / max |x|) packed four to an int32 in xq[r],
    xc[r, g] = 128 * sum(q) (``simd.dot4`` reads the weights as q + 128). A group holding NaN or
    infinity gets a NaN scale, so its row's outputs are NaN as in float32."""
    K = x.shape[1]
    for r in range(lo, hi):
        for g in range(xs.shape[1]):
            k0 = g * group
            top, bad = np.float32(0.0), False
            for k in range(k0, min(k0 + group, K)):
                v = abs(x[r, k])
                bad = bad or not np.isfinite(v)
                top = max(top, v)
            xs[r, g] = np.float32(np.nan) if bad else top / np.float32(127.0)
            inv = np.float32(127.0) / top if top > 0 and not bad else np.float32(0.0)
            total = 0
            for q in range(k0 // 4, (k0 + group) // 4):
                word = 0
                for j in range(4):
                    k = 4 * q + j
                    v = int(np.rint(x[r, k] * inv)) if k < K else 0
                    total += v
                    word |= (v & 255) << (8 * j)
                xq[r, q] = np.int32(word - (1 << 32) if word >= (1 << 31) else word)
            xc[r, g] = 128 * total


def _product(op, w, s, block, y, lo, hi, c0, c1):  # pragma: no cover - typed by _product_for
    """y[lo:hi, panels c0..c1] of the operand ``op`` (``_operand``) through one matrix's panels w."""


@overload(_product)
def _product_for(op, w, s, block, y, lo, hi, c0, c1):  # pragma: no cover - compiled
    if w.dtype == types.int8:
        return lambda op, w, s, block, y, lo, hi, c0, c1: _q8_panels(
            op[0], op[1], op[2], w, s, block, y, lo, hi, c0, c1
        )
    return lambda op, w, s, block, y, lo, hi, c0, c1: _float_panels(op, w, s, block, y, lo, hi, c0, c1)


def _operand(x, w, block):  # pragma: no cover - typed by _operand_for
    """What the products of x[T, K] through panels like w read: x itself, or for int8 panels the
    arrays its quantized rows go to (filled by ``_fill``)."""


@overload(_operand)
def _operand_for(x, w, block):  # pragma: no cover - compiled
    if w.dtype == types.int8:

        def arrays(x, w, block):
            quads = w.shape[w.ndim - 3]  # [.., C, K / 4, 16, 4]
            groups = quads * 4 // block
            n = x.shape[0]
            return np.empty((n, quads), np.int32), np.empty((n, groups), np.float32), np.empty((n, groups), np.int32)

        return arrays
    return lambda x, w, block: x


def _fill(op, x, block, lo, hi):  # pragma: no cover - typed by _fill_for
    """Rows lo..hi of the operand ``op`` from x (int8: quantized; float: nothing to do)."""


@overload(_fill)
def _fill_for(op, x, block, lo, hi):  # pragma: no cover - compiled
    if isinstance(op, types.BaseTuple):
        return lambda op, x, block, lo, hi: _quantize_rows(x, block, op[0], op[1], op[2], lo, hi)
    return lambda op, x, block, lo, hi: None


@njit(nogil=True, cache=True)
def _linear_chunks(op, w, s, block, y, spans, counters):  # pragma: no cover - compiled
    """y = op @ w for panels w [C, ..], in chunks of panels taken one at a time (``cpu_pool``):
    chunk j is panels spans[j] .. spans[j + 1] for every row."""
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        _product(op, w, s, block, y, 0, y.shape[0], spans[j], spans[j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _linear_one(x, w, s, block, y):  # pragma: no cover - compiled
    """y = x @ w for panels w [C, ..], every panel on this thread (int8: x's rows quantized first)."""
    op = _operand(x, w, block)
    _fill(op, x, block, 0, x.shape[0])
    _product(op, w, s, block, y, 0, x.shape[0], 0, w.shape[0])


@njit(nogil=True, cache=True)
def _grouped_chunks(op, w, s, block, y, experts, edges, spans, counters):  # pragma: no cover - compiled
    """y[lo:hi] = op[lo:hi] @ w[e] for each group (experts[i], edges[2i], edges[2i+1]), in chunks
    taken one at a time: the groups' panels laid end to end (unit u: group u // C, its panel u % C),
    chunk j is units spans[j] .. spans[j + 1], so a thread streams long runs of one expert's
    weights (runs of a few panels from every expert streamed at a third of the speed)."""
    C = w.shape[1]
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        u, end = spans[j], spans[j + 1]
        while u < end:
            i, c0 = u // C, u % C
            c1 = min(C, c0 + end - u)
            e = experts[i]
            _product(op, w[e], s[e], block, y, edges[2 * i], edges[2 * i + 1], c0, c1)
            u += c1 - c0
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _operand_of(x, w, block):  # pragma: no cover - compiled
    """What the products of x through panels like w read (int8: x's rows quantized)."""
    op = _operand(x, w, block)
    _fill(op, x, block, 0, x.shape[0])
    return op


@njit(nogil=True, cache=True)
def _silu_mul_rows(h, inter, a, lo, hi):  # pragma: no cover - compiled
    """a[r] = silu(h[r, :I]) * h[r, I:2I] for rows lo..hi, as NumpyOps writes it, 16 columns at a
    time with cpu_simd.silu_mul's exp (within 1 ulp; NumPy's scalar exp is 10x slower here)."""
    one = np.float32(1.0)
    for r in range(lo, hi):
        for j in range(0, inter - inter % 16, 16):
            simd.store(a, r, j, simd.silu_mul(simd.load(h, r, j), simd.load(h, r, inter + j)))
        for j in range(inter - inter % 16, inter):  # (I a multiple of 8: at most 8 columns)
            g = h[r, j]
            a[r, j] = g / (one + np.exp(-g)) * h[r, inter + j]


@njit(nogil=True, cache=True, inline="always")
def _all_of(w, experts):  # pragma: no cover - compiled
    """``_grouped_chunks``' spans of one chunk of every panel of the groups of ``experts``."""
    edges = np.zeros(2, np.int64)
    edges[1] = experts.shape[0] * w.shape[1]
    return edges


@njit(nogil=True, cache=True)
def _ffn_grouped(xs, gate_up, down, inter, experts, edges):  # pragma: no cover - compiled
    """Per group: ys[lo:hi] = (silu(g) * u) @ down[e], [g | u] = xs[lo:hi] @ gate_up[e] (each a
    (panels, scales, block) triple), on this thread (``moe`` shares the products out otherwise)."""
    h = np.empty((xs.shape[0], 16 * gate_up[0].shape[1]), np.float32)  # [n, 2I] (int8: padded to 16)
    op = _operand_of(xs, gate_up[0], gate_up[2])
    _grouped_chunks(
        op, gate_up[0], gate_up[1], gate_up[2], h, experts, edges, _all_of(gate_up[0], experts), np.zeros(2, np.int64)
    )
    a = np.empty((xs.shape[0], inter), np.float32)  # [n, I]
    _silu_mul_rows(h, inter, a, 0, xs.shape[0])
    ys = np.empty((xs.shape[0], 16 * down[0].shape[1]), np.float32)  # [n, D] (int8: padded to 16)
    op = _operand_of(a, down[0], down[2])
    _grouped_chunks(op, down[0], down[1], down[2], ys, experts, edges, _all_of(down[0], experts), np.zeros(2, np.int64))
    return ys


@njit(nogil=True, cache=True)
def _group_rows(x, local, El):  # pragma: no cover - compiled
    """The (token, choice) rows of this rank's experts grouped by expert, tokens in order: (xs [n, D]
    the rows, place [T, k] each row's index in xs or -1 (another rank's), the experts with rows,
    edges [lo0, hi0, lo1, ..] their rows)."""
    T, k = local.shape
    counts = np.zeros(El + 1, np.int64)
    for t in range(T):
        for j in range(k):
            e = local[t, j]
            if 0 <= e < El:
                counts[e + 1] += 1
    for e in range(El):
        counts[e + 1] += counts[e]  # counts[e]: expert e's first row
    place = np.empty((T, k), np.int64)
    fill = counts[:El].copy()
    xs = np.empty((counts[El], x.shape[1]), np.float32)  # [n, D]
    for t in range(T):
        for j in range(k):
            e = local[t, j]
            place[t, j] = -1
            if 0 <= e < El:
                place[t, j] = fill[e]
                xs[fill[e]] = x[t]
                fill[e] += 1
    chosen = np.flatnonzero(counts[1:] > counts[:El])
    edges = np.empty(2 * len(chosen), np.int64)
    for i in range(len(chosen)):
        edges[2 * i], edges[2 * i + 1] = counts[chosen[i]], counts[chosen[i] + 1]
    return xs, place, chosen, edges


@njit(nogil=True, cache=True)
def _weigh(ys, place, weights, out, lo, hi):  # pragma: no cover - compiled
    """out[t] = sum over the k choices of token t in order of weights[t, j] * ys[place[t, j]] (0 where
    place is -1: another rank's expert), for tokens lo..hi."""
    k = place.shape[1]
    for t in range(lo, hi):
        for j in range(k):
            i = place[t, j]
            for d in range(out.shape[1]):
                v = ys[i, d] * weights[t, j] if i >= 0 else np.float32(0.0)
                out[t, d] = v if j == 0 else out[t, d] + v


@njit(nogil=True, cache=True)
def _moe(x, local, weights, gate_up, down, inter, out):  # pragma: no cover - compiled
    """out[t] = sum over the k choices of token t in order of weights[t, j] * ffn(x[t]) through expert
    local[t, j] (0 where it is outside [0, El): another rank's), as NumpyOps' grouped path computes
    it: the (token, choice) rows grouped by expert, tokens in order (``_ffn_grouped``), each
    weighted, then added in choice order; one call on this thread."""
    xs, place, chosen, edges = _group_rows(x, local, gate_up[0].shape[0])
    _weigh(_ffn_grouped(xs, gate_up, down, inter, chosen, edges), place, weights, out, 0, x.shape[0])


@njit(nogil=True, cache=True, inline="always")
def _step_done(phases, i, spans):  # pragma: no cover - compiled
    """Waits (spin-wait hints) until every chunk of step i is done: phases[2 i + 1] counts them."""
    while simd.peek(phases, 2 * i + 1) < spans.shape[0] - 1:
        simd.pause()


@njit(nogil=True, cache=True)
def _moe_team(
    op_up, up, down, inter, experts, edges, place, weights, bufs, spans, phases, counters
):  # pragma: no cover - compiled
    """``_moe``'s steps after the grouping as one shared call (``cpu_pool``): gate_up's panels (op_up:
    the grouped rows' operand; up and down (panels, scales, block) triples; ``_grouped_chunks``),
    each row's SiLU (and for int8 its quantized row), down's panels, then each token's weighted sum
    (bufs = (h, a, down's operand, ys, out); spans: each step's chunk edges). A thread that runs out
    of a step's chunks waits for those others took (phases: [taken, done] of the first three steps;
    counters: the last's)."""
    h, a, op, ys, out = bufs
    _grouped_chunks(op_up, up[0], up[1], up[2], h, experts, edges, spans[0], phases[0:2])
    _step_done(phases, 0, spans[0])
    j = simd.claim(phases, 2)
    while j < spans[1].shape[0] - 1:
        _silu_mul_rows(h, inter, a, spans[1][j], spans[1][j + 1])
        _fill(op, a, down[2], spans[1][j], spans[1][j + 1])
        simd.claim(phases, 3)
        j = simd.claim(phases, 2)
    _step_done(phases, 1, spans[1])
    _grouped_chunks(op, down[0], down[1], down[2], ys, experts, edges, spans[2], phases[4:6])
    _step_done(phases, 2, spans[2])
    j = simd.claim(counters, 0)
    while j < spans[3].shape[0] - 1:
        _weigh(ys, place, weights, out, spans[3][j], spans[3][j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _unfilled(x, w, block):  # pragma: no cover - compiled
    """The operand of x for panels like w (``_operand``), not yet filled (int8: its arrays empty)."""
    return _operand(x, w, block)


@njit(nogil=True, cache=True)
def _exp_rows(scores, n, norm):  # pragma: no cover - compiled
    """scores[h, :n] = exp(scores[h, :n] - their max) (lanes up to the next 16 zeroed), norm[h] =
    1 / their sum (16 lanes, then ``simd.total``)."""
    minus_one = simd.splat(np.float32(-1.0))
    for h in range(scores.shape[0]):
        top = np.float32(-np.inf)
        for s in range(n):
            top = max(top, scores[h, s])
        for s in range(0, n, 16):  # the lanes past n are set to 0 below
            simd.store(scores, h, s, simd.exp(simd.add(simd.load(scores, h, s), simd.mul(simd.splat(top), minus_one))))
        for s in range(n, n + (-n) % 16):
            scores[h, s] = np.float32(0.0)
        sum_p = simd.zeros()
        for s in range(0, n, 16):
            sum_p = simd.add(sum_p, simd.load(scores, h, s))
        norm[h] = np.float32(1.0) / simd.total(sum_p)


@njit(nogil=True, cache=True)
def _attend_rows(q, keys, values, BS, Hk, tables, lens, scale, out, lo, hi):  # pragma: no cover - compiled
    """out[b, h] = softmax((q[b, h] scale) . K) V for rows b in lo..hi over row b's lens[b]
    positions, read where its block table puts them (no gather) from keys / values [slot, Hk Dh],
    GQA head h on kv head h // (H / Hk); Dh a multiple of 16. Each position's keys and values (all
    heads, one contiguous row of the cache) are read once, for every head, in position order."""
    H, Dh = q.shape[1], q.shape[2]
    group = H // Hk
    query = np.empty((H, Dh), np.float32)  # [H, Dh]
    acc = np.empty((H, Dh), np.float32)  # [H, Dh]
    longest = 0
    for b in range(lo, hi):
        longest = max(longest, lens[b])
    scores = np.empty((H, longest + 16), np.float32)  # [H, S] padded to whole lanes
    norm = np.empty(H, np.float32)
    for b in range(lo, hi):
        n = lens[b]
        for h in range(H):
            for d in range(Dh):
                query[h, d] = q[b, h, d] * scale
        for s in range(n):
            row = tables[b, s // BS] * BS + s % BS
            if s + KV_PREFETCH_POSITIONS < n:  # the keys a few positions on, and this one's values
                t = s + KV_PREFETCH_POSITIONS
                ahead = tables[b, t // BS] * BS + t % BS
                for j in range(0, Hk * Dh, 16):
                    _prefetch(keys, ahead, j)
            for j in range(0, Hk * Dh, 16):
                _prefetch(values, row, j)
            for h in range(H):
                col = (h // group) * Dh
                v = simd.zeros()
                for d in range(0, Dh, 16):
                    v = simd.add(v, simd.mul(simd.load(query, h, d), simd.load(keys, row, col + d)))
                scores[h, s] = simd.total(v)
        _exp_rows(scores, n, norm)
        for h in range(H):
            for d in range(0, Dh, 16):
                simd.store(acc, h, d, simd.zeros())
        for s in range(n):
            row = tables[b, s // BS] * BS + s % BS
            for h in range(H):
                col = (h // group) * Dh
                p = simd.splat(scores[h, s])
                for d in range(0, Dh, 16):
                    simd.store(acc, h, d, simd.add(simd.load(acc, h, d), simd.mul(p, simd.load(values, row, col + d))))
        for h in range(H):
            for d in range(Dh):
                out[b, h, d] = acc[h, d] * norm[h]


@njit(nogil=True, cache=True)
def _decode_attention(q, k_cache, v_cache, tables, lens, scale, out, spans, counters):  # pragma: no cover - compiled
    """``_attend_rows`` of every row, in chunks of rows spans[j] .. spans[j + 1] taken one at a time
    (each row is its own)."""
    Dh = q.shape[2]
    NB, BS, Hk = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    keys = k_cache.reshape(NB * BS, Hk * Dh)  # [slot, Hk Dh]
    values = v_cache.reshape(NB * BS, Hk * Dh)
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        _attend_rows(q, keys, values, BS, Hk, tables, lens, scale, out, spans[j], spans[j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _block_sum(a, lo, n):  # pragma: no cover - compiled
    """NumPy's float32 sum of a block of up to 128 items: eight accumulators joined pairwise, then
    the rest in order (below 8 items, in order)."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(nogil=True, cache=True)
def _pairwise_sum(a, n):  # pragma: no cover - compiled
    """a[:n] summed as NumPy sums float32 (its pairwise sum: blocks of up to 128 items; above, the
    halves' sums added, a half a multiple of 8 long), so the bits are NumPy's. The recursion runs
    on an explicit stack (numba's cache does not take recursive functions)."""
    starts = np.empty(128, np.int64)  # tasks: (start, length); length -1 joins the top two sums
    lengths = np.empty(128, np.int64)
    sums = np.empty(64, np.float32)
    starts[0], lengths[0] = 0, n
    tasks, done = 1, 0
    while tasks > 0:
        tasks -= 1
        lo, m = starts[tasks], lengths[tasks]
        if m < 0:
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
        elif m <= 128:
            sums[done] = _block_sum(a, lo, m)
            done += 1
        else:
            half = m // 2
            half -= half % 8
            starts[tasks], lengths[tasks] = 0, -1  # join, after both halves
            starts[tasks + 1], lengths[tasks + 1] = lo + half, m - half  # right, second
            starts[tasks + 2], lengths[tasks + 2] = lo, half  # left, first
            tasks += 3
    return sums[0]


@njit(nogil=True, cache=True)
def _bucket_sums(keys, values, out):  # pragma: no cover - compiled
    """out[keys[i]] += float64(values[i]) for i in order; False (out partly summed) at a key outside
    [0, len(out))."""
    for i in range(keys.shape[0]):
        k = keys[i]
        if k < 0 or k >= out.shape[0]:
            return False
        out[k] += np.float64(values[i])
    return True


@njit(nogil=True, cache=True)
def _shift_rows(logits, x):  # pragma: no cover - compiled
    """x[t] = logits[t] - max(logits[t]) (NaN when the row holds one, as np.max gives)."""
    for t in range(logits.shape[0]):
        top = logits[t, 0]
        for e in range(logits.shape[1]):
            v = logits[t, e]
            if v > top or v != v:
                top = v if top == top else top
        for e in range(logits.shape[1]):
            x[t, e] = logits[t, e] - top


@njit(nogil=True, cache=True)
def _top_k_rows(probs, top_k, renormalize, weights, ids, counts):  # pragma: no cover - compiled
    """NumpyOps.router after its exp: probs[t] /= its sum (NumPy's pairwise sum), then the top_k of
    each row as a stable argsort of -probs picks them (ties to the lower id, NaN last), their probs
    (divided by their sum with ``renormalize``); then ``_count_experts`` of the ids into counts
    (length 0: not counted)."""
    E = probs.shape[1]
    taken = np.zeros(E, np.bool_)
    for t in range(probs.shape[0]):
        total = _pairwise_sum(probs[t], E)
        for e in range(E):
            probs[t, e] = probs[t, e] / total
            taken[e] = False
        for j in range(top_k):
            best = -1
            for e in range(E):
                if not taken[e]:
                    a, b = -probs[t, e], -probs[t, best] if best >= 0 else np.float32(0.0)
                    if best < 0 or a < b or (b != b and a == a):
                        best = e
            taken[best] = True
            ids[t, j], weights[t, j] = best, probs[t, best]
        if renormalize:
            total = _pairwise_sum(weights[t], top_k)
            for j in range(top_k):
                weights[t, j] = weights[t, j] / total
    _count_experts(ids, counts)


@njit(nogil=True, cache=True)
def _kv_write(k_cache, v_cache, k, v, slots):  # pragma: no cover - compiled
    """k_cache / v_cache [NB, BS, ..] at slot slots[t] = k[t] / v[t], slots below 0 skipped."""
    BS = k_cache.shape[1]
    for t in range(slots.shape[0]):
        s = slots[t]
        if s >= 0:
            k_cache[s // BS, s % BS] = k[t]
            v_cache[s // BS, s % BS] = v[t]


@njit(nogil=True, cache=True)
def _count_experts(ids, counts):  # pragma: no cover - compiled
    """counts[e] += 1 for each id e of ids [T, k] in [0, len(counts))."""
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if 0 <= e < counts.shape[0]:
                counts[e] += 1


@njit(nogil=True, cache=True)
def _rms_norm(x, weight, eps, y):  # pragma: no cover - compiled
    """y[t] = x[t] / sqrt(sum(x[t]^2) / D + eps) * weight, float32, NumpyOps.rms_norm's operations."""
    D = x.shape[1]
    square = np.empty(D, np.float32)  # [D]
    for t in range(x.shape[0]):
        for i in range(D):
            square[i] = x[t, i] * x[t, i]
        scale = np.sqrt(_pairwise_sum(square, D) / np.float32(D) + eps)
        for i in range(D):
            y[t, i] = (x[t, i] / scale) * weight[i]


@njit(nogil=True, cache=True)
def _rope(x, positions, cos_sin, y):  # pragma: no cover - compiled
    """y[t, h] = x[t, h] rotated by row positions[t] of cos_sin [P, Dh] (cos | sin halves), as
    NumpyOps.rope: [x1 cos - x2 sin | x2 cos + x1 sin]."""
    half = x.shape[2] // 2
    for t in range(x.shape[0]):
        row = cos_sin[positions[t]]
        for h in range(x.shape[1]):
            for i in range(half):
                c, s, x1, x2 = row[i], row[half + i], x[t, h, i], x[t, h, half + i]
                y[t, h, i] = x1 * c - x2 * s
                y[t, h, half + i] = x2 * c + x1 * s


@njit(nogil=True, cache=True)
def _add_rms_norm(x, residual, weight, eps, y, s):  # pragma: no cover - compiled
    """s = x + residual, then y = ``_rms_norm`` of s: NumpyOps.add_rms_norm's operations, one call."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            s[t, i] = x[t, i] + residual[t, i]
    _rms_norm(s, weight, eps, y)


@njit(nogil=True, cache=True, inline="always")
def _norm_rope(src, lo, norm, eps, row, dst, normed):  # pragma: no cover - compiled
    """dst[:Dh] = src[lo : lo + Dh] as ``_rms_norm`` with weight ``norm`` makes it (norm of length 0:
    as it is), then rotated as ``_rope`` by cos | sin ``row`` [Dh]; ``normed`` [Dh] is scratch."""
    Dh = dst.shape[0]
    half = Dh // 2
    if norm.shape[0]:
        for i in range(Dh):
            normed[i] = src[lo + i] * src[lo + i]
        scale = np.sqrt(_pairwise_sum(normed, Dh) / np.float32(Dh) + eps)
        for i in range(Dh):
            normed[i] = (src[lo + i] / scale) * norm[i]
    else:
        for i in range(Dh):
            normed[i] = src[lo + i]
    for i in range(half):
        c, s, x1, x2 = row[i], row[half + i], normed[i], normed[half + i]
        dst[i] = x1 * c - x2 * s
        dst[half + i] = x2 * c + x1 * s


@njit(nogil=True, cache=True)
def _qk_rope_kv_write(
    q_in, qo, k, ko, v, vo, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slots, q, lo, hi
):  # pragma: no cover
    """q [T, H, Dh] from columns qo.. of q_in [T, H Dh +], and row t's k and v (columns ko.. of k,
    vo.. of v [T, Hk Dh +]) written to the caches [NB, BS, Hk, Dh] at slot slots[t] (below 0: not
    written), q and k each head normed (``_rms_norm``'s operations, with q_norm / k_norm [Dh];
    length 0: not normed) and rotated by cos_sin[positions[t]] (``_rope``'s), v as it is: the
    model's steps' bits, for rows lo..hi. q_in, k and v may be one product (a qkv)."""
    H, Dh = q.shape[1], q.shape[2]
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    normed = np.empty(Dh, np.float32)  # [Dh]
    for t in range(lo, hi):
        row = cos_sin[positions[t]]
        for h in range(H):
            _norm_rope(q_in[t], qo + h * Dh, q_norm, eps, row, q[t, h], normed)
        slot = slots[t]
        if slot >= 0:
            block, at = slot // BS, slot % BS
            for h in range(Hk):
                _norm_rope(k[t], ko + h * Dh, k_norm, eps, row, k_cache[block, at, h], normed)
                for i in range(Dh):
                    v_cache[block, at, h, i] = v[t, vo + h * Dh + i]


@njit(nogil=True, cache=True)
def _qk_rope_chunks(q_in, k, v, norms, eps, positions, cos_sin, kv, slots, q, spans, counters):  # pragma: no cover
    """``_qk_rope_kv_write`` of q_in, k, v (each from column 0) into the caches kv in chunks of rows
    spans[j] .. spans[j + 1] taken one at a time (``cpu_pool``; each row is its own)."""
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        rows = (q, spans[j], spans[j + 1])
        _qk_rope_kv_write(q_in, 0, k, 0, v, 0, norms[0], norms[1], eps, positions, cos_sin, kv[0], kv[1], slots, *rows)
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _qkv_rows(x, qkv, norms, eps, positions, cos_sin, kv, slots, h, q, lo, hi):  # pragma: no cover - compiled
    """Rows lo..hi of h [T, Q + 2KV] = x [T, D] @ qkv (panels, scales, block), then
    ``_qk_rope_kv_write`` of its q heads into q [T, H, Dh] and its k and v into the caches kv."""
    H, Dh, Hk = q.shape[1], q.shape[2], kv[0].shape[2]
    nq, nk = H * Dh, Hk * Dh
    op = _operand(x, qkv[0], qkv[2])
    _fill(op, x, qkv[2], lo, hi)
    _product(op, qkv[0], qkv[1], qkv[2], h, lo, hi, 0, qkv[0].shape[0])
    rows = (q, lo, hi)
    _qk_rope_kv_write(h, 0, h, nq, h, nq + nk, norms[0], norms[1], eps, positions, cos_sin, kv[0], kv[1], slots, *rows)


@njit(nogil=True, cache=True)
def _attend_o_rows(q, kv, tables, lens, scale, o, a, y, lo, hi):  # pragma: no cover - compiled
    """Rows lo..hi of a [T, H, Dh] = ``_attend_rows`` of q over the caches kv, then y = a @ o."""
    T, H, Dh = q.shape[0], q.shape[1], q.shape[2]
    NB, BS, Hk = kv[0].shape[0], kv[0].shape[1], kv[0].shape[2]
    keys, values = kv[0].reshape(NB * BS, Hk * Dh), kv[1].reshape(NB * BS, Hk * Dh)  # [slot, Hk Dh]
    _attend_rows(q, keys, values, BS, Hk, tables, lens, scale, a, lo, hi)
    a2 = a.reshape(T, H * Dh)  # [T, H Dh]
    op = _operand(a2, o[0], o[2])
    _fill(op, a2, o[2], lo, hi)
    _product(op, o[0], o[1], o[2], y, lo, hi, 0, o[0].shape[0])


@njit(nogil=True, cache=True)
def _attention_block(
    x, qkv, o, norms, eps, positions, cos_sin, kv, slots, tables, lens, scale, h, q, a, y
):  # pragma: no cover - compiled
    """y [T, 16 C] = (attention of x [T, D]) @ o: the qkv product (qkv and o (panels, scales, block)
    triples) into h [T, Q + 2KV], ``_qk_rope_kv_write`` of its q heads into q [T, H, Dh] and the k
    and v after them into the caches kv = (k_cache, v_cache), ``_attend_rows`` into a, the o
    product: Ops.attention_decode_block's steps with their bits, on this thread, in one call."""
    T = x.shape[0]
    _qkv_rows(x, qkv, norms, eps, positions, cos_sin, kv, slots, h, q, 0, T)
    _attend_o_rows(q, kv, tables, lens, scale, o, a, y, 0, T)


@njit(nogil=True, cache=True)
def _qkv_chunks(x, qkv, norms, eps, positions, cos_sin, kv, slots, h, q, spans, counters):  # pragma: no cover
    """``_qkv_rows`` of every row in chunks of rows spans[j] .. spans[j + 1] taken one at a time."""
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        _qkv_rows(x, qkv, norms, eps, positions, cos_sin, kv, slots, h, q, spans[j], spans[j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


@njit(nogil=True, cache=True)
def _attend_o_chunks(q, kv, tables, lens, scale, o, a, y, spans, counters):  # pragma: no cover - compiled
    """``_attend_o_rows`` of every row in chunks of rows spans[j] .. spans[j + 1] taken one at a time."""
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        _attend_o_rows(q, kv, tables, lens, scale, o, a, y, spans[j], spans[j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """[T, D]: RMSNorm of x[T, D] (float32) with the bits of NumpyOps.rms_norm, in one call."""
    y = np.empty(x.shape, dtype=np.float32)  # [T, D]
    _rms_norm(np.ascontiguousarray(x), weight, np.float32(eps), y)
    return y


def rope(x: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray) -> np.ndarray:
    """[T, H, Dh]: NumpyOps.rope's rotation of x[T, H, Dh] (float32), the same bits, in one call."""
    y = np.empty(x.shape, dtype=np.float32)  # [T, H, Dh]
    _rope(np.ascontiguousarray(x), positions, cos_sin, y)
    return y


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float) -> tuple:
    """(rms_norm(s), s), s = x + residual (float32 [T, D]): NumpyOps.add_rms_norm's bits in one call."""
    y, s = np.empty(x.shape, dtype=np.float32), np.empty(x.shape, dtype=np.float32)  # [T, D]
    _add_rms_norm(np.ascontiguousarray(x), np.ascontiguousarray(residual), weight, np.float32(eps), y, s)
    return y, s


_NO_NORM = np.empty(0, np.float32)  # _qk_rope_kv_write's norm weights where a model has none


def qk_rope_kv_write(q, k, v, q_norm, k_norm, eps: float, positions, cos_sin, k_cache, v_cache, slots, threads=1):
    """[T, H, Dh]: Ops.qk_rope_kv_write of float32 q [T, H, Dh], k, v [T, Hk, Dh] (views allowed),
    float32 caches, norms and cos_sin [P, Dh] (every dim rotated), with the bits of its steps apart,
    in one call (rows shared out over ``threads``, each row whole on one thread)."""
    out = np.empty(q.shape, dtype=np.float32)  # [T, H, Dh]
    norms = (_NO_NORM if q_norm is None else q_norm, _NO_NORM if k_norm is None else k_norm)
    q2, k2, v2 = (a.reshape(a.shape[0], a.shape[1] * a.shape[2]) for a in (q, k, v))  # [T, H Dh] (views of views)
    args = (q2, k2, v2, norms, np.float32(eps), positions, cos_sin, (k_cache, v_cache), slots, out)
    threads = threads if q.shape[0] >= ROWS_PER_THREAD * threads else 1
    share(_qk_rope_chunks, args, q.shape[0], threads)
    return out


def attention_block(
    x, qkv, o, heads: int, q_norm, k_norm, eps: float, positions, cos_sin, kv, slots, tables, lens, scale, threads=1
):
    """[T, D]: Ops.attention_decode_block of float32 x [T, D] through resident panels qkv [(H + 2 Hk)
    Dh, D] and o [D, H Dh], float32 caches kv = (k_cache, v_cache) [NB, BS, Hk, Dh] (Dh a multiple
    of 16), norms and cos_sin [P, Dh] (every dim rotated), with the bits of its ops apart, in one
    call (with ROWS_PER_THREAD rows a thread and up, two: rows shared out over ``threads``)."""
    y = np.empty((x.shape[0], LANES * _triple(o)[0].shape[0]), dtype=np.float32)  # [T, D] (int8: padded to 16)
    norms = (_NO_NORM if q_norm is None else q_norm, _NO_NORM if k_norm is None else k_norm)
    tables, lens = np.ascontiguousarray(tables, dtype=np.int32), np.ascontiguousarray(lens, dtype=np.int32)
    x = np.ascontiguousarray(x)
    N, T, (qkv, o), Dh = _size(o)[0], x.shape[0], (_triple(qkv), _triple(o)), kv[0].shape[3]
    h = np.empty((T, LANES * qkv[0].shape[0]), np.float32)  # [T, Q + 2KV] (int8: padded to 16)
    q, a = np.empty((T, heads, Dh), np.float32), np.empty((T, heads, Dh), np.float32)  # [T, H, Dh]
    first = (x, qkv, norms, np.float32(eps), positions, cos_sin, kv, slots, h, q)
    then = (q, kv, tables, lens, np.float32(scale), o, a, y)
    if threads == 1 or T < ROWS_PER_THREAD * threads:
        _attention_block(x, qkv, o, *first[2:8], tables, lens, np.float32(scale), h, q, a, y)
    else:  # each step's rows shared out, the caches all written before any row attends
        share(_qkv_chunks, first, T, threads, even=BLOCK_CHUNKS_PER_THREAD)
        share(_attend_o_chunks, then, T, threads, even=BLOCK_CHUNKS_PER_THREAD)
    return y if N == y.shape[1] else np.ascontiguousarray(y[:, :N])


def kv_write(k_cache, v_cache, k, v, slot_mapping) -> None:
    """NumpyOps.kv_write in one call (a row copy per token; the NumPy expression's index arrays cost
    more than the copies at decode)."""
    _kv_write(k_cache, v_cache, k, v, slot_mapping)


_NO_COUNTS = np.empty(0, np.int32)  # router's counts where the caller counts nothing


def router(logits, top_k: int, renormalize: bool, counts=None) -> tuple:
    """NumpyOps.router's (weights [T, k], ids [T, k]) with its bits in three calls: the shift and the
    pick compiled, the exp NumPy's own (its vector exp's bits); the pick also adds the ids to
    counts [E] (int32) when given, as ``count_experts``."""
    x = np.empty(logits.shape, np.float32)  # [T, E]
    _shift_rows(np.ascontiguousarray(logits, dtype=np.float32), x)
    return _exp_pick(x, top_k, renormalize, counts)


def _exp_pick(shifted, top_k: int, renormalize: bool, counts) -> tuple:
    """The router's last two steps over its shifted logits [T, E] (overwritten): NumPy's exp in place,
    then the compiled pick (weights [T, k], ids [T, k]), counting into counts when given."""
    np.exp(shifted, out=shifted)
    weights, ids = np.empty((len(shifted), top_k), np.float32), np.empty((len(shifted), top_k), np.int32)
    _top_k_rows(shifted, top_k, renormalize, weights, ids, _NO_COUNTS if counts is None else counts)
    return weights, ids


@njit(nogil=True, cache=True)
def _router_shift(x, w, s, block, logits, shifted):  # pragma: no cover - compiled
    """logits = x @ w (panels, ``_linear_one``), then shifted = ``_shift_rows`` of them: one call."""
    _linear_one(x, w, s, block, logits)
    _shift_rows(logits, shifted)


def route_rows(x, w, top_k: int, renormalize: bool, counts=None) -> tuple:
    """``router``'s (weights, ids) of the logits x[T, D] @ w.T (unpadded panels w [E, D]), the
    product and the shift in one call, NumPy's exp, then the pick (counting into counts)."""
    data, scales, block = _triple(w)
    logits = np.empty((x.shape[0], LANES * data.shape[0]), np.float32)  # [T, E]
    shifted = np.empty_like(logits)
    _router_shift(np.ascontiguousarray(x), data, scales, block, logits, shifted)
    return _exp_pick(shifted, top_k, renormalize, counts)


def exact_columns(w) -> int:
    """N of resident weights w where their products give exactly N columns, else 0 (int8 pads N to 16)."""
    N = _size(w)[0]
    return N if N % LANES == 0 else 0


def count_experts(ids, counts) -> None:
    """NumpyOps.count_experts in one call."""
    _count_experts(ids, counts)


ROWS_PER_THREAD = 4  # a prologue or attention block of fewer rows a thread stays on one thread
BLOCK_CHUNKS_PER_THREAD = 2  # an attention block's chunks a thread (each reads all its weights)


def decode_attention(q, k_cache, v_cache, block_tables, lens, scale: float, threads: int = 1) -> np.ndarray:
    """[B, H, Dh]: NumpyOps.attention_decode of q[B, H, Dh] over float32 caches [NB, BS, Hk, Dh]
    (Dh a multiple of 16), each row's positions read in place through block_tables[B, MB]."""
    out = np.empty(q.shape, dtype=np.float32)  # [B, H, Dh]
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)  # (the ops' index arrays: no copy)
    lens = np.ascontiguousarray(lens, dtype=np.int32)
    args = (np.ascontiguousarray(q), k_cache, v_cache, tables, lens, np.float32(scale), out)
    if threads == 1 or q.shape[0] == 1:  # one chunk, on this thread
        _decode_attention(*args, spans(q.shape[0], 1), new_counters())
    else:
        share(_decode_attention, args, q.shape[0], threads)
    return out


def bucket_sums(keys: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """np.bincount(keys, weights=values, minlength=n) of int keys below n and float32 values, the
    same float64 sums (each bucket's values added in index order) in one compiled pass: NumPy's
    ran 8 - 10x slower on a vocabulary's 151936 values."""
    out = np.zeros(n, dtype=np.float64)  # [n]
    if not _bucket_sums(np.ascontiguousarray(keys), np.ascontiguousarray(values, dtype=np.float32), out):
        return np.bincount(keys, weights=values, minlength=n)  # (its error names the bad key)
    return out


_UNIT_SCALES: dict = {}  # leading shape -> cpu_weights.unit_scales of panels of that shape


def _operand_for_call(x, data, block):
    """x itself for float panels; for int8 panels its rows quantized (``_operand_of``)."""
    return _operand_of(x, data, block) if data.dtype == np.int8 else x


def _triple(w) -> tuple:
    """(panels, scales, k per scale) of resident weights w: float32 or bfloat16 panels (an
    ndarray [.., C, K, 16]: unit scales, one block) or ScaledPanels."""
    if isinstance(w, ScaledPanels):
        return w.data, w.scales, w.block
    scales = _UNIT_SCALES.get(w.shape[:-2])
    if scales is None:
        scales = _UNIT_SCALES.setdefault(w.shape[:-2], unit_scales(w))
    return w, scales, max(w.shape[-2], 1)


def _experts(w) -> int:
    """El of an expert stack of resident weights."""
    return w.shape[0]


def _size(w) -> tuple:
    """(N, K) of the matrices of resident weights w (int8 panels are padded past them)."""
    return (w.rows, w.cols) if isinstance(w, ScaledPanels) else (LANES * w.shape[-3], w.shape[-2])


def moe(x, local, weights, gate_up, down, threads: int = 1) -> np.ndarray:
    """[T, D]: the MoE output of x[T, D] (float32) over each token's k choices local[T, k] (this
    rank's experts; others outside [0, El)) with routing weights[T, k] (float32), through gate/up
    gate_up[El, 2I, D], SiLU and down down[El, D, I] (resident panels, ``cpu_weights``): one call on
    one thread, else the two products shared out (the same bits)."""
    out = np.empty(x.shape, dtype=np.float32)  # [T, D]
    x, local = np.ascontiguousarray(x), np.ascontiguousarray(local, dtype=np.int32)  # (the router's ids: no copy)
    w = np.ascontiguousarray(weights, dtype=np.float32)
    inter = _size(down)[1]
    if threads > 1:
        touched = min(local.size, _experts(gate_up))  # experts the tokens can reach, at most
        threads = threads_for(threads, touched * (gate_up.nbytes + down.nbytes) // max(1, _experts(gate_up)))
    if threads == 1:
        _moe(x, local, w, _triple(gate_up), _triple(down), inter, out)
    else:
        _moe_shared(x, local, w, gate_up, down, inter, out, threads)
    return out


def _moe_shared(x, local, weights, gate_up, down, inter: int, out, threads: int) -> None:
    """``_moe``'s steps shared out over ``threads`` threads in one call (``_moe_team``; the same bits)."""
    xs, place, chosen, edges = _group_rows(x, local, _experts(gate_up))
    up, dn = _triple(gate_up), _triple(down)
    n, groups = len(xs), len(chosen)
    h = np.empty((n, LANES * up[0].shape[1]), np.float32)  # [n, 2I] (int8: padded to 16)
    a = np.empty((n, inter), np.float32)  # [n, I]
    bufs = (h, a, _unfilled(a, dn[0], dn[2]), np.empty((n, LANES * dn[0].shape[1]), np.float32), out)
    units = (groups * up[0].shape[1], n, groups * dn[0].shape[1], len(x))
    steps = tuple(spans(u, threads) for u in units)
    args = (_operand_for_call(xs, up[0], up[2]), up, dn, inter, chosen, edges, place, weights, bufs, steps)
    POOL.run(_moe_team, (*args, np.zeros(6, np.int64)), new_counters(), len(steps[3]) - 1, threads)


def _grouped_product(x, w, experts, edges, threads: int) -> np.ndarray:
    """y[n, 16 C]: rows edges[2i]..edges[2i+1] of x[n, K] through expert experts[i] of resident
    weights w (int8: columns padded to 16); rows outside every group stay zero."""
    data, scales, block = _triple(w)
    y = np.zeros((x.shape[0], LANES * data.shape[1]), dtype=np.float32)
    op = _operand_for_call(np.ascontiguousarray(x, dtype=np.float32), data, block)
    share(_grouped_chunks, (op, data, scales, block, y, experts, edges), len(experts) * data.shape[1], threads)
    return y


def expert_rows(x: np.ndarray, w, experts: np.ndarray, edges: np.ndarray, threads: int = 1) -> np.ndarray:
    """y[n, N]: rows edges[2i]..edges[2i+1] of x[n, K] (float32) through expert experts[i] of
    w[El, N, K] (resident panels); rows outside every group stay zero."""
    threads = threads_for(threads, len(experts) * w.nbytes // max(1, _experts(w)))
    y = _grouped_product(x, w, experts.astype(np.int64), edges.astype(np.int64), threads)
    N = _size(w)[0]
    return y if N == y.shape[1] else np.ascontiguousarray(y[:, :N])


def product(x: np.ndarray, w, threads: int = 1) -> np.ndarray:
    """y[T, N] = x[T, K] @ w.T, w[N, K] resident panels (``cpu_weights``)."""
    data, scales, block = _triple(w)
    y = np.empty((x.shape[0], LANES * data.shape[0]), dtype=np.float32)  # [T, N] (int8: padded to 16)
    x = np.ascontiguousarray(x, dtype=np.float32)
    threads = threads_for(threads, w.nbytes) if threads > 1 else 1
    if threads == 1:
        _linear_one(x, data, scales, block, y)
    else:
        op = _operand_for_call(x, data, block)
        share(_linear_chunks, (op, data, scales, block, y), data.shape[0], threads)
    N = w.rows if isinstance(w, ScaledPanels) else y.shape[1]  # (int8 panels are padded past N)
    return y if N == y.shape[1] else np.ascontiguousarray(y[:, :N])


@njit(nogil=True, cache=True)
def _layer_front(h, residual, norms, eps, qkv, o, qk_norms, meta, kv, scale, router, bufs):  # pragma: no cover
    """A decode layer up to its router's shifted logits (``decode_layer``): x = the input norm of h
    (and the residual; none at layer 0: rms_norm, the residual h), ``_attention_block`` of x, the
    post-attention ``_add_rms_norm`` into x2 and the residual s2, ``_router_shift`` of x2. norms =
    (input, post); meta = (positions, cos_sin, slots, tables, lens); bufs = (x, s1, hq, q, a, y, x2,
    s2, logits, shifted)."""
    x, s1, hq, q, a, y, x2, s2, logits, shifted = bufs
    positions, cos_sin, slots, tables, lens = meta
    if residual.shape[0] == 0:
        _rms_norm(h, norms[0], eps, x)
        res = h
    else:
        _add_rms_norm(h, residual, norms[0], eps, x, s1)
        res = s1
    args = (eps, positions, cos_sin, kv, slots, tables, lens, scale, hq, q, a, y)
    _attention_block(x, qkv, o, qk_norms, *args)
    _add_rms_norm(y, res, norms[1], eps, x2, s2)
    _router_shift(x2, router[0], router[1], router[2], logits, shifted)


@njit(nogil=True, cache=True)
def _layer_back(
    probs, top_k, renormalize, counts, start, x, gate_up, down, inter, weights, ids, out
):  # pragma: no cover
    """A decode layer from its router's exps probs [T, E] (overwritten): ``_top_k_rows`` (counting),
    then ``_moe`` of x over the choices' local experts (ids less ``start``) into out."""
    _top_k_rows(probs, top_k, renormalize, weights, ids, counts)
    local = np.empty_like(ids)  # [T, k]
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            local[t, j] = ids[t, j] - start
    _moe(x, local, weights, gate_up, down, inter, out)


def layer_parts(layer) -> tuple | None:
    """``decode_layer``'s static arguments for a DecodeLayer of resident panels where its kernels
    take them (float32 norms, the o product's and the router's columns exact), else None."""
    mats = (layer.qkv, layer.o, layer.router)
    vectors = (layer.input_norm, layer.post_norm, *(layer.norms or ()))
    if any(v.dtype != np.float32 for v in vectors) or exact_columns(layer.router) < layer.top_k:
        return None
    if exact_columns(layer.o) != _size(layer.o)[0]:
        return None
    norms = (_NO_NORM, _NO_NORM) if layer.norms is None else layer.norms
    up, down = _triple(layer.w_gate_up), _triple(layer.w_down)
    return (layer.input_norm, layer.post_norm), tuple(_triple(w) for w in mats), norms, up, down, _size(layer.w_down)[1]


_FIRST = np.empty((0, 0), np.float32)  # _layer_front's residual at layer 0 (none)


LAYER_ALONE_BYTES = 2 << 20  # a decode layer's attention and router weights it reads on one thread, at most


def decode_layer(h, residual, layer, kv, meta, counts, threads: int = 1) -> tuple:
    """(this rank's MoE partial [T, D], the residual [T, D]): Ops.decode_layer of float32 h [T, D] in
    two calls and NumPy's exp between them (the router's), with the bits of its ops apart: on this
    thread, but for the experts of a call with ``threads`` > 1 (``moe``'s shared call); the caller
    keeps the attention weights at most LAYER_ALONE_BYTES there (a product shared out waits for a
    helper to join, ~15 - 30 us, more than splitting a smaller one saves). ``layer.compiled`` is
    ``layer_parts``'s."""
    (norms, (qkv, o, router), qk_norms, up, down, inter), (T, D) = layer.compiled, h.shape
    Dh, E, k = kv[0].shape[3], LANES * router[0].shape[0], layer.top_k
    x, s1, y, x2, s2, out = np.empty((6, T, D), np.float32)  # [T, D] each
    q, a = np.empty((2, T, layer.heads, Dh), np.float32)  # [T, H, Dh] each
    logits, probs = np.empty((2, T, E), np.float32)  # [T, E] each
    bufs = (x, s1, np.empty((T, LANES * qkv[0].shape[0]), np.float32), q, a, y, x2, s2, logits, probs)
    residual = _FIRST if residual is None else np.ascontiguousarray(residual)
    positions, cos_sin, slots, tables, lens = meta
    i32 = functools.partial(np.ascontiguousarray, dtype=np.int32)
    meta = (i32(positions), cos_sin, i32(slots), i32(tables), i32(lens))
    args = (norms, np.float32(layer.eps), qkv, o, qk_norms, meta, kv, np.float32(layer.scale), router, bufs)
    _layer_front(np.ascontiguousarray(h), residual, *args)
    if threads > 1:  # the router's pick, then the experts shared out (``moe``; the same bits)
        weights, ids = _exp_pick(probs, k, layer.renormalize, counts)
        return moe(x2, ids - np.int32(layer.local[0]), weights, layer.w_gate_up, layer.w_down, threads), s2
    np.exp(probs, out=probs)
    weights, ids = np.empty((T, k), np.float32), np.empty((T, k), np.int32)
    counts = _NO_COUNTS if counts is None else counts
    _layer_back(probs, k, layer.renormalize, counts, layer.local[0], x2, up, down, inter, weights, ids, out)
    return out, s2


def _sample_weights(kind: str, N: int, K: int, experts: int):
    """Small resident weights [experts, N, K] of ``kind`` (f32, bf16, fp8, int8) for warm_up."""
    from eprt.ops import cpu_weights

    ones = np.ones((experts, N, K), np.float32)
    if kind == "fp8":
        raw = np.full((experts, N, K), 0x38, np.uint8)  # 1.0
        return cpu_weights.fp8_panels(raw, np.ones((experts, -(-N // 16), 1), np.float32), 16, 16, N)
    if kind == "int8":
        return cpu_weights.int8_panels(ones, 32)
    return cpu_weights.float_panels(ones, kind)


def _warm_block(kind: str, o) -> None:
    """Compile (or load) ``attention_block`` for weights of ``kind`` (o: a [16, 16] of them) with the
    argument types the model passes: one q head and one kv head of 16 dims, one row."""
    qkv = _sample_weights(kind, 48, 16, 1)
    qkv = qkv.take(0) if isinstance(qkv, ScaledPanels) else qkv[0]
    caches = (np.zeros((2, 4, 1, 16), np.float32), np.zeros((2, 4, 1, 16), np.float32))  # [NB, BS, Hk, Dh]
    one = np.zeros(1, np.int32)  # positions, slots, lens
    args = (1e-6, one, np.ones((4, 16), np.float32), caches, one, np.zeros((1, 2), np.int32), one + 1, 0.25)
    attention_block(np.ones((1, 16), np.float32), qkv, o, 1, None, None, *args)


def _warm_layer(kind: str, single, gate_up, down) -> None:
    """Compile (or load) ``decode_layer`` for weights of ``kind`` with the argument types the model
    passes (``_warm_block``'s attention of 16 dims, 16 experts), at layer 0 and after."""
    from eprt.ops.base import DecodeLayer

    qkv = _sample_weights(kind, 48, 16, 1)
    qkv = qkv.take(0) if isinstance(qkv, ScaledPanels) else qkv[0]
    norm = np.ones(16, np.float32)
    constants = dict(heads=1, eps=1e-6, scale=0.25, top_k=2, renormalize=True, local=(0, 1))
    layer = DecodeLayer(norm, qkv, single, (norm, norm), norm, single, gate_up, down, **constants)
    layer = dataclasses.replace(layer, compiled=layer_parts(layer))
    caches = (np.zeros((2, 4, 1, 16), np.float32), np.zeros((2, 4, 1, 16), np.float32))  # [NB, BS, Hk, Dh]
    one = np.zeros(1, np.int32)  # positions, slots, lens
    meta = (one, np.ones((4, 16), np.float32), one, np.zeros((1, 2), np.int32), one + 1)
    h = np.ones((1, 16), np.float32)
    _, residual = decode_layer(h, None, layer, caches, meta, np.zeros(16, np.int32))
    decode_layer(h, residual, layer, caches, meta, None)


def warm_products(kind: str, threads: int = 1) -> None:
    """Compile (or load from numba's cache) the products of weights of ``kind`` (f32, bf16, fp8, int8;
    mxfp4: gpt-oss's experts, ``mxfp4_cpu``)."""
    if kind == "mxfp4":
        from eprt.ops import mxfp4_cpu

        mxfp4_cpu.warm_up(threads)
        return
    gate_up, down = _sample_weights(kind, 32, 16, 1), _sample_weights(kind, 16, 16, 1)
    x = np.ones((5, 16), np.float32)  # [n, D]
    single = down.take(0) if isinstance(down, ScaledPanels) else down[0]
    product(x, single)
    _warm_block(kind, single)
    route_rows(x, single, 2, True, np.zeros(16, np.int32))
    if kind != "fp8":  # (the loader keeps FP8 q, k and v apart: no attention_decode_block)
        _warm_layer(kind, single, gate_up, down)
    if threads > 1:  # the shared-out products (those above are too small to be)
        data, scales, block = _triple(single)
        op = _operand_for_call(x, data, block)
        _linear_chunks(op, data, scales, block, np.empty_like(x), spans(data.shape[0], 1), new_counters())
    expert_rows(x, gate_up, np.zeros(1, np.int64), np.array([0, 5], np.int64))
    local, weights = np.zeros((5, 2), np.int32), np.ones((5, 2), np.float32)
    moe(x, local, weights, gate_up, down)
    if threads > 1:
        _moe_shared(x, local, weights, gate_up, down, 16, np.empty_like(x), threads)


def warm_up(threads: int = 1) -> None:
    """Compile (or load from numba's cache) the kernels that take no weights, for the float32
    shapes the ops pass (the products: ``warm_products``, as weights of each kind are loaded)."""
    x = np.ones((5, 7), np.float32)  # [n, K]
    rms_norm(x, np.ones(7, np.float32), 1e-6)
    rope(np.ones((2, 1, 8), np.float32), np.zeros(2, np.int32), np.ones((4, 8), np.float32))
    add_rms_norm(x, x, np.ones(7, np.float32), 1e-6)
    bucket_sums(np.zeros(3, np.int32), np.ones(3, np.float32), 2)
    cache = np.ones((2, 4, 1, 16), np.float32)  # [NB, BS, Hk, Dh]
    rows = np.ones((2, 1, 16), np.float32)  # [T, Hk, Dh]
    kv_write(cache, cache, rows, np.ones((2, 2, 16), np.float32)[:, :1], np.array([1, -1], np.int32))
    norm, table = np.ones(16, np.float32), np.ones((4, 16), np.float32)
    qkv = np.ones((2, 48), np.float32)  # [T, Q + 2KV]: q, k and v as row views of one product, and apart
    for q, k, v in ((qkv[:, a : a + 16].reshape(2, 1, 16) for a in (0, 16, 32)), (rows, rows, rows)):
        qk_rope_kv_write(
            q, k, v, norm, None, 1e-6, np.zeros(2, np.int32), table, cache, cache, np.array([1, -1], np.int32)
        )
    count_experts(np.zeros((3, 2), np.int32), np.zeros(4, np.int32))
    router(np.ones((2, 4), np.float32), 2, True, np.zeros(4, np.int32))
    q = np.ones((1, 2, 16), np.float32)
    decode_attention(q, cache, cache, np.zeros((1, 2), np.int32), np.array([5], np.int32), 0.25, threads)


def main(argv=None) -> int:
    """``python -m eprt.ops.cpu_kernels``: compile every kernel for every weight kind into numba's
    cache ahead of the first start (after installing; a start then only loads them), timing each."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m eprt.ops.cpu_kernels", description=main.__doc__)
    kinds = "f32,bf16,fp8,int8,mxfp4"
    ap.add_argument("--kinds", default=kinds, help=f"weight kinds to compile ({kinds})")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    warm_up(threads=2)
    print(f"kernels without weights: {time.perf_counter() - start:.1f} s", flush=True)
    for kind in args.kinds.split(","):
        t = time.perf_counter()
        warm_products(kind, threads=2)
        print(f"{kind} products: {time.perf_counter() - t:.1f} s", flush=True)
    print(f"numba {VERSION}, cache in {_moe._cache._cache_path}: {time.perf_counter() - start:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
