"""The CuPy multi-LoRA kernel (kernels/lora.cu) against the NumPy reference, on a GPU or cusim:

PYTHONPATH=tests python -m pytest -p cusim.plugin -m gpu tests/test_cupy_lora.py
"""

import numpy as np
import pytest
from test_cupy_ops import bf16, gpu

from eprt.ops import lora_ops


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("R_used", [8, 5])
def test_lora_apply_matches_numpy_with_mixed_slots(R_used):
    """Rows of three adapters and of none in one call, on the rank prefix of a zero-padded stack."""
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps()
    rng = np.random.default_rng(7)
    S, R, K, N, T = 3, 8, 48, 40, 11
    a = rng.normal(size=(S, R, K)).astype(np.float32) * 0.2
    b = rng.normal(size=(S, R, N)).astype(np.float32) * 0.2
    x, y = bf16(rng.normal(size=(T, K))), bf16(rng.normal(size=(T, N)))
    slots = np.array([2, -1, 0, 2, 1, -1, 0, 0, 2, 1, -1], np.int32)
    want = lora_ops.lora_apply(y.copy(), x, a[:, :R_used], b[:, :R_used], lora_ops.LoraRows.group(slots))
    ga, gb = cupy.asarray(a), cupy.asarray(b)
    rows = lora_ops.LoraRows.group(slots, g.index)
    got = g.to_host(g.lora_apply(g.activation(y), g.activation(x), ga[:, :R_used], gb[:, :R_used], rows))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)  # one bf16 rounding of y
    np.testing.assert_array_equal(got[slots < 0], y[slots < 0])  # rows without an adapter untouched


@gpu
@pytest.mark.gpu
def test_attention_adapter_logits_on_cupy_follow_numpy(checkpoint, ckpt_root):
    """A mixed batch (base row, adapter rows) through the CuPy forward pass: every row's logits are
    NumPy's within bf16 error, far closer than the adapter moves them."""
    import os

    from lora_adapters import peft_adapter

    base = checkpoint("qwen3_moe", dtype="bfloat16")
    adapter, _ = peft_adapter(base, os.path.join(ckpt_root, "lora-qwen3-bf16-attn"), seed=5, r=8, lora_alpha=16,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    assert_cupy_follows_numpy(base, adapter)


@gpu
@pytest.mark.gpu
def test_experts_adapter_logits_on_cupy_follow_numpy(checkpoint, ckpt_root):
    """LoRA on the routed experts (per-expert modules with two ranks, plus q_proj) through the CuPy
    forward pass (CupyOps.moe_experts_lora): a mixed batch of base and adapter rows gives NumPy's
    logits within bf16 error, far closer than the adapter moves them."""
    import os

    from lora_adapters import per_expert_adapter

    base = checkpoint("mixtral", dtype="bfloat16")
    adapter, _ = per_expert_adapter(base, os.path.join(ckpt_root, "lora-mixtral-bf16-per-expert"), ("w1", "w3", "w2"))
    assert_cupy_follows_numpy(base, adapter)


def assert_cupy_follows_numpy(base: str, adapter: str) -> None:
    """A mixed batch (a base row, two rows of ``adapter``) through the NumPy and the CuPy forward
    passes: every row's logits agree within bf16 error, far closer than the adapter moves them."""
    from eprt.engine.executor import ShardExecutor
    from eprt.model.loader import load_model
    from eprt.model.lora import LoraSlots
    from eprt.ops.device import get_ops

    prompt = [5, 77, 3, 140, 9, 9, 31]
    logits = {}
    for device in ("cpu", "cuda"):
        lm = load_model(base, get_ops(device), 64)
        lora = LoraSlots(lm.model.ops, lm.config, 2, 8, 0, lm.config.num_experts)
        ex = ShardExecutor(lm.model, 32, 16, 4, prefix_cache=False, lora=lora)
        ex.adapters.load(1, 9, adapter)
        for slot, (a, n) in enumerate(((-1, 6), (9, 6), (9, 7))):  # rows 0 and 1 differ only by the adapter
            ex.allocate(slot, prompt[:n], adapter=a)
            ex.prefill(slot, prompt[:n], 0, n)
        logits[device] = lm.model.ops.to_host(ex.decode([0, 1, 2], [11, 11, 13]))  # [3, V]
    cpu, cuda = logits["cpu"], logits["cuda"]
    err = np.abs(cuda - cpu).max(axis=1)
    assert (err < 0.1).all(), err
    assert np.abs(cpu[1] - cpu[0]).max() > 10 * err.max()  # the adapter moves the logits far more
