"""Model configuration: one normalized view of every supported MoE ``config.json``.

Supported ``model_type`` values share one code path; the differences are data:
    qwen3_moe  per-head q/k RMSNorm, optional renormalized top-k, dense layers by
               ``mlp_only_layers`` / ``decoder_sparse_step``
    qwen2_moe  q/k/v bias, a shared expert with a sigmoid gate, dense layers as qwen3_moe
    mixtral    top-k always renormalized, every layer sparse, experts named w1/w3/w2
    olmoe      q/k RMSNorm over the whole projection, optional ``clip_qkv``
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from eprt.comm.protocol import RESERVED_BASE

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


class ConfigError(ValueError):
    """A checkpoint configuration eprt cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    intermediate_size: int                      # dense MLP layers
    sparse_layers: tuple                        # bool per layer: MoE (True) or dense MLP
    qkv_bias: bool = False
    qk_norm: Optional[str] = None               # None | "head" (per head) | "full" (whole projection)
    clip_qkv: Optional[float] = None
    shared_expert_intermediate_size: int = 0    # qwen2_moe shared expert (0: none)
    eos_token_ids: tuple = ()
    image_token_id: Optional[int] = None
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")
    moe_prefix: str = "mlp"                     # "block_sparse_moe" for mixtral

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def param_count(self) -> int:
        D, I, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        attn = D * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        total = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        for sparse in self.sparse_layers:
            total += attn
            if sparse:
                total += E * 3 * D * I + E * D + 3 * D * self.shared_expert_intermediate_size
            else:
                total += 3 * D * self.intermediate_size
        return total


def _first(raw: dict, *names, default=None):
    for n in names:
        if raw.get(n) is not None:
            return raw[n]
    return default


def _require(raw: dict, name: str, *aliases):
    v = _first(raw, name, *aliases)
    if v is None:
        raise ConfigError(f"config.json has no {name!r}" + (f" (nor {', '.join(aliases)})" if aliases else ""))
    return v


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    for spec in (params, scaling or {}):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(f"rope type {kind!r} is not supported (only default RoPE)")
    theta = _first(raw, "rope_theta", default=params.get("rope_theta", 10000.0))
    return float(theta)


def _eos_ids(*values) -> tuple:
    ids: list[int] = []
    for v in values:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


def config_from_dict(raw: dict, generation_config: Optional[dict] = None) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; eprt supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    hidden = int(_require(raw, "hidden_size"))
    heads = int(_require(raw, "num_attention_heads"))
    kv_heads = int(_first(raw, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    layers = int(_require(raw, "num_hidden_layers"))
    experts = int(_require(raw, "num_experts", "num_local_experts"))
    vocab = int(_require(raw, "vocab_size"))
    if vocab >= RESERVED_BASE:
        raise ConfigError(f"vocab_size {vocab} collides with the protocol's reserved command words")
    top_k = int(_require(raw, "num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    intermediate = int(_first(raw, "intermediate_size", default=0))

    common = dict(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=int(_first(raw, "head_dim", default=hidden // heads)),
                  rms_norm_eps=float(_first(raw, "rms_norm_eps", default=1e-6)), rope_theta=_rope_theta(raw),
                  max_position_embeddings=int(_first(raw, "max_position_embeddings", default=4096)),
                  tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                  num_experts=experts, top_k=top_k, intermediate_size=intermediate,
                  image_token_id=_first(raw, "image_token_id", "image_token_index"))
    gen = generation_config or {}
    common["eos_token_ids"] = _eos_ids(raw.get("eos_token_id"), gen.get("eos_token_id"))

    if model_type == "mixtral":
        return ModelConfig(model_type=model_type, moe_intermediate_size=intermediate, norm_topk_prob=True,
                           sparse_layers=(True,) * layers, expert_names=("w1", "w3", "w2"),
                           moe_prefix="block_sparse_moe", **common)
    if model_type == "olmoe":
        clip = raw.get("clip_qkv")
        return ModelConfig(model_type=model_type, moe_intermediate_size=intermediate,
                           norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=(True,) * layers,
                           qkv_bias=bool(raw.get("attention_bias", False)), qk_norm="full",
                           clip_qkv=None if clip is None else float(clip), **common)
    # qwen2_moe / qwen3_moe: dense layers by mlp_only_layers and decoder_sparse_step
    step = int(_first(raw, "decoder_sparse_step", default=1))
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple((i not in dense) and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    moe_inter = int(_require(raw, "moe_intermediate_size"))
    if model_type == "qwen2_moe":
        return ModelConfig(model_type=model_type, moe_intermediate_size=moe_inter,
                           norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse,
                           qkv_bias=bool(raw.get("qkv_bias", True)),
                           shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                           **common)
    return ModelConfig(model_type=model_type, moe_intermediate_size=moe_inter,
                       norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse,
                       qkv_bias=bool(raw.get("attention_bias", False)), qk_norm="head", **common)


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_dir!r} has no config.json (is it a Hugging Face checkpoint directory?)")
    with open(path) as f:
        raw = json.load(f)
    gen = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    return config_from_dict(raw, gen)
