"""The host side of ``kernels/flash_attention.cu``: prefill attention of one sequence's chunk over
the paged cache on tensor cores, for ``CupyOps.attention_prefill`` and ``mla_attention_prefill``
and gpt-oss's ``attention_sinks_prefill`` (sinks and a sliding window). The callers have checked
their arguments; these functions answer None where the kernel does not take the call (too few
rows to fill a tile, a query not 16-byte aligned, tiles beyond the shared memory) and the caller
runs its CUDA-core kernel.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from eprt.ops.kernel_loader import launch

FILE = "flash_attention.cu"
FLASH_MIN_ROWS = 16  # prefill: (token, query head of a KV head) rows from which the tensor-core kernel runs
FLASH_ROWS = 64  # flash_attention.cu: FA_ROWS query rows per block
# entry points: (kernel, largest DQK and DV, keys per tile, threads)
FLASH_GQA = (("flash_attention_d64", 64, 64, 128), ("flash_attention_d128", 128, 64, 128))
FLASH_GQA += (("flash_attention_d256", 256, 32, 128),)
FLASH_MLA = ("flash_mla", 512, 32, 256)  # DV (C) up to 512; DQK (L) as far as shared memory holds
_BF16 = np.dtype(np.uint16)


@functools.lru_cache(maxsize=64)
def _no_sinks(heads: int, device: int):
    """sinks [H] of -inf: no sink (exp(-inf) adds nothing to a row's denominator)."""
    return cupy.full(heads, -np.inf, dtype=np.float32)


def flash(kernel, q, k_cache, v_cache, block_table, start_pos, scale, layout, smem_limit, window=0, sinks=None):
    """out [T, H, DV] bf16 from ``kernel`` (an entry of FLASH_GQA or FLASH_MLA), or None when its tiles do
    not fit ``smem_limit`` bytes. ``layout`` = (Hk, DV, kv_stride, head_stride) of the cache rows (v_cache
    is k_cache for MLA: values are the first DV columns); ``window`` > 0 limits each row to its last
    ``window`` positions; ``sinks`` [H] fp32 (None: none) adds exp(sink_h) to head h's denominator."""
    name, _, keys, threads = kernel
    Hk, DV, kv_stride, head_stride = layout
    T, H, DQK = q.shape
    G = H // Hk
    ldq, ldv = -(-DQK // 16) * 16 + 8, -(-DV // 16) * 16 + 8
    stage = keys * ldq + (0 if v_cache is k_cache else keys * ldv)
    stages = next((n for n in (2, 1) if 2 * (FLASH_ROWS * ldq + n * stage) <= smem_limit), 0)
    if not stages:
        return None
    out = cupy.empty((T, H, DV), dtype=_BF16)  # [T, H, DV]
    if sinks is None:
        sinks = _no_sinks(H, cupy.cuda.Device().id)
    dims = (T, H, G, DQK, DV, k_cache.shape[1], kv_stride, head_stride, start_pos, window, stages)
    args = (q, k_cache, v_cache, block_table, sinks, out, *map(np.int32, dims), np.float32(scale))
    grid = (-(-T * G // FLASH_ROWS), Hk)
    launch(FILE, name, grid, threads, args, 2 * (FLASH_ROWS * ldq + stages * stage))
    return out


def flash_gqa(q, k_cache, v_cache, block_table, start_pos, scale, smem_limit, window=0, sinks=None):
    """GQA prefill (q [T, H, Dh], caches [NB, BS, Hk, Dh]) on tensor cores, or None where it does not run:
    fewer than FLASH_MIN_ROWS (token, query head of a KV head) rows, a q not 16-byte aligned, Dh > 256."""
    T, H, Dh = q.shape
    Hk = k_cache.shape[2]
    if T * (H // Hk) < FLASH_MIN_ROWS or q.data.ptr % 16 or Dh > FLASH_GQA[-1][1]:
        return None
    kernel = next(f for f in FLASH_GQA if Dh <= f[1])
    layout = (Hk, Dh, Hk * Dh, Dh)
    return flash(kernel, q, k_cache, v_cache, block_table, start_pos, scale, layout, smem_limit, window, sinks)


def flash_mla(q, latent_cache, block_table, start_pos, scale, value_dim, smem_limit):
    """MLA prefill in the latent space (q [T, H, L], latent cache [NB, BS, L], values its first
    ``value_dim`` columns) on tensor cores, or None where it does not run (as ``flash_gqa``; C > 512)."""
    T, H, L = q.shape
    if T * H < FLASH_MIN_ROWS or q.data.ptr % 16 or value_dim > FLASH_MLA[1]:
        return None
    layout = (1, value_dim, L, 0)
    return flash(FLASH_MLA, q, latent_cache, latent_cache, block_table, start_pos, scale, layout, smem_limit)
