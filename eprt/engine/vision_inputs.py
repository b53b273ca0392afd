"""A prompt's vision rows on every rank (a part of the executor; docs/vision.md): the rows of a
prefill chunk's image placeholders, and for models with multimodal RoPE each sequence's 3-D
prompt positions and rope delta (derived from the tokens and the rows alone, so nothing more
travels). T tokens in a chunk, D hidden, R rope dims.
"""

from __future__ import annotations

import numpy as np

from eprt.engine.sequences import ExecutorError
from eprt.model.mrope import mrope_cos_sin, prompt_positions, split_vision_rows


class VisionInputs:
    def __init__(self, cfg, image_token_id: int | None, inv_freq):
        self.cfg, self.image_token_id, self.inv_freq = cfg, image_token_id, inv_freq
        self._mrope: dict[int, tuple] = {}  # slot key -> (3-D prompt positions [3, P], rope delta): MRoPE models

    def allocated(self, key: int, tokens, vision_rows) -> None:
        """A sequence took slot key ``key``: an MRoPE model's positions of its prompt."""
        if self.cfg.mrope_section:
            image_pos = None if vision_rows is None else split_vision_rows(self.cfg, vision_rows)[2]
            self._mrope[key] = prompt_positions(tokens, self.image_token_id, image_pos)

    def freed(self, key: int) -> None:
        self._mrope.pop(key, None)

    def chunk(self, tokens, start: int, end: int, vision_rows):
        """Rows [n, D] and mask [T] of the image placeholders inside this chunk."""
        if vision_rows is None or len(vision_rows) == 0:
            return None, None
        if self.image_token_id is None:
            raise ExecutorError("vision rows were sent but the model has no image_token_id")
        where = np.asarray(tokens) == self.image_token_id  # [full]
        if int(where.sum()) != len(vision_rows):
            raise ExecutorError(f"{len(vision_rows)} vision rows for {int(where.sum())} image placeholders")
        before = int(where[:start].sum())
        mask = where[start:end]
        return vision_rows[before : before + int(mask.sum())], mask

    def mrope_chunk(self, key: int, start: int, end: int, rows, mask) -> tuple:
        """MRoPE prefill inputs of the chunk: (main rows [n, D], deepstack (mask, rows [K, n, D]) or
        None, per-token cos|sin [T, R] or None when the prompt has no image)."""
        positions, delta = self._mrope[key]
        if rows is None:
            return None, None, None
        main, deepstack, _ = split_vision_rows(self.cfg, rows)
        table = mrope_cos_sin(self.cfg, self.inv_freq, positions[:, start:end])
        return main, ((mask, deepstack) if len(main) and self.cfg.deepstack_layers else None), table

    def rope_deltas(self, states) -> np.ndarray:
        """[B] rope deltas of a decode batch's sequences (0 for a text-only prompt)."""
        return np.fromiter((self._mrope[st.key][1] for st in states), dtype=np.int32, count=len(states))
