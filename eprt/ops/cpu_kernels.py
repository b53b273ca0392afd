"""Compiled CPU kernels (numba, the ``cpu`` extra): the matrix products (dense and experts),
norms and rotations. Imported only when NumpyOps takes the numba path (importing numba takes
about a second).

Weights are read from panels (``panels``: 16 output columns' weights contiguous over k), four
rows at a time against each panel with their sums in registers (``cpu_simd``), so a matrix
streams once, in memory order, for all its rows. Element (r, n) of a product is summed over k in
fours in one order whatever the rows in the call, with multiplies and adds rounded apart (no
fused multiply-add), so a row's bits do not depend on its batch-mates. The first start compiles
for tens of seconds; numba caches the result.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from eprt.ops import cpu_simd as simd

PANEL_PREFETCH_LINES = 128  # _panel_product asks for the weights this many 64-byte lines (8 KiB) ahead
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
    a0, a1 = simd.mul(simd.splat(x[r, k]), v0), simd.mul(simd.splat(x[r, k + 1]), v1)
    a2, a3 = simd.mul(simd.splat(x[r, k + 2]), v2), simd.mul(simd.splat(x[r, k + 3]), v3)
    return simd.add(acc, simd.add(simd.add(a0, a1), simd.add(a2, a3)))


@njit(nogil=True, cache=True, inline="always")
def _ahead(lines, i):  # pragma: no cover - compiled
    """Ask for the four 64-byte lines lines[i : i + 4] (rows of a [n, 16] view) into L2, if there."""
    if i + 4 <= lines.shape[0]:
        for j in range(i, i + 4):
            _prefetch(lines, j, 0)


@njit(nogil=True, cache=True, inline="always")
def _four_rows(panel, k):  # pragma: no cover - compiled
    """panel[k : k + 4] of a [K, 16] panel: four k's 16 weights, one line each."""
    return simd.load(panel, k, 0), simd.load(panel, k + 1, 0), simd.load(panel, k + 2, 0), simd.load(panel, k + 3, 0)


@njit(nogil=True, cache=True)
def _panel_product(x, panels, y, lo, hi):  # pragma: no cover - compiled
    """y[lo:hi, :16 C] = x[lo:hi] @ w, w[K, 16 C] stored as panels[C, K, 16] (``panels``): each
    panel's K rows are contiguous, so the weights stream in memory order (the first rows' pass asks
    for them PANEL_PREFETCH_LINES ahead), and four rows' sums of a panel stay in registers over the
    whole of k. Every element is summed in one order (acc = 0, then acc += (x0 w0 + x1 w1) +
    (x2 w2 + x3 w3) over k in fours, then the K % 4 rest one at a time), whatever rows share the
    call."""
    C, K = panels.shape[0], panels.shape[1]
    K4 = K - K % 4
    lines = panels.reshape(C * K, 16)  # [C K, 16] one 64-byte line per row of a panel
    for c in range(C):
        p, n, ahead = panels[c], 16 * c, c * K + PANEL_PREFETCH_LINES
        r = lo
        while r + 4 <= hi:  # four rows share each weight load
            s0, s1, s2, s3 = simd.zeros(), simd.zeros(), simd.zeros(), simd.zeros()
            for k in range(0, K4, 4):
                if r == lo:  # the later rows find the panel in cache
                    _ahead(lines, ahead + k)
                v0, v1, v2, v3 = _four_rows(p, k)
                s0 = _quad(s0, x, r, k, v0, v1, v2, v3)
                s1 = _quad(s1, x, r + 1, k, v0, v1, v2, v3)
                s2 = _quad(s2, x, r + 2, k, v0, v1, v2, v3)
                s3 = _quad(s3, x, r + 3, k, v0, v1, v2, v3)
            for k in range(K4, K):
                v = simd.load(p, k, 0)
                s0 = simd.add(s0, simd.mul(simd.splat(x[r, k]), v))
                s1 = simd.add(s1, simd.mul(simd.splat(x[r + 1, k]), v))
                s2 = simd.add(s2, simd.mul(simd.splat(x[r + 2, k]), v))
                s3 = simd.add(s3, simd.mul(simd.splat(x[r + 3, k]), v))
            simd.store(y, r, n, s0)
            simd.store(y, r + 1, n, s1)
            simd.store(y, r + 2, n, s2)
            simd.store(y, r + 3, n, s3)
            r += 4
        while r < hi:
            s0 = simd.zeros()
            for k in range(0, K4, 4):
                if r == lo:
                    _ahead(lines, ahead + k)
                v0, v1, v2, v3 = _four_rows(p, k)
                s0 = _quad(s0, x, r, k, v0, v1, v2, v3)
            for k in range(K4, K):
                s0 = simd.add(s0, simd.mul(simd.splat(x[r, k]), simd.load(p, k, 0)))
            simd.store(y, r, n, s0)
            r += 1


