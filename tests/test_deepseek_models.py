"""DeepSeek-class models (deepseek_v2, deepseek_v3, glm4_moe) against transformers: greedy tokens and
every step's logits through the paged cache (MLA: the latent cache, absorbed decode), the configs'
switches, the MLA KV pool's size, and the engine's prefix cache, chunked prefill and preemption."""

import json
import re
import shutil

import numpy as np
import pytest
from checkpoints import DEEPSEEK_LIKE, reference_greedy

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.kv_cache import KVCache
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps

PROMPTS = [[5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11], [8, 19], [200, 100, 50, 25, 12, 6, 3]]
STEPS = 8


def eprt_greedy(path, prompts, steps, block_size=4):
    """Prefill each prompt, then batched decode of all of them: (tokens per prompt, logits [P, steps, V])."""
    lm = load_model(path, NumpyOps(), max_len=512)
    ex = ShardExecutor(lm.model, 64, block_size, 8, prefix_cache=False)
    logits = []
    for s, p in enumerate(prompts):
        ex.allocate(s, p)
        logits.append([ex.prefill(s, p, 0, len(p))[0]])
    slots = list(range(len(prompts)))
    for _ in range(steps - 1):
        step = ex.decode(slots, [int(np.argmax(rows[-1])) for rows in logits])
        for s in slots:
            logits[s].append(step[s])
    rows = np.asarray(logits)  # [P, steps, V]
    return [list(map(int, np.argmax(r, axis=-1))) for r in rows], rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", DEEPSEEK_LIKE)
def test_greedy_tokens_and_logits_match_transformers(checkpoint, arch, dtype):
    path = checkpoint(arch, dtype=dtype)
    tokens, logits = eprt_greedy(path, PROMPTS, STEPS)
    for p, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = reference_greedy(path, prompt, STEPS)
        assert tokens[p] == ref_tokens, (arch, dtype, p)
        np.testing.assert_allclose(logits[p], ref_logits, atol=2e-4, rtol=0)


def test_deepseek_v3_config_switches(checkpoint):
    cfg = load_config(checkpoint("deepseek_v3"))
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (48, 32, 16, 8, 24)
    assert m.rope_interleave and m.latent_dim == 40
    assert cfg.sparse_layers == (False, True, True)  # first_k_dense_replace=1
    assert cfg.shared_expert_intermediate_size == 32 and not cfg.shared_expert_gated
    r = cfg.routing
    assert (r.scoring, r.n_group, r.topk_group, r.group_score, r.renormalize, r.scaling) == (
        "sigmoid",
        3,
        2,
        "top2_sum",
        True,
        2.5,
    )
    assert cfg.router_bias and cfg.mtp_layers == 1
    y = cfg.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.mscale, y.mscale_all_dim) == (4.0, 128, 1.0, 0.8)
    v2 = load_config(checkpoint("deepseek_v2"))
    assert v2.mla.q_lora_rank == 0 and v2.mla.rope_interleave and not v2.router_bias
    assert (v2.routing.scoring, v2.routing.group_score, v2.routing.n_group, v2.routing.topk_group) == (
        "softmax",
        "max",
        3,
        2,
    )
    glm = load_config(checkpoint("glm4_moe"))
    assert glm.mla is None and glm.rotary_dim == 8 and glm.rope_dim == 8 and glm.qk_norm == "head"


def test_mla_kv_cache_holds_only_the_latent_and_rope_key(checkpoint):
    cfg = load_config(checkpoint("deepseek_v3"))
    kv = KVCache(NumpyOps(), cfg, num_blocks=5, block_size=4)
    assert kv.k == [] and kv.v == []
    assert [a.shape for a in kv.latent] == [(5, 4, 32 + 8)] * 3
    assert KVCache.bytes_per_token(cfg, 2) == (32 + 8) * 3 * 2  # (kv_lora_rank + qk_rope_head_dim) x layers x 2
    assert kv.allocated_bytes_per_token == (32 + 8) * 3 * 4
    assert KVCache.bytes_per_block(cfg, 16, 2) == 16 * (32 + 8) * 3 * 2


