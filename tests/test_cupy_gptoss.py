"""gpt-oss on the CuPy backend (kernels/gptoss.cu) against the NumPy reference, op by op, and the model
end to end against transformers: on a GPU, or on cusim in CI (tests/cusim/README.md).

    PYTHONPATH=tests python3 -m pytest -p cusim.plugin -m gpu tests/test_cupy_gptoss.py

Inputs are rounded to bf16 first (the values the GPU holds); tolerances as in test_cupy_ops.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from checkpoints import build_gptoss_checkpoint, reference_greedy
from test_cupy_ops import bf16, close, paged_kv

from eprt.ops.device import cuda_usable
from eprt.ops.gptoss_ops import dequantize_mxfp4
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps("numpy")


@pytest.fixture
def rng():
    return np.random.default_rng(44)


def test_router_takes_the_top_k_logits_and_softmaxes_them(ops, rng):
    g, c = ops
    logits = rng.standard_normal((9, 7)).astype(np.float32)
    logits[3, [1, 4]] = 2.5  # a tie goes to the lower id
    w, ids = g.router_topk_softmax(g.xp.asarray(logits), 3)
    want_w, want_ids = c.router_topk_softmax(logits, 3)
    np.testing.assert_array_equal(g.to_host(ids), want_ids)
    close(g.to_host(w), want_w, "router")


@pytest.mark.parametrize("window", [0, 6])
def test_attention_with_sinks_decode_and_prefill(ops, rng, window):
    """Rows over shuffled blocks of 4, contexts longer and shorter than the window; a prefill chunk
    whose first rows read keys before it."""
    g, c = ops
    lens, bs, hk, dh, heads = [3, 11, 17], 4, 2, 16, 6
    k, v, tables = paged_kv(rng, lens, bs, hk, dh)
    q = bf16(rng.standard_normal((3, heads, dh)))
    sinks = rng.standard_normal(heads).astype(np.float32)
    lens_arr = np.asarray(lens, np.int32)
    dev = [g.activation(a) for a in (q, k, v)]
    got = g.attention_sinks_decode(*dev, g.index(tables), g.index(lens_arr), 0.25, g.xp.asarray(sinks), window)
    want = c.attention_sinks_decode(q, k, v, tables, lens_arr, 0.25, sinks, window)
    close(g.to_host(got), want, "attention")
    chunk = bf16(rng.standard_normal((5, heads, dh)))  # positions 12..16 of the third sequence
    table = g.index(tables[2])
    got = g.attention_sinks_prefill(g.activation(chunk), *dev[1:], table, 12, 0.25, g.xp.asarray(sinks), window)
    want = c.attention_sinks_prefill(chunk, k, v, tables[2], 12, 0.25, sinks, window)
    close(g.to_host(got), want, "attention")


@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_experts_with_biases_and_the_clamped_swiglu(ops, rng, quant):
    """5 local experts of 7 (expert_start 2), top-3 routing, the clamps reached (limit 0.5)."""
    g, c = ops
    El, D, I, T, k = 5, 64, 32, 6, 3
    x = bf16(rng.standard_normal((T, D)))
    ids = np.stack([rng.permutation(7)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    b_gu, b_d = rng.standard_normal((El, 2 * I)).astype(np.float32), rng.standard_normal((El, D)).astype(np.float32)
    if quant == "mxfp4":
        blocks = [rng.integers(0, 256, (El, n, kk // 32, 16), dtype=np.uint8) for n, kk in ((2 * I, D), (D, I))]
        scales = [rng.integers(120, 126, (El, n, kk // 32), dtype=np.uint8) for n, kk in ((2 * I, D), (D, I))]
        gw = g.mxfp4_expert_weights(blocks[0], scales[0], blocks[1], scales[1])
        cw = c.mxfp4_expert_weights(blocks[0], scales[0], blocks[1], scales[1])
        scale = np.abs(dequantize_mxfp4(blocks[1], scales[1])).max()
    else:
        gu, down = bf16(rng.standard_normal((El, 2 * I, D)) / 8), bf16(rng.standard_normal((El, D, I)) / 6)
        gw, cw, scale = g.swiglu_expert_weights(gu, down), c.swiglu_expert_weights(gu, down), 1.0
    args = (g.xp.asarray(b_gu), g.xp.asarray(b_d), 2, 1.702, 0.5)
    got = g.moe_experts_swiglu(g.activation(x), g.xp.asarray(weights), g.index(ids), *gw, *args)
    want = c.moe_experts_swiglu(x, weights, ids, *cw, b_gu, b_d, 2, 1.702, 0.5)
    close(g.to_host(got), want, "moe", scale=float(np.abs(want).max()) or scale)


VARIANTS = {"bf16": dict(dtype="bfloat16"), "mxfp4": dict(dtype="bfloat16", mxfp4=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers_on_the_gpu_backend(variant, tmp_path_factory):
    """eprt generate on --device cuda: prompts longer than the window (8) in chunks of 5 that cross it,
    windowed KV in blocks of 4, the system prompt hit from the prefix cache; MXFP4 experts stay MXFP4 on
    the device. Greedy tokens equal transformers' (fp32, on the dequantized weights for MXFP4)."""
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    root = os.environ.get("EPRT_TEST_CKPT_DIR") or str(tmp_path_factory.mktemp("ckpt"))
    path = build_gptoss_checkpoint(os.path.join(root, f"gpt_oss-{variant}"), **VARIANTS[variant])
    system = [(47 * i + 5) % 240 + 10 for i in range(14)]  # prompts whose greedy tokens are no near-ties
    prompts, steps = [system + [1, 2], system + [3]], 4
    refs = [reference_greedy(path, p, steps) for p in prompts]
    gaps = [np.diff(np.sort(logits, axis=1)[:, -2:], axis=1).min() for _, logits in refs]
    assert min(gaps) > 0.1  # bf16 activations move these logits by ~0.02: the tokens must not change
    cfg = EngineConfig(model=path, device="cuda", max_batch=2, block_size=4, max_model_len=64, max_prefill_tokens=5)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    with launch_engine(cfg) as engine:
        out = [engine.generate([GenerationRequest(p, params)])[0] for p in prompts]
        experts = engine.runner.executor.model.w.layers[0].w_gate_up
    assert [r.token_ids for r in out] == [tokens for tokens, _ in refs]
    assert out[1].cached_tokens == 12
    assert type(experts).__name__ == ("Mxfp4Weight" if variant == "mxfp4" else "ndarray")
