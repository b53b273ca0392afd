"""The paged KV pool of one rank, sized per architecture: per layer ``k[NB, BS, Hk, Dh]`` and
``v[NB, BS, Hk, Dh]``, or for MLA one ``latent[NB, BS, L]`` (compressed latent + roped key);
a hybrid model's linear-attention layers hold no KV (None; their state: ``recurrent_state.py``).
With sliding-window layers (windowed KV, ``eprt/cache/window.py``) a block belongs to the full
layers' tables or to the sliding layers', never both, so the i-th full layer and the i-th sliding
layer share one array: ``cfg.kv_tensors`` arrays of each.

Block ids come from ``eprt.cache.block_manager.BlockManager``; this class only holds
the arrays and turns (block table, positions) into flat slots.
"""

from __future__ import annotations

import numpy as np

from eprt.model.config import ModelConfig


class KVCache:
    def __init__(self, ops, cfg: ModelConfig, num_blocks: int, block_size: int, extra_layers: int = 0):
        """``extra_layers``: attention layers past the model's own (an MTP layer's KV, layer ``num_layers``)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k, self.v, self.latent = [], [], []
        kept = [not cfg.is_linear_layer(i) for i in range(cfg.num_layers)]  # linear layers: no KV (None)
        kept += [True] * extra_layers
        if cfg.windowed_kv:
            if extra_layers or cfg.mla is not None:
                raise ValueError("windowed KV (sliding-window layers) with MLA or an MTP layer is not supported")
            shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
            arrays = [(ops.zeros(shape), ops.zeros(shape)) for _ in range(cfg.kv_tensors)]
            index = {True: 0, False: 0}  # sliding?: the next array of that group
            for i in range(cfg.num_layers):
                sliding = cfg.is_sliding_layer(i)
                k, v = arrays[index[sliding]]
                index[sliding] += 1
                self.k.append(k)
                self.v.append(v)
        elif cfg.mla is not None:
            shape = (num_blocks, block_size, cfg.mla.latent_dim)
            self.latent = [ops.zeros(shape) if keep else None for keep in kept]
        else:
            shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
            self.k = [ops.zeros(shape) if keep else None for keep in kept]
            self.v = [ops.zeros(shape) if keep else None for keep in kept]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
        """KV bytes one token holds over all layers: (kv_lora_rank + qk_rope_head_dim) x layers x
        itemsize for MLA, 2 x Hk x Dh x layers x itemsize otherwise."""
        return cfg.kv_values_per_token() * itemsize

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, itemsize: int) -> int:
        return block_size * KVCache.bytes_per_token(cfg, itemsize)

    @property
    def allocated_bytes_per_token(self) -> int:
        """What the allocated pool holds per token slot (every layer's arrays)."""
        total = sum(int(a.nbytes) for a in self._arrays())
        return total // (self.num_blocks * self.block_size)

    def _arrays(self) -> list:
        """Every array of the pool once (windowed KV shares arrays between layers)."""
        seen: dict = {}
        for a in (*self.k, *self.v, *self.latent):
            if a is not None:
                seen.setdefault(id(a), a)
        return list(seen.values())

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into block ``dst`` in every layer (a forked sequence's partial block)."""
        for a in self._arrays():
            a[dst] = a[src]  # [BS, ...]

    def slots(self, block_table, positions: np.ndarray) -> np.ndarray:
        """Flat slot of each position: block_table[p // BS] * BS + p % BS.  [T]"""
        bt = np.asarray(block_table, dtype=np.int64)
        need = int(positions.max()) // self.block_size + 1 if len(positions) else 0
        if need > len(bt):
            raise IndexError(f"position {int(positions.max())} is beyond the {len(bt)} blocks of the block table")
        return (bt[positions // self.block_size] * self.block_size + positions % self.block_size).astype(np.int32)