@njit(nogil=True, cache=True)
def _grouped(x, panels, y, experts, edges):  # pragma: no cover - compiled
    for i in range(experts.shape[0]):
        lo, hi = edges[2 * i], edges[2 * i + 1]
        if hi > lo:
            _panel_product(x, panels[experts[i]], y, lo, hi)


@njit(nogil=True, cache=True)
def _ffn_grouped(x, gate_up, down, y, experts, edges):  # pragma: no cover - compiled
    """Per group: y[lo:hi] = (silu(g) * u) @ down[e], [g | u] = x[lo:hi] @ gate_up[e] (panels), with
    _panel_product's products and SiLU as NumpyOps writes it, 16 columns at a time with
    cpu_simd.silu_mul's exp (within 1 ulp; NumPy's scalar exp is 10x slower here)."""
    inter = down.shape[2]
    h = np.empty((x.shape[0], 2 * inter), np.float32)  # [n, 2I]
    a = np.empty((x.shape[0], inter), np.float32)  # [n, I]
    one = np.float32(1.0)
    for i in range(experts.shape[0]):
        lo, hi = edges[2 * i], edges[2 * i + 1]
        if hi > lo:
            _panel_product(x, gate_up[experts[i]], h, lo, hi)
            for r in range(lo, hi):
                for j in range(0, inter - inter % 16, 16):
                    simd.store(a, r, j, simd.silu_mul(simd.load(h, r, j), simd.load(h, r, inter + j)))
                for j in range(inter - inter % 16, inter):  # (I a multiple of 8: at most 8 columns)
                    g = h[r, j]
                    a[r, j] = g / (one + np.exp(-g)) * h[r, inter + j]
            _panel_product(a, down[experts[i]], y, lo, hi)


@njit(nogil=True, cache=True)
def _moe(x, local, weights, gate_up, down, out):  # pragma: no cover - compiled
    """out[t] = sum over the k choices of token t in order of weights[t, j] * ffn(x[t]) through expert
    local[t, j] (0 where it is outside [0, El): another rank's), as NumpyOps' grouped path computes
    it: the (token, choice) rows grouped by expert, tokens in order (``_ffn_grouped``), each
    weighted, then added in choice order."""
    T, k = local.shape
    El, D = gate_up.shape[0], x.shape[1]
    counts = np.zeros(El + 1, np.int64)
    for t in range(T):
        for j in range(k):
            e = local[t, j]
            if 0 <= e < El:
                counts[e + 1] += 1
    for e in range(El):
        counts[e + 1] += counts[e]  # counts[e]: expert e's first row
    n = counts[El]
    place = np.empty((T, k), np.int64)  # each (token, choice) row's place in xs, -1 elsewhere
    fill = counts[:El].copy()
    xs = np.empty((n, D), np.float32)  # [n, D]
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
    ys = np.empty((n, D), np.float32)  # [n, D]
    _ffn_grouped(xs, gate_up, down, ys, chosen, edges)
    for t in range(T):
        for j in range(k):
            i = place[t, j]
            for d in range(D):
                v = ys[i, d] * weights[t, j] if i >= 0 else np.float32(0.0)
                out[t, d] = v if j == 0 else out[t, d] + v


@njit(nogil=True, cache=True)
def _decode_attention(q, k_cache, v_cache, tables, lens, scale, out):  # pragma: no cover - compiled
    """out[b, h] = softmax((q[b, h] scale) . K) V over row b's lens[b] positions, read where its
    block table puts them (no gather), GQA head h on kv head h // (H / Hk); Dh a multiple of 16.
    Each position's keys and values (all heads, one contiguous row of the cache) are read once,
    for every head, in position order."""
    B, H, Dh = q.shape
    NB, BS, Hk = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = H // Hk
    keys = k_cache.reshape(NB * BS, Hk * Dh)  # [slot, Hk Dh]
    values = v_cache.reshape(NB * BS, Hk * Dh)
    query = np.empty((H, Dh), np.float32)  # [H, Dh]
    acc = np.empty((H, Dh), np.float32)  # [H, Dh]
    longest = 0
    for b in range(B):
        longest = max(longest, lens[b])
    scores = np.empty((H, longest + 16), np.float32)  # [H, S] padded to whole lanes
    norm = np.empty(H, np.float32)
    minus_one = simd.splat(np.float32(-1.0))
    for b in range(B):
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
        for h in range(H):
            top = np.float32(-np.inf)
            for s in range(n):
                top = max(top, scores[h, s])
            for s in range(0, n, 16):  # the lanes past n are set to 0 below
                simd.store(
                    scores, h, s, simd.exp(simd.add(simd.load(scores, h, s), simd.mul(simd.splat(top), minus_one)))
                )
            for s in range(n, n + (-n) % 16):
                scores[h, s] = np.float32(0.0)
            sum_p = simd.zeros()
            for s in range(0, n, 16):
                sum_p = simd.add(sum_p, simd.load(scores, h, s))
            norm[h] = np.float32(1.0) / simd.total(sum_p)
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


