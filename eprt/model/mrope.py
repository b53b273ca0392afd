"""Qwen3-VL's multimodal inputs to the language model: interleaved 3-D RoPE positions, the
``rope_deltas`` of the tokens after the images, and the layout of one vision row (main
embedding, deepstack embeddings, the placeholder's (t, h, w) position). docs/vision.md.

P prompt tokens, T tokens in a chunk, n image placeholders, D hidden, K deepstack layers, R rope dim.
"""

from __future__ import annotations

import numpy as np

from eprt.model.config import ModelConfig

POSITION_COLUMNS = 3  # (t, h, w) rope position of the placeholder, float32 (exact below 2**24)


def vision_row_width(cfg: ModelConfig) -> int:
    """Values in one vision row: D for a model without MRoPE, else D * (1 + K) + 3."""
    if not cfg.mrope_section:
        return cfg.hidden_size
    return cfg.hidden_size * (1 + cfg.deepstack_layers) + POSITION_COLUMNS


def pack_vision_rows(main: np.ndarray, deepstack: list, positions: np.ndarray) -> np.ndarray:
    """[n, D] main rows, K arrays [n, D] and [n, 3] positions -> the rows broadcast to the workers."""
    return np.concatenate([main, *deepstack, positions.astype(np.float32)], axis=1).astype(np.float32)


def split_vision_rows(cfg: ModelConfig, rows: np.ndarray) -> tuple:
    """Rows [n, W] -> (main [n, D], deepstack [K, n, D], positions [n, 3] int64)."""
    D, K = cfg.hidden_size, cfg.deepstack_layers
    if not cfg.mrope_section:
        return rows, None, None
    deepstack = rows[:, D : D * (1 + K)].reshape(len(rows), K, D).transpose(1, 0, 2)  # [K, n, D]
    return np.ascontiguousarray(rows[:, :D]), np.ascontiguousarray(deepstack), rows[:, D * (1 + K) :].astype(np.int64)


def image_positions(start: int, grid_h: int, grid_w: int) -> np.ndarray:
    """(t, h, w) positions [h*w, 3] of one image's placeholders (merged grid h x w) starting at ``start``."""
    hh, ww = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    return np.stack([np.zeros(grid_h * grid_w, np.int64), hh.ravel(), ww.ravel()], axis=1) + start


def prompt_positions(tokens, image_token_id: int | None, image_pos: np.ndarray | None) -> tuple:
    """3-D positions [3, P] of a prompt and its rope delta (decode token p sits at p + delta on
    every axis), as transformers' get_rope_index: text continues after an image at its largest
    position + 1. ``image_pos``: [n, 3] of the placeholders, in order."""
    P = len(tokens)
    if image_pos is None or len(image_pos) == 0:
        return np.tile(np.arange(P, dtype=np.int64), (3, 1)), 0
    is_image = np.asarray(tokens) == image_token_id  # [P]
    pos = np.empty((3, P), dtype=np.int64)
    current, row = 0, 0
    for p in range(P):
        if is_image[p]:
            pos[:, p] = image_pos[row]
            current = max(current, int(image_pos[row].max()) + 1)
            row += 1
        else:
            pos[:, p] = current
            current += 1
    return pos, int(pos.max()) + 1 - P


def mrope_cos_sin(cfg: ModelConfig, inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """cos | sin [T, R] of 3-D positions [3, T]: frequency j follows the h axis when
    j % 3 == 1 and j < 3 * section[1], the w axis when j % 3 == 2 and j < 3 * section[2], else t."""
    half = len(inv_freq)
    axis = np.zeros(half, dtype=np.int64)
    j = np.arange(half)
    axis[(j % 3 == 1) & (j < 3 * cfg.mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * cfg.mrope_section[2])] = 2
    chosen = positions[axis].astype(np.float32)  # [half, T]: each frequency's axis position
    freqs = chosen.T * inv_freq[None, :]  # [T, half]
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)
