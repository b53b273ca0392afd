"""bfloat16 as raw bits: NumPy and CuPy have no bfloat16 dtype, so eprt stores it as uint16."""

from __future__ import annotations

import numpy as np


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen uint16 bfloat16 bits to float32 (exact: the bits become the high half)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even); returns the uint16 bit patterns."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    out = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0
    return out
