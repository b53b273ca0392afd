"""The MoE transformer forward pass, written once for every architecture and backend.

T tokens in the call, B sequences, D hidden, H / Hk query / KV heads, Dh head dim,
E experts, V vocabulary.

Expert parallelism: ``combine`` sums the per-rank partial MoE outputs over ranks
(identity on one rank). Attention, router and shared expert are replicated, so every
rank computes identical hidden states and keeps identical KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.kv_cache import KVCache
from eprt.model.weights import ModelWeights


@dataclass
class AttnBatch:
    """Where this call's tokens sit in the paged KV cache."""

    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    block_table: np.ndarray | None = None  # prefill: [MB] of the one sequence
    start_pos: int = 0  # prefill: position of the first token
    block_tables: np.ndarray | None = None  # decode: [B, MB]
    context_lens: np.ndarray | None = None  # decode: [B] (new token included)

    @property
    def is_prefill(self) -> bool:
        return self.block_table is not None


def rope_table(cfg: ModelConfig, max_len: int) -> np.ndarray:
    """cos | sin for positions [0, max_len): [P, Dh] float32, as Hugging Face computes it."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh))
    freqs = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]  # [P, Dh/2]
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)


class MoEModel:
    def __init__(
        self, cfg: ModelConfig, weights: ModelWeights, ops, max_len: int, combine: Callable = lambda partial: partial
    ):
        self.cfg, self.w, self.ops, self.combine = cfg, weights, ops, combine
        self.max_len = max_len
        self.cos_sin = ops.activation(rope_table(cfg, max_len))
        self.scale = cfg.head_dim**-0.5

    # ---- pieces ------------------------------------------------------------------------
    def embed(self, ids: np.ndarray, image_rows: np.ndarray | None = None, image_mask: np.ndarray | None = None):
        h = self.ops.embedding(self.w.embed, self.ops.index(ids))  # [T, D]
        if image_rows is not None and len(image_rows):
            h[self.ops.index(np.nonzero(image_mask)[0])] = self.ops.activation(image_rows)
        return h

    def _attention(self, lw, x, batch: AttnBatch, kv: KVCache, layer: int):
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        q = ops.linear(x, lw.q, lw.q_bias)  # [T, H*Dh]
        k = ops.linear(x, lw.k, lw.k_bias)  # [T, Hk*Dh]
        v = ops.linear(x, lw.v, lw.v_bias)
        if cfg.qk_norm == "full":  # OLMoE
            q = ops.rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (ops.clip(t, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, H, Dh]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hk, Dh]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":  # Qwen3-MoE
            q = ops.rms_norm(q.reshape(-1, cfg.head_dim), lw.q_norm, cfg.rms_norm_eps).reshape(q.shape)
            k = ops.rms_norm(k.reshape(-1, cfg.head_dim), lw.k_norm, cfg.rms_norm_eps).reshape(k.shape)
        pos = ops.index(batch.positions)
        q, k = ops.rope(q, pos, self.cos_sin), ops.rope(k, pos, self.cos_sin)
        ops.kv_write(kv.k[layer], kv.v[layer], k, v, ops.index(batch.slot_mapping))
        if batch.is_prefill:
            o = ops.attention_prefill(
                q, kv.k[layer], kv.v[layer], ops.index(batch.block_table), batch.start_pos, self.scale
            )
        else:
            o = ops.attention_decode(
                q, kv.k[layer], kv.v[layer], ops.index(batch.block_tables), ops.index(batch.context_lens), self.scale
            )
        return ops.linear(o.reshape(T, -1), lw.o)  # [T, D]

    def _moe(self, lw, x):
        ops, cfg = self.ops, self.cfg
        logits = ops.linear(x, lw.router)  # [T, E]
        weights, ids = ops.router(logits, cfg.top_k, cfg.norm_topk_prob)  # [T, k]
        partial = ops.moe_experts(x, weights, ids, lw.w_gate_up, lw.w_down, self.w.expert_start)
        out = self.combine(partial)  # [T, D] summed over ranks
        if lw.shared_gate_up is not None:  # Qwen2-MoE shared expert
            s = ops.linear(ops.silu_and_mul(ops.linear(x, lw.shared_gate_up)), lw.shared_down)
            out = ops.sigmoid_gate_add(out, s, ops.linear(x, lw.shared_gate))  # gate [T, 1]
        return out

    def _dense_mlp(self, lw, x):
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(x, lw.mlp_gate_up)), lw.mlp_down)

    # ---- forward -----------------------------------------------------------------------
    def hidden_states(self, h, batch: AttnBatch, kv: KVCache):
        """Run every layer over h[T, D]; returns the final-normed hidden states [T, D]."""
        ops, cfg = self.ops, self.cfg
        residual = h
        x = ops.rms_norm(h, self.w.layers[0].input_norm, cfg.rms_norm_eps)
        for i, lw in enumerate(self.w.layers):
            if i > 0:
                x, residual = ops.add_rms_norm(h, residual, lw.input_norm, cfg.rms_norm_eps)
            h = self._attention(lw, x, batch, kv, i)
            x, residual = ops.add_rms_norm(h, residual, lw.post_norm, cfg.rms_norm_eps)
            h = self._moe(lw, x) if cfg.sparse_layers[i] else self._dense_mlp(lw, x)
        x, _ = ops.add_rms_norm(h, residual, self.w.norm, cfg.rms_norm_eps)
        return x

    def logits(self, x):
        return self.ops.linear(x, self.w.lm_head)  # [T, V]
