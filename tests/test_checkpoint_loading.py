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


MIXTRAL = {"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1, "vocab_size": 10,
           "intermediate_size": 4}
QWEN3 = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 4, "num_hidden_layers": 2, "num_experts": 2, "num_experts_per_tok": 1, "vocab_size": 10,
         "moe_intermediate_size": 4, "intermediate_size": 6, "mlp_only_layers": [1], "decoder_sparse_step": 1}


@pytest.mark.parametrize("base, field", [
    (MIXTRAL, "hidden_size"), (MIXTRAL, "num_attention_heads"), (MIXTRAL, "num_key_value_heads"),
    (MIXTRAL, "num_hidden_layers"), (MIXTRAL, "vocab_size"), (MIXTRAL, "num_local_experts"),
    (MIXTRAL, "num_experts_per_tok"), (MIXTRAL, "intermediate_size"), (QWEN3, "head_dim"),
    (QWEN3, "moe_intermediate_size"), (QWEN3, "intermediate_size"), (QWEN3, "num_experts"),
    (QWEN3, "decoder_sparse_step"),
])
@pytest.mark.parametrize("value", [0, -2, "8", 2.5, True])
def test_non_positive_or_non_integer_sizes_name_the_field(base, field, value):
    assert config_from_dict(base).num_layers >= 1               # the base config is valid
    with pytest.raises(ConfigError, match=f"'{field}' must be"):
        config_from_dict({**base, field: value})


def test_bad_head_dim_default_and_float_fields_are_clear():
    with pytest.raises(ConfigError, match="hidden_size=1 < num_attention_heads=2 and no head_dim"):
        config_from_dict({**MIXTRAL, "hidden_size": 1})
    for field in ("rms_norm_eps", "rope_theta"):
        with pytest.raises(ConfigError, match=f"'{field}' must be a positive number"):
            config_from_dict({**MIXTRAL, field: 0})
    with pytest.raises(ConfigError, match="'rope_scaling' must be an object"):
        config_from_dict({**MIXTRAL, "rope_scaling": "linear"})
    with pytest.raises(ConfigError, match="'mlp_only_layers' must be a list"):
        config_from_dict({**QWEN3, "mlp_only_layers": "1"})
    with pytest.raises(ConfigError, match="'eos_token_id' must be an integer"):
        config_from_dict(MIXTRAL, {"eos_token_id": ["</s>"]})


def test_bad_json_files_are_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json must hold a JSON object, got list"):
        load_config(str(tmp_path))
    config.write_text('{"model_type": "mixtral",')
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        load_config(str(tmp_path))
    config.write_text(json.dumps({**MIXTRAL, "num_attention_heads": 0}))
    with pytest.raises(ConfigError, match=f"{tmp_path}: config.json field 'num_attention_heads' must be >= 1"):
        load_config(str(tmp_path))
    config.write_text(json.dumps(MIXTRAL))
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"generation_config\.json is not valid JSON"):
        load_config(str(tmp_path))
    (tmp_path / "generation_config.json").write_text('"eos"')
    with pytest.raises(ConfigError, match="generation_config.json must hold a JSON object"):
        load_config(str(tmp_path))


def _write_header(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_truncated_or_corrupt_safetensors_names_file_and_tensor(tmp_path):
    from safetensors.numpy import save_file
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": np.ones((4, 4), np.float32), "b.weight": np.ones((8, 8), np.float32)}, path)
    whole = path.read_bytes()
    assert SafetensorsCheckpoint(str(tmp_path)).read("b.weight").sum() == 64
    path.write_bytes(whole[:-16])                               # cut inside the last tensor
    with pytest.raises(CheckpointError, match=r"tensor 'b\.weight' in .*model\.safetensors.* lies outside the file"):
        SafetensorsCheckpoint(str(tmp_path))
    path.write_bytes(whole[:20])                                # cut inside the header
    with pytest.raises(CheckpointError, match="header length .* exceeds the file size 20"):
        SafetensorsCheckpoint(str(tmp_path))
    bad_entries = [({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "invalid data_offsets"),
                   ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "invalid data_offsets"),
                   ({"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}, "invalid shape"),
                   ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}, "unsupported dtype 'Q4'"),
                   ("F32", "corrupt header entry")]
    for entry, words in bad_entries:
        _write_header(path, {"x": entry}, b"\0" * 4)
        with pytest.raises(CheckpointError, match=f"tensor 'x' in .*{words}"):
            SafetensorsCheckpoint(str(tmp_path))
    _write_header(path, [1, 2])
    with pytest.raises(CheckpointError, match="not a JSON object"):
        SafetensorsCheckpoint(str(tmp_path))


def test_corrupt_shard_index_is_named(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json is not valid JSON"):
        SafetensorsCheckpoint(str(tmp_path))
    index.write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(CheckpointError, match="has no weight_map of tensor names to file names"):
        SafetensorsCheckpoint(str(tmp_path))
