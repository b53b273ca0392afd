"""MXFP4 expert products on the CPU, compiled (numba, the ``cpu`` extra): the weights are read as
stored, two e2m1 values a byte and an e8m0 scale per 32, and decoded as the rows are summed, so a
rank's MXFP4 experts never exist in float32 (NumpyOps' compiled path; without numba
``gptoss_ops`` dequantizes one expert at a time). Each output element is summed per 32-weight block,
then scaled, in one order whatever the rows in the call: a row's bits do not depend on its group.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eprt.ops.mxfp4_format import FP4_VALUES


@njit(nogil=True, cache=True)
def _expert_rows(xs, blocks, scales, experts, edges, lut, out):  # pragma: no cover - compiled
    """out[r] = xs[r] @ dequant(expert e).T for rows edges[2c] .. edges[2c + 1] of experts[c]."""
    n_out, n_blocks = blocks.shape[1], blocks.shape[2]
    for c in range(experts.shape[0]):
        e, lo, hi = experts[c], edges[2 * c], edges[2 * c + 1]
        acc = np.zeros(hi - lo, dtype=np.float32)
        part = np.zeros(hi - lo, dtype=np.float32)
        for o in range(n_out):
            acc[:] = 0.0
            for kb in range(n_blocks):
                part[:] = 0.0
                for j in range(16):
                    byte = blocks[e, o, kb, j]
                    w0, w1, k = lut[byte & 15], lut[byte >> 4], kb * 32 + 2 * j
                    for r in range(hi - lo):
                        part[r] += w0 * xs[lo + r, k] + w1 * xs[lo + r, k + 1]
                scale = np.float32(np.ldexp(np.float32(1.0), np.int32(scales[e, o, kb]) - 127))
                for r in range(hi - lo):
                    acc[r] += part[r] * scale
            for r in range(hi - lo):
                out[lo + r, o] = acc[r]


def expert_rows(xs: np.ndarray, blocks: np.ndarray, scales: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """[n, N]: rows bounds[e] .. bounds[e + 1] of xs [n, K] through MXFP4 expert e of blocks
    [El, N, K / 32, 16] / scales [El, N, K / 32]."""
    sizes = np.diff(bounds)
    experts = np.flatnonzero(sizes).astype(np.int64)
    edges = np.empty(2 * len(experts), dtype=np.int64)
    edges[0::2], edges[1::2] = bounds[experts], bounds[experts + 1]
    out = np.empty((len(xs), blocks.shape[1]), dtype=np.float32)
    _expert_rows(np.ascontiguousarray(xs, dtype=np.float32), blocks, scales, experts, edges, FP4_VALUES, out)
    return out
