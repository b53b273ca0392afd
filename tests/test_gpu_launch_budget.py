"""Issue 39's launch budget, counted on cusim: an eager batch-1 decode step launches at most
8 kernels per dense layer and 12 per MoE layer (raw kernels, cuBLAS GEMMs and the kernels CuPy
launches itself, tests/launch_census.py) for a Qwen3-MoE of the built-in benchmark model's widths
and a DeepSeek-V3-shaped model (MLA with a q LoRA, grouped routing, a shared expert, a dense first
layer): its attention runs 5 launches from q_a to o (q_a | kv_a as one product, the q LoRA's norm in the
q_b product, w_uk in mla_prologue, w_uv in mla_attention), 9 before; its MLP 2 (dense: the post-attention
norm in the gate_up launch, then down) and 6 (MoE: the shared expert inside the experts' launches), 3 and 8
before (docs/gpu.md, "Launches per layer"). Before the fusions: Qwen3 17 per MoE layer and 13 per dense
one, DeepSeek 29 and 21; now Qwen3 11 and 7, DeepSeek 12 and 8.
Also pinned: no host->device copy inside a layer after the first (the pass uploads its index arrays once)."""

import pytest
from checkpoints import BENCH_MODEL, build_checkpoint

from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops.device import cuda_usable, get_ops


def on_cusim() -> bool:
    """The census patches cusim's CuPy stand-in: on a real GPU there is nothing of it to count."""
    import sys

    return bool(getattr(sys.modules.get("cupy"), "__cusim__", False))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device"),
    pytest.mark.skipif(not on_cusim(), reason="the launch census runs on cusim (tests/cusim)"),
]

BUDGET = {"qwen3_moe": (8, 12), "deepseek_v3": (8, 12)}  # launches per (dense, MoE) layer: issue 39's
# the built-in benchmark model's widths (benchmarks/bench_decode_cpu.py's ~115M Qwen3-MoE), 3 of its
# layers, the middle one dense
QWEN3_115M = dict(BENCH_MODEL, vocab_size=512, num_hidden_layers=3, intermediate_size=1024, mlp_only_layers=[1])
# DeepSeek-V3's attention and routing widths (q LoRA aside: 384 for 1536): MLA latent 512, rope 64,
# nope 128, values 128, 8 expert groups with the best 4 kept, top-8; fewer heads (16 of 128), a
# narrower residual (1024 of 7168) and 16 routed experts (of 256), so cusim builds and runs it in
# seconds; the counts do not depend on those widths. Layer 0 dense (first_k_dense_replace), 1 shared expert.
DEEPSEEK_V3_SHAPE = dict(
    vocab_size=512,
    hidden_size=1024,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=16,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    intermediate_size=2048,
)
MODELS = {"qwen3_moe": QWEN3_115M, "deepseek_v3": DEEPSEEK_V3_SHAPE}


def decode_census(path: str, prompt=(5, 77, 3, 9), token: int = 11):
    """Per-layer counts ([Counts]) and the step's, of one batch-1 decode step after the prompt's prefill."""
    from launch_census import census, per_layer  # (imports cusim: only where the tests run)

    model = load_model(path, get_ops("cuda"), max_len=64).model
    ex = ShardExecutor(model, 8, 16, 1, prefix_cache=False)
    ex.allocate(0, list(prompt))
    ex.prefill(0, list(prompt), 0, len(prompt))
    with census() as c:
        layers, step = per_layer(c, model, lambda: ex.decode([0], [token]))
    return model.cfg, layers, step


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_decode_layers_stay_within_the_launch_budget(tmp_path, arch):
    # (built apart from the shared checkpoints: 60 - 100 MB at real widths, cusim-only, never carried to a GPU)
    path = build_checkpoint(arch, str(tmp_path / f"launch-{arch}"), dtype="bfloat16", **MODELS[arch])
    cfg, layers, step = decode_census(path)
    assert len(layers) == cfg.num_layers
    rows = [
        (i, "moe" if cfg.sparse_layers[i] else "dense", n.launches, n.kernels, n.gemms, n.cupy, n.h2d, n.d2h)
        for i, n in enumerate(layers)
    ]
    print(f"\n{arch}: layer kind launches (kernels gemms cupy) h2d d2h")
    for r in rows:
        print("  ", *r)
    print(f"   step: {step}")
    assert {kind for _, kind, *_ in rows} == {"moe", "dense"}
    dense, moe = BUDGET[arch]
    over = [r for r in rows if r[2] > (moe if r[1] == "moe" else dense)]
    assert not over, f"{arch}: layers over the budget ({dense} dense, {moe} MoE): {over}"
    assert all(n.h2d == 0 for n in layers[1:]), f"{arch}: host->device copies inside the layers: {rows}"
    assert all(n.d2h == 0 for n in layers), f"{arch}: a layer reads the device: {rows}"
