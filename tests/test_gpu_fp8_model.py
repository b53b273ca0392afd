"""FP8 checkpoints on the GPU backend (skipped without a GPU; run on cusim in CI): the weights stay
FP8 in device memory, about half the bytes of the bf16 copy per rank, and greedy tokens follow the
NumPy backend (which dequantizes at load) up to a near-tie, as in test_gpu_end_to_end.py."""

import gc

import numpy as np
import pytest
from checkpoints import build_fp8_copy
from test_gpu_end_to_end import assert_cuda_follows_numpy

from eprt.model.loader import load_model
from eprt.ops.device import cuda_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]

# experts and projections large enough that the unquantized tables (embedding, head) and the
# per-head MLA projections (kept bf16) do not dominate, as in real checkpoints
BIGGER = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, vocab_size=64)


def resident_weight_bytes(path: str, rank: int, world: int) -> int:
    """Device bytes the loaded model holds (weights and its rope table): the growth of the bytes
    CuPy's pool has in use. (Not the device's free memory: the pool keeps freed blocks and the
    next load reuses them, so on the H200 the second load showed 0 bytes.)"""
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    pool = cupy.get_default_memory_pool()
    gc.collect()
    cupy.cuda.get_current_stream().synchronize()
    before = pool.used_bytes()
    loaded = load_model(path, CupyOps(), max_len=8, rank=rank, world=world)
    used = pool.used_bytes() - before
    del loaded
    gc.collect()
    return used


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_fp8_weights_take_about_half_the_bf16_bytes_per_rank(checkpoint, ckpt_root, arch, rank, world):
    from eprt.ops.cupy_ops import CupyOps, Fp8Weight

    bf16_dir = checkpoint(arch, dtype="bfloat16", **BIGGER)
    fp8_dir, _ = build_fp8_copy(bf16_dir, f"{bf16_dir}-fp8-128x128", (128, 128))
    bf16_bytes = resident_weight_bytes(bf16_dir, rank, world)
    fp8_bytes = resident_weight_bytes(fp8_dir, rank, world)
    ratio = fp8_bytes / bf16_bytes
    print(f"{arch} rank {rank}/{world}: bf16 {bf16_bytes} B, fp8 {fp8_bytes} B, ratio {ratio:.3f}")
    assert 0.45 < ratio < 0.6
    layers = load_model(fp8_dir, CupyOps(), 8, rank, world).model.w.layers
    sparse = next(lw for lw in layers if lw.w_gate_up is not None)
    assert isinstance(sparse.w_gate_up, Fp8Weight) and sparse.w_gate_up.data.dtype == np.uint8


@pytest.mark.parametrize("arch, block", [("deepseek_v3", (16, 32)), ("qwen3_moe", (128, 128))])
def test_fp8_greedy_tokens_follow_numpy(checkpoint, ckpt_root, arch, block):
    source = checkpoint(arch, dtype="bfloat16")
    path, _ = build_fp8_copy(source, f"{source}-fp8-{block[0]}x{block[1]}", block)
    assert_cuda_follows_numpy(path)
