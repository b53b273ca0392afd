"""Checkpoint loading: sharded files, dtypes, generation_config EOS ids, clear errors."""
import json
import os
import shutil

import numpy as np
import pytest

from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.loader import expert_shard, load_model
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint
from eprt.ops.numpy_ops import NumpyOps


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    import transformers
    single = checkpoint("qwen2_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a = load_model(single, NumpyOps(), 64).model.w
    b = load_model(str(sharded), NumpyOps(), 64).model.w
    np.testing.assert_array_equal(a.layers[1].w_gate_up, b.layers[1].w_gate_up)
    np.testing.assert_array_equal(a.lm_head, b.lm_head)


def test_fp16_checkpoint_loads_as_float32(checkpoint):
    w = load_model(checkpoint("mixtral", dtype="float16"), NumpyOps(), 64).model.w
    assert w.layers[0].w_down.dtype == np.float32 and w.embed.dtype == np.float32


def test_tied_lm_head_is_the_embedding(checkpoint):
    w = load_model(checkpoint("qwen3_moe"), NumpyOps(), 64).model.w
    assert w.lm_head is w.embed


def test_dense_layers_follow_mlp_only_layers_and_sparse_step(checkpoint):
    assert load_config(checkpoint("qwen3_moe")).sparse_layers == (True, False, True)   # mlp_only_layers=[1]
    assert load_config(checkpoint("qwen2_moe")).sparse_layers == (False, True, False)  # decoder_sparse_step=2


def test_eos_ids_come_from_config_and_generation_config(checkpoint, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(checkpoint("olmoe"), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(str(path)).eos_token_ids == (2, 7)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file
    path = tmp_path / "ck"
    shutil.copytree(checkpoint("mixtral"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        load_model(str(path), NumpyOps(), 64)
    # a rank that does not own expert 3 never reads it, so it loads fine
    s, e = expert_shard(6, 0, 2)
    assert not s <= 3 < e
    load_model(str(path), NumpyOps(), 64, rank=0, world=2)


def test_unsupported_model_type_and_bad_fields_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        config_from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        config_from_dict({"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2,
                          "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
                          "vocab_size": 10, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(str(tmp_path))


def test_truncated_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsCheckpoint(str(tmp_path))