def test_startup_log_prints_the_mla_kv_bytes_per_token(checkpoint, capfd):
    path = checkpoint("deepseek_v3")
    cfg = load_config(path)
    with launch_engine(EngineConfig(model=path, device="cpu", max_batch=2, block_size=4, max_model_len=64)):
        pass
    line = next(x for x in capfd.readouterr().err.splitlines() if "bytes/token" in x)
    per_token = int(re.search(r"KV (\d+) bytes/token \(MLA latent\)", line)[1])
    m = cfg.mla
    assert per_token == (m.kv_lora_rank + m.qk_rope_head_dim) * cfg.num_layers * NumpyOps.kv_itemsize
    expanded = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * cfg.num_layers * 4
    assert per_token * 4 < expanded  # what MLA saves over caching the expanded K and V


def test_mtp_layers_are_recognised_and_not_read(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "v3"
    shutil.copytree(checkpoint("deepseek_v3"), path)
    plain = load_model(str(path), NumpyOps(), 64)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)  # the MTP module's layer
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = np.full((4, 4), np.nan, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with_mtp = load_model(str(path), NumpyOps(), 64)
    assert with_mtp.config.mtp_layers == 1 and len(with_mtp.model.w.layers) == 3
    assert (with_mtp.tensors_read, with_mtp.bytes_read) == (plain.tensors_read, plain.bytes_read)


DS3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "intermediate_size": 8,
    "vocab_size": 10,
    "kv_lora_rank": 8,
    "q_lora_rank": None,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "n_group": 2,
    "topk_group": 1,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "n_routed_experts=4 is not a multiple of n_group=3"),
        ({"topk_group": 3}, r"topk_group=3 must be in \[1, n_group=2\]"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok=3 exceeds the 2 experts"),
        ({"n_group": 4, "topk_group": 2}, "groups of one expert"),
        ({"qk_rope_head_dim": 3}, "'qk_rope_head_dim' must be even, got 3"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported for deepseek_v3 \\(only 'sigmoid'\\)"),
        ({"attention_bias": True}, "attention_bias=true is not supported for deepseek_v3"),
        ({"rope_scaling": {"type": "longrope"}}, "rope type 'longrope' is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size must be two positive integers"),
        ({"model_type": "glm4_moe", "partial_rotary_factor": 0.2, "head_dim": 8}, "1 rotary dims"),
    ],
)
def test_bad_deepseek_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**DS3, **change})


def generate(path, prompts, n=6, **kw):
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=96, **kw)
    with launch_engine(cfg) as engine:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        results = engine.generate([GenerationRequest(p, params) for p in prompts])
        return [r.token_ids for r in results], [r.cached_tokens for r in results], engine.stats()


def test_prefix_cache_chunked_prefill_and_preemption_keep_mla_outputs(checkpoint):
    path = checkpoint("deepseek_v3")
    system = list(range(20, 44))
    prompts = [system + [i, i + 1] for i in range(5)]
    ref, _, _ = generate(path, prompts, prefix_cache=False, max_prefill_tokens=0, num_blocks=400)
    got, hits, _ = generate(path, prompts, prefix_cache=True, max_prefill_tokens=7, num_blocks=400)
    assert got == ref and sum(hits) > 0  # the prefix cache reused latent blocks, outputs unchanged
    small, _, stats = generate(path, prompts, n=20, prefix_cache=True, num_blocks=30)
    assert stats["preemptions"] > 0
    full, _, _ = generate(path, prompts, n=20, prefix_cache=False, num_blocks=400)
    assert small == full


def test_deepseek_config_json_of_the_released_format_parses(tmp_path):
    """The older released config layout: rope_scaling with "type", num_nextn_predict_layers, no num_experts."""
    raw = {
        **DS3,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "num_nextn_predict_layers": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(str(tmp_path))
    assert cfg.rope_scaling.factor == 40 and cfg.fp8.block_n == 128 and cfg.mtp_layers == 1


def test_a_backend_without_the_mla_ops_is_refused_at_load(checkpoint):
    from eprt.ops.base import Ops

    partial = type("NoMLADecode", (NumpyOps,), {"mla_attention_decode": Ops.mla_attention_decode})()
    with pytest.raises(NotImplementedError, match="does not implement mla_attention_decode needed by deepseek_v2"):
        load_model(checkpoint("deepseek_v2"), partial, 64)
    load_model(checkpoint("qwen3_moe"), partial, 64)  # GQA models do not need it
