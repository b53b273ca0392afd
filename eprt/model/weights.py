"""Load a MoE checkpoint's tensors into backend arrays, experts restricted to a range.

Tensor names follow the Hugging Face layout of each architecture (see ``config.py``).
Experts are stacked per layer into ``w_gate_up[El, 2I, D]`` and ``w_down[El, D, I]``
for the local range ``[expert_start, expert_end)``; a rank reads no other expert's
bytes. Checkpoints saved with fused expert tensors (``experts.gate_up_proj``
``[E, 2I, D]`` and ``experts.down_proj`` ``[E, D, I]``) are read too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.safetensors_io import CheckpointError
from eprt.ops.bf16 import bf16_bits_to_f32


class TensorSource(Protocol):
    def __contains__(self, name: str) -> bool: ...
    def read(self, name: str) -> np.ndarray: ...


@dataclass
class LayerWeights:
    input_norm: object
    post_norm: object
    q: object
    k: object
    v: object
    o: object
    q_bias: object = None
    k_bias: object = None
    v_bias: object = None
    q_norm: object = None
    k_norm: object = None
    router: object = None          # [E, D]
    w_gate_up: object = None       # [El, 2I, D]
    w_down: object = None          # [El, D, I]
    shared_gate_up: object = None  # [2Is, D]
    shared_down: object = None     # [D, Is]
    shared_gate: object = None     # [1, D]
    mlp_gate_up: object = None     # dense layer [2I, D]
    mlp_down: object = None        # dense layer [D, I]


@dataclass
class ModelWeights:
    embed: object                  # [V, D]
    norm: object                   # [D]
    lm_head: object                # [V, D]
    layers: list = field(default_factory=list)
    expert_start: int = 0
    expert_end: int = 0


def _host(src: TensorSource, name: str) -> np.ndarray:
    if name not in src:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    a = src.read(name)
    return a.astype(np.float32) if a.dtype in (np.float16, np.float64) else a


def _same_dtype(*arrays: np.ndarray) -> list:
    """bf16 bits (uint16) can only be stacked with bf16; otherwise widen everything to float32."""
    if all(a.dtype == np.uint16 for a in arrays):
        return list(arrays)
    return [bf16_bits_to_f32(a) if a.dtype == np.uint16 else a for a in arrays]


def _experts(src: TensorSource, cfg: ModelConfig, prefix: str, start: int, end: int):
    """Stacked host arrays (gate_up [El, 2I, D], down [El, D, I]) of experts [start, end)."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in src:
        gate_up = src.read(fused)[start:end]
        down = src.read(f"{prefix}.experts.down_proj")[start:end]
        return np.ascontiguousarray(gate_up), np.ascontiguousarray(down)
    g_name, u_name, d_name = cfg.expert_names
    gate_up, down = [], []
    for e in range(start, end):
        base = f"{prefix}.experts.{e}"
        g, u, d = _same_dtype(_host(src, f"{base}.{g_name}.weight"), _host(src, f"{base}.{u_name}.weight"),
                              _host(src, f"{base}.{d_name}.weight"))
        gate_up.append(np.concatenate([g, u], axis=0))
        down.append(d)
    return np.stack(_same_dtype(*gate_up)), np.stack(_same_dtype(*down))


def load_weights(src: TensorSource, cfg: ModelConfig, ops, expert_start: int = 0,
                 expert_end: Optional[int] = None) -> ModelWeights:
    """Read every replicated tensor and the experts in [expert_start, expert_end) into ``ops`` arrays."""
    expert_end = cfg.num_experts if expert_end is None else expert_end
    if not 0 <= expert_start <= expert_end <= cfg.num_experts:
        raise ValueError(f"expert range [{expert_start}, {expert_end}) outside [0, {cfg.num_experts})")
    W = lambda name: ops.weight(_host(src, name))          # noqa: E731
    embed = W("model.embed_tokens.weight")
    if cfg.tie_word_embeddings or "lm_head.weight" not in src:
        if not cfg.tie_word_embeddings:
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        lm_head = embed
    else:
        lm_head = W("lm_head.weight")
    weights = ModelWeights(embed=embed, norm=W("model.norm.weight"), lm_head=lm_head,
                           expert_start=expert_start, expert_end=expert_end)
    for i, sparse in enumerate(cfg.sparse_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        lw = LayerWeights(input_norm=W(f"{p}.input_layernorm.weight"),
                          post_norm=W(f"{p}.post_attention_layernorm.weight"),
                          q=W(f"{a}.q_proj.weight"), k=W(f"{a}.k_proj.weight"), v=W(f"{a}.v_proj.weight"),
                          o=W(f"{a}.o_proj.weight"))
        if cfg.qkv_bias:
            lw.q_bias, lw.k_bias, lw.v_bias = W(f"{a}.q_proj.bias"), W(f"{a}.k_proj.bias"), W(f"{a}.v_proj.bias")
        if cfg.qk_norm:
            lw.q_norm, lw.k_norm = W(f"{a}.q_norm.weight"), W(f"{a}.k_norm.weight")
        m = f"{p}.{cfg.moe_prefix}"
        if sparse:
            lw.router = W(f"{m}.gate.weight")
            gate_up, down = _experts(src, cfg, m, expert_start, expert_end)
            lw.w_gate_up, lw.w_down = ops.weight(gate_up), ops.weight(down)
            if cfg.has_shared_expert:
                s = f"{m}.shared_expert"
                g, u = _same_dtype(_host(src, f"{s}.gate_proj.weight"), _host(src, f"{s}.up_proj.weight"))
                lw.shared_gate_up = ops.weight(np.concatenate([g, u], axis=0))
                lw.shared_down = W(f"{s}.down_proj.weight")
                lw.shared_gate = W(f"{m}.shared_expert_gate.weight")
        else:
            g, u = _same_dtype(_host(src, f"{m}.gate_proj.weight"), _host(src, f"{m}.up_proj.weight"))
            lw.mlp_gate_up = ops.weight(np.concatenate([g, u], axis=0))
            lw.mlp_down = W(f"{m}.down_proj.weight")
        weights.layers.append(lw)
    return weights