def decode_attention(q, k_cache, v_cache, block_tables, lens, scale: float) -> np.ndarray:
    """[B, H, Dh]: NumpyOps.attention_decode of q[B, H, Dh] over float32 caches [NB, BS, Hk, Dh]
    (Dh a multiple of 16), each row's positions read in place through block_tables[B, MB]."""
    out = np.empty(q.shape, dtype=np.float32)  # [B, H, Dh]
    tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    _decode_attention(
        np.ascontiguousarray(q), k_cache, v_cache, tables, np.asarray(lens, np.int64), np.float32(scale), out
    )
    return out


def bucket_sums(keys: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """np.bincount(keys, weights=values, minlength=n) of int keys below n and float32 values, the
    same float64 sums (each bucket's values added in index order) in one compiled pass: NumPy's
    ran 8 - 10x slower on a vocabulary's 151936 values."""
    out = np.zeros(n, dtype=np.float64)  # [n]
    if not _bucket_sums(np.ascontiguousarray(keys), np.ascontiguousarray(values, dtype=np.float32), out):
        return np.bincount(keys, weights=values, minlength=n)  # (its error names the bad key)
    return out


def panels(w: np.ndarray) -> np.ndarray:
    """[.., N / 16, K, 16]: w[.., N, K] (float32, N a multiple of 16) as the panels the expert
    kernels read, panel c holding w[.., 16 c : 16 c + 16, :] transposed."""
    *lead, N, K = w.shape
    return np.ascontiguousarray(w.reshape(*lead, N // simd.LANES, simd.LANES, K).swapaxes(-1, -2))


def moe(x, local, weights, gate_up, down) -> np.ndarray:
    """[T, D]: the MoE output of x[T, D] (float32) over each token's k choices local[T, k] (this
    rank's experts; others outside [0, El)) with routing weights[T, k] (float32), through gate/up
    gate_up[El, 2I / 16, D, 16], SiLU and down down[El, D / 16, I, 16] (``panels``), in one call."""
    out = np.empty((x.shape[0], 16 * down.shape[1]), dtype=np.float32)  # [T, D]
    local = np.ascontiguousarray(local, dtype=np.int64)
    _moe(np.ascontiguousarray(x), local, np.ascontiguousarray(weights, dtype=np.float32), gate_up, down, out)
    return out


def expert_rows(x: np.ndarray, w: np.ndarray, experts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """y[n, N]: rows edges[2i]..edges[2i+1] of x[n, K] (float32) through expert experts[i] of
    w[El, N / 16, K, 16] (``panels``); rows outside every group stay zero."""
    y = np.zeros((x.shape[0], 16 * w.shape[1]), dtype=np.float32)  # [n, N]
    _grouped(np.ascontiguousarray(x), w, y, experts.astype(np.int64), edges.astype(np.int64))
    return y


def product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[T, N] = x[T, K] @ w.T, w[N, K] stored as ``panels`` [N / 16, K, 16] (float32)."""
    y = np.empty((x.shape[0], 16 * w.shape[0]), dtype=np.float32)  # [T, N]
    _panel_product(np.ascontiguousarray(x, dtype=np.float32), w, y, 0, x.shape[0])
    return y


def warm_up() -> None:
    """Compile (or load from numba's cache) for the float32 shapes the ops pass."""
    x = np.ones((5, 7), np.float32)  # [n, K]
    rms_norm(x, np.ones(7, np.float32), 1e-6)
    rope(np.ones((2, 1, 8), np.float32), np.zeros(2, np.int32), np.ones((4, 8), np.float32))
    gate_up, down = panels(np.ones((1, 32, 16), np.float32)), panels(np.ones((1, 16, 16), np.float32))
    x = np.ones((5, 16), np.float32)  # [n, D]
    product(x, down[0])
    expert_rows(x, gate_up, np.zeros(1, np.int64), np.array([0, 5], np.int64))
    moe(x, np.zeros((5, 2), np.int64), np.ones((5, 2), np.float32), gate_up, down)
    bucket_sums(np.zeros(3, np.int32), np.ones(3, np.float32), 2)
    cache = np.ones((2, 4, 1, 16), np.float32)  # [NB, BS, Hk, Dh]
    decode_attention(np.ones((1, 2, 16), np.float32), cache, cache, np.zeros((1, 2), np.int32), np.array([5]), 0.25)
