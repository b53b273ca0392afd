"""FP8 block-scaled checkpoints (quant_method "fp8", float8_e4m3fn weights with weight_scale_inv):
eprt dequantizes them block-wise at load; greedy tokens and logits equal transformers run on the
dequantized weights; a rank reads only its own experts' FP8 bytes and scales."""

import json
import shutil

import numpy as np
import pytest
import torch
from checkpoints import build_fp8_copy
from test_deepseek_models import eprt_greedy, reference_greedy

from eprt.model.loader import expert_shard, load_model
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint, fp8_e4m3_to_f32
from eprt.ops.numpy_ops import NumpyOps

PROMPTS = [[5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11], [200, 100, 50, 25]]


@pytest.fixture(scope="module")
def fp8_pair(checkpoint, ckpt_root):
    """arch, block -> (fp8 dir, dequantized float32 dir)."""

    def make(arch, block):
        tag = f"{arch}-fp8-{block[0]}x{block[1]}"
        return build_fp8_copy(checkpoint(arch), f"{ckpt_root}/{tag}", block)

    return make


def test_e4m3fn_decoding_matches_torch_for_all_256_bytes():
    ours = fp8_e4m3_to_f32(np.arange(256, dtype=np.uint8))
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ours, ref)  # NaN (0x7F, 0xFF) at the same places; no infinities


@pytest.mark.parametrize("arch, block", [("deepseek_v3", (16, 32)), ("qwen3_moe", (128, 128))])
def test_fp8_greedy_matches_transformers_on_the_dequantized_weights(fp8_pair, arch, block):
    fp8, dequantized = fp8_pair(arch, block)
    assert SafetensorsCheckpoint(fp8).info("model.layers.2.mlp.experts.0.down_proj.weight").dtype == "F8_E4M3"
    tokens, logits = eprt_greedy(fp8, PROMPTS, 6)
    for p, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = reference_greedy(dequantized, prompt, 6)
        assert tokens[p] == ref_tokens
        np.testing.assert_allclose(logits[p], ref_logits, atol=2e-4, rtol=0)


def test_fp8_weights_dequantize_exactly_to_the_reference(fp8_pair):
    """--cpu-weights f32 dequantizes at load (auto keeps FP8 with its scales: tests/test_cpu_weights.py
    shows its products have the bits of these weights)."""
    fp8, dequantized = fp8_pair("deepseek_v3", (16, 32))
    got = load_model(fp8, NumpyOps(weights="f32"), 64).model.w.layers[1]
    want = load_model(dequantized, NumpyOps(weights="f32"), 64).model.w.layers[1]
    for name in ("w_gate_up", "w_down", "shared_gate_up", "q_a", "w_uk", "w_uv", "o", "router"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_its_experts_fp8_bytes_and_scales(fp8_pair, world):
    fp8, _ = fp8_pair("deepseek_v3", (16, 32))
    index = SafetensorsCheckpoint(fp8)
    size = {n: index.info(n).end - index.info(n).start for n in index.keys()}

    def expert_of(name):
        parts = name.split(".")
        return int(parts[parts.index("experts") + 1]) if "experts" in parts else None

    for rank in range(world):
        start, end = expert_shard(6, rank, world)
        mine = [n for n in size if expert_of(n) is None or start <= expert_of(n) < end]
        loaded = load_model(fp8, NumpyOps(), 64, rank=rank, world=world)
        assert loaded.tensors_read == len(mine)
        assert loaded.bytes_read == sum(size[n] for n in mine)
        assert f"model.layers.1.mlp.experts.{start}.up_proj.weight_scale_inv" in mine


def test_fp8_mistakes_are_named(fp8_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _ = fp8_pair("qwen3_moe", (128, 128))
    path = tmp_path / "bad"
    shutil.copytree(fp8, path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"
    tensors[name] = torch.ones((2, 2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.weight_scale_inv.*needs \(1, 1\)"):
        load_model(str(path), NumpyOps(), 64)
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.weight' holds 8-bit values but has no"):
        load_model(str(path), NumpyOps(), 64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        load_model(str(path), NumpyOps(), 64)
