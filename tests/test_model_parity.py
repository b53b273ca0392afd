"""eprt's forward pass against the transformers reference, for every architecture."""

import numpy as np
import pytest
import torch
from checkpoints import load_reference

from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps

PROMPT = [5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11]


def executor_for(path, block_size=4, num_blocks=64, max_slots=8):
    lm = load_model(path, NumpyOps(), max_len=512)
    return ShardExecutor(lm.model, num_blocks, block_size, max_slots, prefix_cache=False)


def reference_logits(path, ids):
    with torch.no_grad():
        return load_reference(path)(torch.tensor([ids])).logits[0].numpy()


def test_prefill_logits_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    ex = executor_for(path)
    ex.compute_logits = True
    # every position's logits: prefill one token at a time through the paged cache...
    ex.allocate(0, PROMPT)
    rows = [ex.prefill(0, PROMPT, i, 1)[0] for i in range(len(PROMPT))]
    ref = reference_logits(path, PROMPT)
    np.testing.assert_allclose(np.stack(rows), ref, atol=1e-4, rtol=0)
    # ...and the whole prompt in one chunk gives the last position's logits
    ex.allocate(1, PROMPT)
    np.testing.assert_allclose(ex.prefill(1, PROMPT, 0, len(PROMPT))[0], ref[-1], atol=1e-4, rtol=0)


def test_chunked_prefill_matches_one_chunk(checkpoint):
    path = checkpoint("qwen2_moe")
    ex = executor_for(path, block_size=4)
    ex.allocate(0, PROMPT)
    whole = ex.prefill(0, PROMPT, 0, len(PROMPT))
    ex.allocate(1, PROMPT)
    ex.prefill(1, PROMPT, 0, 5)
    ex.prefill(1, PROMPT, 5, 6)
    last = ex.prefill(1, PROMPT, 11, 2)
    np.testing.assert_allclose(last, whole, atol=1e-5, rtol=0)


def test_bf16_checkpoint_matches_transformers_in_float32(checkpoint):
    """bf16 on disk: eprt widens to float32 on the CPU, as transformers does with dtype=float32."""
    path = checkpoint("qwen3_moe", dtype="bfloat16")
    ex = executor_for(path)
    ex.allocate(0, PROMPT)
    last = ex.prefill(0, PROMPT, 0, len(PROMPT))[0]
    np.testing.assert_allclose(last, reference_logits(path, PROMPT)[-1], atol=1e-4, rtol=0)


def test_batched_decode_logits_match_single(checkpoint):
    path = checkpoint("olmoe")
    prompts = [PROMPT[:3], PROMPT, PROMPT[2:9]]
    ex = executor_for(path)
    for s, p in enumerate(prompts):
        ex.allocate(s, p)
        ex.prefill(s, p, 0, len(p))
    batched = ex.decode([0, 1, 2], [7, 8, 9])
    for s, (p, t) in enumerate(zip(prompts, [7, 8, 9])):
        np.testing.assert_allclose(batched[s], reference_logits(path, p + [t])[-1], atol=1e-4, rtol=0)


def test_expert_shards_sum_to_the_full_layer(checkpoint):
    """Partial MoE outputs of uneven expert ranges add up to the single-rank output."""
    from eprt.model.loader import expert_shard

    path = checkpoint("mixtral")
    full = load_model(path, NumpyOps(), 512)
    x = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    lw = full.model.w.layers[0]
    ops = full.model.ops
    w, ids = ops.router(ops.linear(x, lw.router), 2, True)
    want = ops.moe_experts(x, w, ids, lw.w_gate_up, lw.w_down, 0)
    for world in (2, 3, 4):
        total = np.zeros_like(want)
        for rank in range(world):
            part = load_model(path, NumpyOps(), 512, rank=rank, world=world)
            s, e = expert_shard(6, rank, world)
            assert part.model.w.layers[0].w_gate_up.shape[0] == e - s
            total += ops.moe_experts(x, w, ids, part.model.w.layers[0].w_gate_up, part.model.w.layers[0].w_down, s)
        np.testing.assert_allclose(total, want, atol=1e-5, rtol=0)


def test_too_many_ranks_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="only 6 experts"):
        load_model(checkpoint("mixtral"), NumpyOps(), 512, rank=0, world=7)
