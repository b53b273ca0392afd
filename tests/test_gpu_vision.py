"""qwen3_vl_moe on the CuPy backend against the NumPy backend (skipped without a GPU; run on
the CPU by the cusim plugin), on the three VL_VARIANTS checkpoints (deepstack into two or three
layers, issue 36's patch-16 tower with weights x2, text heads of 8): the per-token MRoPE cos/sin
rows, the deepstack additions (bf16 storage: added by ops.add) and the rope delta of decode steps
give the same logits up to bf16 rounding, unless a router decision flipped at a near-tie (as in
test_gpu_end_to_end.py: the first MoE call whose choices differ must differ at a near-tie)."""

import numpy as np
import pytest
from checkpoints import VL_END, VL_IMAGE, VL_START, VL_VARIANTS, png_bytes, vl_checkpoint

from eprt.engine.executor import ShardExecutor
from eprt.model.config import load_config
from eprt.model.loader import load_model
from eprt.model.vision import ImageInputs
from eprt.ops.device import cuda_usable, get_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]
ROUTE_TIE = 0.01  # router probability gap between the k-th and (k+1)-th expert
CASES = [
    ([5, VL_IMAGE, 9, 100, VL_IMAGE, 7], [png_bytes(2, 64, 30), png_bytes(3, 24, 24)]),
    ([VL_IMAGE, 8, 8, 31, 64], [png_bytes(4, 40, 56)]),
    ([5, VL_START, VL_IMAGE, VL_END, 9, 31], [png_bytes(5, 96, 128, alpha=True, orientation=6)]),  # issue 36's
]


def run(path, device, prompt, rows, decoded):
    """(logits [1 + steps, V] of the prefill and each decoded token, per MoE call (router probs, ids))."""
    ops, routes = get_ops(device), []
    route = ops.route

    def recording(logits, *args):
        weights, ids, perm = route(logits, *args)
        probs = ops.to_host(logits).astype(np.float64)
        probs = np.exp(probs - probs.max(axis=1, keepdims=True))
        routes.append((probs / probs.sum(axis=1, keepdims=True), np.sort(ops.to_host(ids), axis=1)))
        return weights, ids, perm

    ops.route = recording
    ex = ShardExecutor(load_model(path, ops, max_len=128).model, 16, 16, 1, prefix_cache=False)
    ex.allocate(0, prompt, vision_rows=rows)
    out = [ops.to_host(ex.prefill(0, prompt, 0, len(prompt), rows))[0]]
    out += [ops.to_host(ex.decode([0], [t]))[0] for t in decoded]
    return np.stack(out).astype(np.float32), routes


def first_flips(cpu_routes, cuda_routes, top_k: int) -> list:
    """Probability gaps (k-th vs (k+1)-th expert of the NumPy router) of the tokens the backends
    routed differently in the first MoE call where they differ: every later call sees that
    call's consequences, so a near-tie there may turn into a wider gap in a later layer."""
    for (probs, ids_a), (_, ids_b) in zip(cpu_routes, cuda_routes):
        flipped = np.nonzero((ids_a != ids_b).any(axis=1))[0]
        if len(flipped):
            ranked = -np.sort(-probs, axis=1)
            return [float(ranked[t, top_k - 1] - ranked[t, top_k]) for t in flipped]
    return []


@pytest.mark.parametrize("variant", list(VL_VARIANTS))
def test_image_prompt_logits_follow_numpy(ckpt_root, variant):
    path = vl_checkpoint(ckpt_root, variant)
    images, top_k = ImageInputs(path, load_config(path)), load_config(path).top_k
    compared = 0
    for prompt, imgs in CASES:
        prompt, rows = images.prepare(prompt, imgs)
        cpu, cpu_routes = run(path, "cpu", prompt, rows, [11, 40, 3])
        cuda, cuda_routes = run(path, "cuda", prompt, rows, [11, 40, 3])
        gaps = first_flips(cpu_routes, cuda_routes, top_k)
        assert all(g < ROUTE_TIE for g in gaps), f"routing differs away from a near-tie: gaps {gaps}"
        if not gaps:
            np.testing.assert_allclose(cuda, cpu, atol=0.05 * np.abs(cpu).max())
            compared += 1
    assert compared, "every case flipped a near-tie route: no logits were compared"
