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

from eprt.api import TOKEN_ID_LIMIT, is_int, is_real

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
    intermediate_size: int  # dense MLP layers
    sparse_layers: tuple  # bool per layer: MoE (True) or dense MLP
    qkv_bias: bool = False
    qk_norm: str | None = None  # None | "head" (per head) | "full" (whole projection)
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0  # qwen2_moe shared expert (0: none)
    eos_token_ids: tuple = ()
    image_token_id: int | None = None
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")
    moe_prefix: str = "mlp"  # "block_sparse_moe" for mixtral

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


def _int(raw: dict, name: str, *aliases, default=None, minimum: int = 1) -> int:
    """An integer field (``default`` when absent; required when ``default`` is None), >= ``minimum``."""
    v = _require(raw, name, *aliases) if default is None else _first(raw, name, *aliases, default=default)
    given = next((n for n in (name, *aliases) if raw.get(n) is not None), name)
    return _checked_int(v, given, minimum)


def _checked_int(v, name: str, minimum: int = 1, source: str = "config.json") -> int:
    if not is_int(v):
        raise ConfigError(f"{source} field {name!r} must be an integer, got {v!r}")
    if v < minimum:
        raise ConfigError(f"{source} field {name!r} must be >= {minimum}, got {v}")
    return v


def _positive_float(v, name: str) -> float:
    if not is_real(v) or not v > 0:
        raise ConfigError(f"config.json field {name!r} must be a positive number, got {v!r}")
    return float(v)


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(spec, dict):
            raise ConfigError(f"config.json field {name!r} must be an object, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(f"rope type {kind!r} is not supported (only default RoPE)")
    return _positive_float(_first(raw, "rope_theta", default=params.get("rope_theta", 10000.0)), "rope_theta")


def _eos_ids(*values) -> tuple:
    ids: list[int] = []
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else [v]:
            source = "config.json or generation_config.json"
            if t is not None and _checked_int(t, "eos_token_id", 0, source) not in ids:
                ids.append(t)
    return tuple(ids)


def config_from_dict(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ConfigError(f"generation_config.json must hold a JSON object, got {type(generation_config).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; eprt supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if raw.get("head_dim") is None and hidden < heads:
        raise ConfigError(f"hidden_size={hidden} < num_attention_heads={heads} and no head_dim is given")
    head_dim = _int(raw, "head_dim", default=hidden // heads)
    layers = _int(raw, "num_hidden_layers")
    experts = _int(raw, "num_experts", "num_local_experts")
    vocab = _int(raw, "vocab_size")
    if vocab >= TOKEN_ID_LIMIT:
        raise ConfigError(f"vocab_size {vocab} collides with the protocol's reserved command words")
    top_k = _int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    image_token = _first(raw, "image_token_id", "image_token_index")
    eps = _positive_float(_first(raw, "rms_norm_eps", default=1e-6), "rms_norm_eps")

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=_rope_theta(raw),
        max_position_embeddings=_int(raw, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_experts=experts,
        top_k=top_k,
        image_token_id=None if image_token is None else _checked_int(image_token, "image_token_id", 0),
    )
    gen = generation_config or {}
    common["eos_token_ids"] = _eos_ids(raw.get("eos_token_id"), gen.get("eos_token_id"))

    if model_type in ("mixtral", "olmoe"):  # every layer sparse; intermediate_size sizes the experts
        intermediate = _int(raw, "intermediate_size")
        common.update(
            moe_intermediate_size=intermediate, intermediate_size=intermediate, sparse_layers=(True,) * layers
        )
    if model_type == "mixtral":
        return ModelConfig(
            model_type=model_type,
            norm_topk_prob=True,
            expert_names=("w1", "w3", "w2"),
            moe_prefix="block_sparse_moe",
            **common,
        )
    if model_type == "olmoe":
        clip = raw.get("clip_qkv")
        return ModelConfig(
            model_type=model_type,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm="full",
            clip_qkv=None if clip is None else _positive_float(clip, "clip_qkv"),
            **common,
        )
    # qwen2_moe / qwen3_moe: dense layers by mlp_only_layers and decoder_sparse_step
    step = _int(raw, "decoder_sparse_step", default=1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(is_int(i) for i in dense):
        raise ConfigError(f"config.json field 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
    sparse = tuple((i not in dense) and (i + 1) % step == 0 for i in range(layers))
    common.update(
        sparse_layers=sparse,
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        intermediate_size=_int(raw, "intermediate_size", default=0, minimum=0 if all(sparse) else 1),
    )
    if model_type == "qwen2_moe":
        return ModelConfig(
            model_type=model_type,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            qkv_bias=bool(raw.get("qkv_bias", True)),
            shared_expert_intermediate_size=_int(raw, "shared_expert_intermediate_size", default=0, minimum=0),
            **common,
        )
    return ModelConfig(
        model_type=model_type,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        qk_norm="head",
        **common,
    )


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_dir!r} has no config.json (is it a Hugging Face checkpoint directory?)")
    raw = _read_json(path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    try:
        return config_from_dict(raw, gen)
    except ConfigError as e:
        raise ConfigError(f"{model_dir}: {e}") from None
