"""The built-in default model: a small Qwen3-MoE with seeded weights and a byte tokenizer.

Nothing is downloaded: the tensors are generated from a fixed seed, identically on every
rank, in the Hugging Face layout, and go through the same loader as a real checkpoint.
"""

from __future__ import annotations

import numpy as np

from eprt.model.config import config_from_dict
from eprt.model.tokenizer import ByteTokenizer

DEFAULT_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": ByteTokenizer.vocab_size,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 96,
    "intermediate_size": 128,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "eos_token_id": ByteTokenizer.EOS,
}


class DictSource:
    """A TensorSource over an in-memory dict of float32 arrays."""

    def __init__(self, tensors: dict):
        self._t = tensors
        self.tensors_read = 0
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def read(self, name: str) -> np.ndarray:
        self.tensors_read += 1
        self.bytes_read += self._t[name].nbytes
        return self._t[name]


def default_tensors(raw: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    D, V, L = raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"]
    H, Hk, Dh = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    E, I = raw["num_experts"], raw["moe_intermediate_size"]
    normal = lambda *shape: rng.normal(0.0, 0.08, size=shape).astype(np.float32)  # noqa: E731
    ones = lambda n: (1.0 + rng.normal(0.0, 0.05, size=n)).astype(np.float32)  # noqa: E731
    lm_head = normal(V, D)
    lm_head[[i for i in range(V) if not 32 <= i < 127]] = 0.0  # favour printable ASCII: readable output
    t = {"model.embed_tokens.weight": normal(V, D), "model.norm.weight": ones(D), "lm_head.weight": lm_head}
    for i in range(L):
        p = f"model.layers.{i}"
        t.update(
            {
                f"{p}.input_layernorm.weight": ones(D),
                f"{p}.post_attention_layernorm.weight": ones(D),
                f"{p}.self_attn.q_proj.weight": normal(H * Dh, D),
                f"{p}.self_attn.k_proj.weight": normal(Hk * Dh, D),
                f"{p}.self_attn.v_proj.weight": normal(Hk * Dh, D),
                f"{p}.self_attn.o_proj.weight": normal(D, H * Dh),
                f"{p}.self_attn.q_norm.weight": ones(Dh),
                f"{p}.self_attn.k_norm.weight": ones(Dh),
                f"{p}.mlp.gate.weight": normal(E, D),
            }
        )
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            t.update(
                {
                    f"{q}.gate_proj.weight": normal(I, D),
                    f"{q}.up_proj.weight": normal(I, D),
                    f"{q}.down_proj.weight": normal(D, I),
                }
            )
    return t


def default_checkpoint():
    """(config, tensor source, tokenizer, name) of the built-in model."""
    cfg = config_from_dict(DEFAULT_CONFIG)
    return cfg, DictSource(default_tensors(DEFAULT_CONFIG)), ByteTokenizer(), "eprt-default-moe"
