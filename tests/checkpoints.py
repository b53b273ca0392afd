"""Tiny Hugging Face MoE checkpoints built locally with transformers (fixed seed).

Used by tests and benchmarks; nothing is downloaded. Each architecture gets a config
that exercises its peculiarities (dense layers, shared expert, q/k norms, tied head)
and an expert count that splits unevenly over 2, 3 and 4 ranks.
"""

from __future__ import annotations

import os

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe")
DEEPSEEK_LIKE = ("deepseek_v2", "deepseek_v3", "glm4_moe")
EXPERT_KEY = {"mixtral": "num_local_experts", **{a: "n_routed_experts" for a in DEEPSEEK_LIKE}}

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_ARCH = {
    "qwen3_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
        head_dim=16,
        rope_theta=10000.0,
    ),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        shared_expert_intermediate_size=80,
        decoder_sparse_step=2,
        rope_theta=20000.0,
    ),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, rope_theta=1e6),
    "olmoe": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None),
    # DeepSeek family: 3 groups of 2 experts, the best 2 groups compete; layer 0 dense
    "deepseek_v2": dict(  # top-3 from the best 2 groups by their maximum: the third pick is group-limited
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
    ),
    "deepseek_v3": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_key_value_heads=4,
        num_nextn_predict_layers=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "glm4_moe": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        head_dim=16,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}


def build_checkpoint(arch: str, path: str, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """Build and save a random ``arch`` checkpoint at ``path`` (skipped if already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    kw = {**_COMMON, **_ARCH[arch], **overrides}
    cfg = transformers.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # zero-initialized in transformers: random here, so selection-only bias is tested
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.pad_token_id = kw["pad_token_id"]
    model.save_pretrained(path)
    return path


def load_reference(path: str):
    """The transformers model of a checkpoint, computing in float32."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
