"""Model configuration: one normalized view of every supported MoE ``config.json``.

Supported ``model_type`` values share one code path; the differences are data:
    qwen3_moe  per-head q/k RMSNorm, optional renormalized top-k, dense layers by
               ``mlp_only_layers`` / ``decoder_sparse_step``
    qwen2_moe  q/k/v bias, a shared expert with a sigmoid gate, dense layers as qwen3_moe
    mixtral    top-k always renormalized, every layer sparse, experts named w1/w3/w2
    olmoe      q/k RMSNorm over the whole projection, optional ``clip_qkv``
    deepseek_v2/v3  MLA (latent KV), grouped softmax/sigmoid routing, shared experts, first_k_dense_replace
    glm4_moe   partial rotary, optional per-head q/k norm, sigmoid grouped routing, shared experts
    qwen3_next hybrid: Gated DeltaNet layers between gated full-attention layers (``layer_types``),
               (1 + w) RMSNorms, partial rotary, a gated shared expert (docs/hybrid.md)
    qwen3_vl_moe  qwen3_moe's ``text_config`` with interleaved multimodal RoPE and deepstack inputs;
               its vision encoder runs on rank 0 (eprt/model/vision.py, docs/vision.md)
    gpt_oss    attention sinks, biases on q/k/v/o, YaRN, sliding-window layers (``layer_types``), a
               router with a bias and a softmax over its top-k logits, experts with biases and the
               clamped SwiGLU; MXFP4 experts (``quant_method = "mxfp4"``) or bf16
FP8 block-scaled checkpoints (``quantization_config.quant_method = "fp8"``) for every type.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from eprt.api import TOKEN_ID_LIMIT, is_int, is_real
from eprt.ops.base import GroupedRouting

SUPPORTED_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "qwen3_vl_moe",
    "gpt_oss",
)
LAYER_TYPES = ("full_attention", "linear_attention")
GPT_OSS_LAYER_TYPES = ("full_attention", "sliding_attention")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")


class ConfigError(ValueError):
    """A checkpoint configuration eprt cannot serve; the message names the field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as Hugging Face computes it (``_compute_yarn_parameters``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent
    mscale_all_dim: float = 0.0  # 0: absent
    attention_factor: float | None = None  # None: from factor, mscale, mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds kv_lora_rank + qk_rope_head_dim
    values per token per layer."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope dims stored as interleaved pairs (permuted to rotate-half at load)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3-Next's linear attention): per sequence and layer a conv state
    [conv_dim, conv_kernel - 1] and a delta-rule state [num_value_heads, key_head_dim, value_head_dim]."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: value head h reads key head h // (Hv // Hk)
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim

    def state_values(self) -> int:
        """Recurrent-state values of one sequence in one layer: conv window plus delta-rule state."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class Fp8Quantization:
    """Block-scaled float8_e4m3fn weights: ``w = fp8 * weight_scale_inv[i // block_n, j // block_k]``."""

    block_n: int
    block_k: int


@dataclass(frozen=True)
class Mxfp4Quantization:
    """MXFP4 experts (gpt-oss): ``X_blocks`` [.., N, K / 32, 16] bytes, two e2m1 values each (the low
    nibble first), and ``X_scales`` [.., N, K / 32] e8m0 exponents: w = e2m1 * 2^(scale - 127)."""

    block: int = 32


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation on gate g and up u: g = min(g, limit), u = clip(u, -limit, limit),
    (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float
    limit: float


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
    shared_expert_prefix: str = "shared_expert"  # "shared_experts" (DeepSeek, GLM: no sigmoid gate)
    shared_expert_gated: bool = True  # Qwen2-MoE's shared_expert_gate
    mla: MLAConfig | None = None  # deepseek_v2/v3; None: grouped-query attention
    rotary_dim: int = 0  # dims rotated per head (glm4_moe's partial rotary); 0: all of head_dim
    rope_scaling: YarnScaling | None = None
    routing: GroupedRouting | None = None  # DeepSeek-style routing; None: softmax top-k (ops.router)
    router_bias: bool = False  # e_score_correction_bias (selection only)
    mtp_layers: int = 0  # num_nextn_predict_layers (DeepSeek's MTP layers; --speculative-method mtp loads the first)
    fp8: Fp8Quantization | None = None
    linear_attention: LinearAttentionConfig | None = None  # qwen3_next's Gated DeltaNet layers
    layer_types: tuple = ()  # "full_attention" | "linear_attention" per layer; (): every layer full attention
    attention_output_gate: bool = False  # q_proj also yields a per-head gate: o * sigmoid(gate) (qwen3_next)
    norm_unit_offset: bool = False  # RMSNorm weights stored as w - 1: the norm multiplies by (1 + w)
    mrope_section: tuple = ()  # qwen3_vl_moe: rope frequencies of the (t, h, w) axes, interleaved; (): 1-D RoPE
    deepstack_layers: int = 0  # qwen3_vl_moe: vision features added to the outputs of the first N layers
    o_bias: bool = False  # o_proj has a bias (gpt_oss)
    attention_sinks: bool = False  # a learned logit per query head in the softmax's denominator (gpt_oss)
    sliding_window: int = 0  # keys a "sliding_attention" layer's query reads, itself included (0: none)
    router_linear_bias: bool = False  # the router's logits carry a bias (gpt_oss: then softmax over the top-k)
    swiglu: ClampedSwiglu | None = None  # gpt_oss's experts: biases and the clamped SwiGLU
    mxfp4: Mxfp4Quantization | None = None  # MXFP4 experts

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a fixed-size recurrent state per sequence instead of KV."""
        return "linear_attention" in self.layer_types

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def is_sliding_layer(self, layer: int) -> bool:
        """A sliding-window attention layer: its query at position p reads keys (p - window, p]."""
        types = self.layer_types
        return self.sliding_window > 0 and layer < len(types) and types[layer] == "sliding_attention"

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.is_sliding_layer(i) for i in range(self.num_layers))

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep KV in the paged pool."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    def recurrent_state_values(self) -> int:
        """Recurrent-state values one sequence holds over all linear-attention layers (0: none)."""
        if self.linear_attention is None:
            return 0
        return (self.num_layers - self.num_attention_layers) * self.linear_attention.state_values()

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a head (the cos/sin table's width)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @property
    def windowed_kv(self) -> bool:
        """The sliding-window layers keep their KV in blocks of their own, freed as the window moves on
        (eprt/cache/block_manager.py, docs/design.md "Sliding-window KV")."""
        return self.num_sliding_layers > 0

    @property
    def kv_tensors(self) -> int:
        """KV arrays of the pool: one per attention layer, or with windowed KV one per pair of a full
        and a sliding layer (a block is either group's: max(full, sliding) arrays)."""
        if not self.windowed_kv:
            return self.num_attention_layers
        sliding = self.num_sliding_layers
        return max(sliding, self.num_attention_layers - sliding)

    def kv_values_per_token(self) -> int:
        """KV cache values per token slot of a block over its arrays: latent + rope key (MLA) or K and V
        of every KV head, times ``kv_tensors``."""
        per_layer = self.mla.latent_dim if self.mla is not None else 2 * self.num_kv_heads * self.head_dim
        return self.kv_tensors * per_layer

    def param_count(self) -> int:
        D, I, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        attn = D * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.mla is not None:
            m, H = self.mla, self.num_heads
            q_in = m.q_lora_rank or D
            attn = (D * m.q_lora_rank if m.q_lora_rank else 0) + q_in * H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
            attn += D * m.latent_dim + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
            attn += H * m.v_head_dim * D
        if self.attention_output_gate:
            attn += D * self.num_heads * self.head_dim
        total = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        for i, sparse in enumerate(self.sparse_layers):
            if self.is_linear_layer(i):
                la = self.linear_attention
                total += D * (2 * la.conv_dim - 2 * la.key_dim + 2 * la.num_value_heads)  # in_proj_qkvz, in_proj_ba
                total += la.conv_dim * la.conv_kernel + la.value_dim * D + 2 * la.num_value_heads + la.value_head_dim
            else:
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


def _rope_spec(raw: dict) -> dict:
    """rope_parameters (transformers 5.x) over rope_scaling (older configs), both checked to be objects."""
    spec: dict = {}
    for name in ("rope_scaling", "rope_parameters"):
        part = raw.get(name) or {}
        if not isinstance(part, dict):
            raise ConfigError(f"config.json field {name!r} must be an object, got {part!r}")
        spec.update(part)
    return spec


def _rope_theta(raw: dict) -> float:
    spec = _rope_spec(raw)
    return _positive_float(_first(raw, "rope_theta", default=spec.get("rope_theta", 10000.0)), "rope_theta")


def _rope_scaling(raw: dict) -> YarnScaling | None:
    """None for default RoPE; YaRN's parameters as transformers reads them; any other type is refused."""
    spec = _rope_spec(raw)
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported (only default RoPE and yarn)")
    original = _first(spec, "original_max_position_embeddings")
    original = _first(raw, "original_max_position_embeddings", default=original)
    original = _checked_int(
        original if original is not None else _int(raw, "max_position_embeddings"),
        "rope original_max_position_embeddings",
    )
    factor = spec.get("factor")
    factor = _int(raw, "max_position_embeddings") / original if factor is None else _positive_float(factor, "factor")
    optional = lambda n, default: default if spec.get(n) is None else _positive_float(spec[n], n)  # noqa: E731
    attention_factor = spec.get("attention_factor")
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=optional("beta_fast", 32.0),
        beta_slow=optional("beta_slow", 1.0),
        mscale=float(spec.get("mscale") or 0.0),
        mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else _positive_float(attention_factor, "attention_factor"),
        truncate=bool(spec.get("truncate", True)),
    )


def _partial_rotary(raw: dict, head_dim: int, default: float = 1.0) -> int:
    """Rotated dims per head: int(head_dim * partial_rotary_factor), even, at least 2."""
    spec = _rope_spec(raw)
    factor = _first(spec, "partial_rotary_factor", default=_first(raw, "partial_rotary_factor", default=default))
    if not is_real(factor) or not 0 < factor <= 1:
        raise ConfigError(f"config.json field 'partial_rotary_factor' must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ConfigError(
            f"head_dim={head_dim} x partial_rotary_factor={factor} = {dim} rotary dims: must be even >= 2"
        )
    return dim


def _fp8(raw: dict) -> Fp8Quantization | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        return None  # gpt_oss's MXFP4 experts: _mxfp4
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ConfigError(f"quantization_config quant_method {method!r} is not supported (only 'fp8', 'mxfp4')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config fmt {q.get('fmt')!r} is not supported (only 'e4m3')")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b >= 1 for b in block)):
        raise ConfigError(
            f"quantization_config weight_block_size must be two positive integers (e.g. [128, 128]), got {block!r}"
        )
    return Fp8Quantization(block_n=block[0], block_k=block[1])


def _mxfp4(raw: dict, model_type: str) -> Mxfp4Quantization | None:
    q = raw.get("quantization_config")
    if not (isinstance(q, dict) and q.get("quant_method") == "mxfp4"):
        return None
    if model_type != "gpt_oss":
        raise ConfigError(f"quantization_config quant_method 'mxfp4' is supported for gpt_oss, not {model_type}")
    return Mxfp4Quantization()


def _gpt_oss(raw: dict, common: dict) -> ModelConfig:
    """gpt-oss: every layer sparse (``intermediate_size`` sizes the experts), sinks, q/k/v/o biases,
    sliding-window layers by ``layer_types`` (default: even layers), the clamped SwiGLU."""
    layers = common["num_layers"]
    intermediate = _int(raw, "intermediate_size")
    given = raw.get("layer_types")
    if given is None:
        given = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or any(t not in GPT_OSS_LAYER_TYPES for t in given):
        raise ConfigError(
            f"config.json field 'layer_types' must list num_hidden_layers={layers} entries of "
            f"{' or '.join(GPT_OSS_LAYER_TYPES)}, got {given!r}"
        )
    window = raw.get("sliding_window")
    if "sliding_attention" in given:
        window = _checked_int(window, "sliding_window")
    bias = bool(raw.get("attention_bias", True))
    limit = _positive_float(_first(raw, "swiglu_limit", default=7.0), "swiglu_limit")
    alpha = _positive_float(_first(raw, "swiglu_alpha", default=1.702), "swiglu_alpha")
    common.update(moe_intermediate_size=intermediate, intermediate_size=intermediate, sparse_layers=(True,) * layers)
    return ModelConfig(
        model_type="gpt_oss",
        norm_topk_prob=True,
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        layer_types=tuple(given),
        sliding_window=window if "sliding_attention" in given else 0,
        router_linear_bias=True,
        swiglu=ClampedSwiglu(alpha=alpha, limit=limit),
        mxfp4=_mxfp4(raw, "gpt_oss"),
        **common,
    )


def _routing(raw: dict, model_type: str, experts: int, top_k: int) -> GroupedRouting:
    """deepseek_v2: softmax, group-limited greedy on group maxima (``topk_method``); deepseek_v3 and
    glm4_moe: sigmoid, groups scored by their two best biased scores, ``norm_topk_prob``."""
    scale = _positive_float(_first(raw, "routed_scaling_factor", default=1.0), "routed_scaling_factor")
    if model_type == "deepseek_v2":
        method = raw.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        n_group = _int(raw, "n_group") if grouped else 1
        topk_group = _int(raw, "topk_group") if grouped else 1
        # transformers' DeepseekV2TopkRouter never renormalizes (norm_topk_prob is read but unused)
        scoring, group_score, renormalize = "softmax", "max", False
    else:
        n_group, topk_group = _int(raw, "n_group", default=1), _int(raw, "topk_group", default=1)
        scoring, group_score, renormalize = "sigmoid", "top2_sum", bool(raw.get("norm_topk_prob"))
    declared = raw.get("scoring_func", scoring)  # released DeepSeek configs name it; transformers reads it not
    if declared != scoring:
        raise ConfigError(f"scoring_func {declared!r} is not supported for {model_type} (only {scoring!r})")
    if experts % n_group:
        raise ConfigError(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
    if topk_group > n_group:
        raise ConfigError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if top_k > topk_group * (experts // n_group):
        raise ConfigError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * (experts // n_group)} experts of "
            f"topk_group={topk_group} groups of {experts // n_group}"
        )
    if group_score == "top2_sum" and n_group > 1 and experts // n_group < 2:
        raise ConfigError(f"n_group={n_group} leaves groups of one expert; sigmoid routing scores a group's best two")
    return GroupedRouting(scoring, n_group, topk_group, group_score, renormalize, scale)


def _mla(raw: dict, model_type: str) -> MLAConfig:
    if raw.get("attention_bias"):
        raise ConfigError(f"attention_bias=true is not supported for {model_type}")
    rope = _int(raw, "qk_rope_head_dim")
    if rope % 2:
        raise ConfigError(f"config.json field 'qk_rope_head_dim' must be even, got {rope}")
    return MLAConfig(
        q_lora_rank=_int(raw, "q_lora_rank", default=0, minimum=0),
        kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=rope,
        v_head_dim=_int(raw, "v_head_dim"),
        # deepseek_v2 rotates complex pairs (interleaved); deepseek_v3 by rope_interleave (default true)
        rope_interleave=model_type == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
    )


def _deepseek_like(raw: dict, model_type: str, common: dict) -> ModelConfig:
    """deepseek_v2, deepseek_v3 and glm4_moe: first_k_dense_replace dense layers, ungated shared experts."""
    if raw.get("mlp_bias"):
        raise ConfigError(f"mlp_bias=true is not supported for {model_type}")
    freq = raw.get("moe_layer_freq", 1)
    if freq != 1:
        raise ConfigError(f"moe_layer_freq={freq!r} is not supported (only 1: every layer after the dense ones)")
    layers, moe_inter = common["num_layers"], _int(raw, "moe_intermediate_size")
    first_dense = _int(raw, "first_k_dense_replace", default=0, minimum=0)
    shared = _int(raw, "n_shared_experts", default=0, minimum=0)
    common.update(
        sparse_layers=tuple(i >= first_dense for i in range(layers)),
        moe_intermediate_size=moe_inter,
        intermediate_size=_int(raw, "intermediate_size", default=0, minimum=0 if first_dense == 0 else 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=moe_inter * shared,
        shared_expert_prefix="shared_experts",
        shared_expert_gated=False,
        routing=_routing(raw, model_type, common["num_experts"], common["top_k"]),
        router_bias=model_type != "deepseek_v2",
    )
    if model_type == "glm4_moe":
        return ModelConfig(
            model_type=model_type,
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm="head" if raw.get("use_qk_norm") else None,
            rotary_dim=_partial_rotary(raw, common["head_dim"]),
            **common,
        )
    mla = _mla(raw, model_type)
    common.update(head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, num_kv_heads=common["num_heads"])
    return ModelConfig(model_type=model_type, mla=mla, **common)


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
    if model_type == "qwen3_vl_moe":
        return _qwen3_vl_moe(raw, generation_config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; eprt supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    _mxfp4(raw, model_type)  # refused where it is not gpt_oss
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = heads if model_type in DEEPSEEK_TYPES else _int(raw, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if raw.get("head_dim") is None and hidden < heads:
        raise ConfigError(f"hidden_size={hidden} < num_attention_heads={heads} and no head_dim is given")
    head_dim = _int(raw, "head_dim", default=hidden // heads)
    layers = _int(raw, "num_hidden_layers")
    experts = _int(raw, "num_experts", "num_local_experts", "n_routed_experts")
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
        rope_scaling=_rope_scaling(raw),
        fp8=_fp8(raw),
        max_position_embeddings=_int(raw, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_experts=experts,
        top_k=top_k,
        image_token_id=None if image_token is None else _checked_int(image_token, "image_token_id", 0),
        mtp_layers=_int(raw, "num_nextn_predict_layers", default=0, minimum=0),  # DeepSeek's format, any family
    )
    gen = generation_config or {}
    common["eos_token_ids"] = _eos_ids(raw.get("eos_token_id"), gen.get("eos_token_id"))

    if model_type in (*DEEPSEEK_TYPES, "glm4_moe"):
        return _deepseek_like(raw, model_type, common)
    if model_type == "gpt_oss":
        return _gpt_oss(raw, common)
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
    if model_type == "qwen3_next":
        return _qwen3_next(raw, common)
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


def _layer_types(raw: dict, layers: int) -> tuple:
    """``layer_types`` as saved by transformers, else every ``full_attention_interval``-th layer
    (default 4) full attention and the others linear attention."""
    given = raw.get("layer_types")
    if given is None:
        interval = _int(raw, "full_attention_interval", default=4)
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(t not in LAYER_TYPES for t in given):
        raise ConfigError(
            f"config.json field 'layer_types' must list num_hidden_layers={layers} entries of "
            f"{' or '.join(LAYER_TYPES)}, got {given!r}"
        )
    return tuple(given)


def _qwen3_next(raw: dict, common: dict) -> ModelConfig:
    """Qwen3-Next: Gated DeltaNet + gated full attention, (1 + w) RMSNorms, a gated shared expert."""
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for qwen3_next")
    key_heads, value_heads = _int(raw, "linear_num_key_heads"), _int(raw, "linear_num_value_heads")
    if value_heads % key_heads:
        raise ConfigError(f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}")
    linear = LinearAttentionConfig(
        num_key_heads=key_heads,
        num_value_heads=value_heads,
        key_head_dim=_int(raw, "linear_key_head_dim"),
        value_head_dim=_int(raw, "linear_value_head_dim"),
        conv_kernel=_int(raw, "linear_conv_kernel_dim", default=4, minimum=2),
    )
    return ModelConfig(
        model_type="qwen3_next",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        qk_norm="head",
        shared_expert_intermediate_size=_int(raw, "shared_expert_intermediate_size", default=0, minimum=0),
        rotary_dim=_partial_rotary(raw, common["head_dim"], default=0.25),
        linear_attention=linear,
        layer_types=_layer_types(raw, common["num_layers"]),
        attention_output_gate=True,
        norm_unit_offset=True,
        **common,
    )


def _qwen3_vl_moe(raw: dict, generation_config: dict | None) -> ModelConfig:
    """The language model of a Qwen3-VL MoE checkpoint: qwen3_moe's ``text_config`` plus the
    interleaved (t, h, w) rope sections and the number of deepstack layers of ``vision_config``."""
    text, vision = raw.get("text_config"), raw.get("vision_config")
    for name, part in (("text_config", text), ("vision_config", vision)):
        if not isinstance(part, dict):
            raise ConfigError(f"qwen3_vl_moe config.json field {name!r} must be an object, got {part!r}")
    spec = _rope_spec(text)
    section = spec.get("mrope_section", [24, 20, 20])
    if not isinstance(section, list) or len(section) != 3 or not all(is_int(v) and v >= 0 for v in section):
        raise ConfigError(f"text_config rope 'mrope_section' must be 3 non-negative integers, got {section!r}")
    if spec.get("mrope_interleaved", True) is not True:
        raise ConfigError("text_config rope 'mrope_interleaved' must be true (Qwen3-VL's interleaved MRoPE)")
    deepstack = vision.get("deepstack_visual_indexes", [8, 16, 24])
    if not isinstance(deepstack, list) or not all(is_int(v) for v in deepstack):
        raise ConfigError(
            f"vision_config field 'deepstack_visual_indexes' must be a list of integers, got {deepstack!r}"
        )
    merged = {**text, "model_type": "qwen3_moe", "image_token_id": raw.get("image_token_id")}
    merged["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    rope = {k: v for k, v in spec.items() if k not in ("mrope_section", "mrope_interleaved")}
    merged.update(rope_parameters=rope, rope_scaling=None)
    cfg = config_from_dict(merged, generation_config)
    head_half = cfg.head_dim // 2
    if sum(section) != head_half:
        raise ConfigError(f"text_config 'mrope_section' {section} must sum to head_dim/2 = {head_half}")
    if len(deepstack) > cfg.num_layers:
        raise ConfigError(f"{len(deepstack)} deepstack layers for a language model of {cfg.num_layers} layers")
    return replace(  # the router always renormalizes its top-k
        cfg,
        model_type="qwen3_vl_moe",
        norm_topk_prob=True,
        mrope_section=tuple(section),
        deepstack_layers=len(deepstack),
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
