"""Compiled CPU kernels (numba, the ``cpu`` extra): the grouped small-M expert products.
Imported only when NumpyOps takes the numba path (importing numba takes about a second).

An expert with a few rows (decode) is bandwidth-bound: a GEMV per row re-reads its weights
for every row and OpenBLAS's small-M GEMMs run well below its GEMV rate. ``expert_rows``
streams each expert's weights once for all its rows. Element (r, n) of a product is summed
over k in the same order whatever the group (rows, column tiles), with multiplies and adds
rounded apart (no fused multiply-add), so a row's bits do not depend on how many rows its
expert has (NumpyOps gives it groups of 2 to EXPERT_ROWS_AS_GEMV rows; one row runs a GEMV on
both paths). The first start compiles for tens of seconds; numba caches the result.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

ACC_BYTES = 16 << 10  # accumulator tile of one expert's rows: stays in L1
VERSION = numba.__version__


@njit(nogil=True, cache=True)
def _product(x, w, y, lo, hi, cols):  # pragma: no cover - compiled
    """y[lo:hi] = x[lo:hi] @ w, x[n, K], w[K, N], by column tiles of ``cols``; for every element:
    acc = 0, then acc += (x0 w0 + x1 w1) + (x2 w2 + x3 w3) over k in fours, then the K % 4 rest
    one at a time."""
    K = x.shape[1]
    N = w.shape[1]
    K4 = K - K % 4
    acc = np.empty((hi - lo, cols), np.float32)  # [m, cols]
    for n0 in range(0, N, cols):
        nb = min(cols, N - n0)
        acc[:, :] = 0.0
        for k in range(0, K4, 4):
            w0 = w[k, n0 : n0 + nb]
            w1 = w[k + 1, n0 : n0 + nb]
            w2 = w[k + 2, n0 : n0 + nb]
            w3 = w[k + 3, n0 : n0 + nb]
            r = lo
            while r + 4 <= hi:  # four rows share each weight load
                a0, a1, a2, a3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                b0, b1, b2, b3 = x[r + 1, k], x[r + 1, k + 1], x[r + 1, k + 2], x[r + 1, k + 3]
                c0, c1, c2, c3 = x[r + 2, k], x[r + 2, k + 1], x[r + 2, k + 2], x[r + 2, k + 3]
                d0, d1, d2, d3 = x[r + 3, k], x[r + 3, k + 1], x[r + 3, k + 2], x[r + 3, k + 3]
                ar, br, cr, dr = acc[r - lo], acc[r - lo + 1], acc[r - lo + 2], acc[r - lo + 3]
                for n in range(nb):
                    v0, v1, v2, v3 = w0[n], w1[n], w2[n], w3[n]  # loaded once: the stores below may alias
                    ar[n] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
                    br[n] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
                    cr[n] += (c0 * v0 + c1 * v1) + (c2 * v2 + c3 * v3)
                    dr[n] += (d0 * v0 + d1 * v1) + (d2 * v2 + d3 * v3)
                r += 4
            if r + 2 <= hi:  # two rows
                a0, a1, a2, a3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                b0, b1, b2, b3 = x[r + 1, k], x[r + 1, k + 1], x[r + 1, k + 2], x[r + 1, k + 3]
                ar, br = acc[r - lo], acc[r - lo + 1]
                for n in range(nb):
                    v0, v1, v2, v3 = w0[n], w1[n], w2[n], w3[n]
                    ar[n] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
                    br[n] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
                r += 2
            while r < hi:
                a0, a1, a2, a3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                ar = acc[r - lo]
                for n in range(nb):
                    ar[n] += (a0 * w0[n] + a1 * w1[n]) + (a2 * w2[n] + a3 * w3[n])
                r += 1
        for k in range(K4, K):
            wk = w[k, n0 : n0 + nb]
            for r in range(lo, hi):
                a = x[r, k]
                ar = acc[r - lo]
                for n in range(nb):
                    ar[n] += a * wk[n]
        y[lo:hi, n0 : n0 + nb] = acc[:, :nb]


@njit(nogil=True, cache=True)
def _grouped(x, w, y, experts, edges):  # pragma: no cover - compiled
    for i in range(experts.shape[0]):
        lo, hi = edges[2 * i], edges[2 * i + 1]
        if hi > lo:
            cols = max(16, min(w.shape[2], ACC_BYTES // (4 * (hi - lo)) // 16 * 16))
            _product(x, w[experts[i]], y, lo, hi, cols)


def expert_rows(x: np.ndarray, w_t: np.ndarray, experts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """y[n, N]: rows edges[2i]..edges[2i+1] of x[n, K] (float32) through expert experts[i] of
    w_t[El, K, N] (input-major, C-contiguous float32); rows outside every group stay zero."""
    y = np.zeros((x.shape[0], w_t.shape[2]), dtype=np.float32)  # [n, N]
    _grouped(np.ascontiguousarray(x), w_t, y, experts.astype(np.int64), edges.astype(np.int64))
    return y


def warm_up() -> None:
    """Compile (or load from numba's cache) for the float32 shapes the ops pass."""
    x = np.ones((5, 7), np.float32)  # [n, K]
    w = np.ones((1, 7, 3), np.float32)  # [El, K, N]
    expert_rows(x, w, np.zeros(1, np.int64), np.array([0, 5], np.int64))
