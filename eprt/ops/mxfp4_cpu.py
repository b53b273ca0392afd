"""MXFP4 expert products on the CPU, compiled (numba, the ``cpu`` extra): the weights are read as
stored, two e2m1 values a byte and an e8m0 scale per 32, and decoded as the rows are summed, so a
rank's MXFP4 experts never exist in float32 (NumpyOps' compiled path; without numba
``gptoss_ops`` dequantizes one expert at a time). Each output element is summed per 32-weight block,
then scaled, in one order whatever the rows in the call: a row's bits do not depend on its group.
On several threads (``--cpu-threads``) each takes whole ranges of output columns of every group
(``cpu_pool.share``), so neither do they depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eprt.ops import cpu_simd as simd
from eprt.ops.cpu_pool import share, spans, threads_for
from eprt.ops.mxfp4_format import FP4_VALUES

# numba keys this file's cached kernels on its text alone: the sha256 of cpu_simd.py (whose intrinsics
# they compile) is written here, so an edit there changes this file too (tests/test_code_shape.py checks)
SIMD_SOURCE = "ab745cec771954dc"


@njit(nogil=True, cache=True)
def _expert_rows(xs, blocks, scales, experts, edges, lut, out, o0, o1):  # pragma: no cover - compiled
    """out[r, o0:o1] = (xs[r] @ dequant(expert e).T)[o0:o1] for rows edges[2c] .. edges[2c + 1] of experts[c]."""
    n_blocks = blocks.shape[2]
    for c in range(experts.shape[0]):
        e, lo, hi = experts[c], edges[2 * c], edges[2 * c + 1]
        acc = np.zeros(hi - lo, dtype=np.float32)
        part = np.zeros(hi - lo, dtype=np.float32)
        for o in range(o0, o1):
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


@njit(nogil=True, cache=True)
def _expert_chunks(xs, blocks, scales, experts, edges, lut, out, spans, counters):  # pragma: no cover - compiled
    """``_expert_rows`` in chunks taken one at a time (``cpu_pool``): chunk j is output columns
    spans[j] .. spans[j + 1] of every group."""
    j = simd.claim(counters, 0)
    while j < spans.shape[0] - 1:
        _expert_rows(xs, blocks, scales, experts, edges, lut, out, spans[j], spans[j + 1])
        simd.claim(counters, 1)
        j = simd.claim(counters, 0)


def expert_rows(
    xs: np.ndarray, blocks: np.ndarray, scales: np.ndarray, bounds: np.ndarray, threads: int = 1
) -> np.ndarray:
    """[n, N]: rows bounds[e] .. bounds[e + 1] of xs [n, K] through MXFP4 expert e of blocks
    [El, N, K / 32, 16] / scales [El, N, K / 32], on up to ``threads`` threads."""
    sizes = np.diff(bounds)
    experts = np.flatnonzero(sizes).astype(np.int64)
    edges = np.empty(2 * len(experts), dtype=np.int64)
    edges[0::2], edges[1::2] = bounds[experts], bounds[experts + 1]
    out = np.empty((len(xs), blocks.shape[1]), dtype=np.float32)
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    read = len(experts) * (blocks[0].nbytes + scales[0].nbytes) if len(blocks) else 0
    threads = threads_for(threads, read)
    if threads <= 1:
        _expert_rows(xs, blocks, scales, experts, edges, FP4_VALUES, out, 0, blocks.shape[1])
        return out
    share(_expert_chunks, (xs, blocks, scales, experts, edges, FP4_VALUES, out), blocks.shape[1], threads)
    return out


def warm_up(threads: int = 1) -> None:
    """Compile (or load from numba's cache) the MXFP4 products, on one thread and shared out."""
    blocks, scales = np.zeros((1, 2, 1, 16), np.uint8), np.full((1, 2, 1), 127, np.uint8)
    xs, bounds, out = np.ones((2, 32), np.float32), np.array([0, 2]), np.empty((2, 2), np.float32)
    expert_rows(xs, blocks, scales, bounds)
    if threads > 1:  # (too small above to be shared out)
        edges, experts = np.array([0, 2], np.int64), np.zeros(1, np.int64)
        _expert_chunks(xs, blocks, scales, experts, edges, FP4_VALUES, out, spans(2, 1), np.zeros(2, np.int64))
