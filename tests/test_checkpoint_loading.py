"""Checkpoint loading: sharded files, dtypes, generation_config EOS ids, clear errors."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.loader import expert_shard, load_model
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint
from eprt.ops.numpy_ops import NumpyOps


@pytest.mark.slow
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
    assert load_config(checkpoint("qwen3_moe")).sparse_layers == (True, False, True)  # mlp_only_layers=[1]
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
    with pytest.raises(ConfigError, match="rope type 'dynamic'"):
        config_from_dict(
            {
                "model_type": "mixtral",
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "vocab_size": 10,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
            }
        )
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(str(tmp_path))


def test_truncated_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsCheckpoint(str(tmp_path))


MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 10,
    "intermediate_size": 4,
}
QWEN3 = {
    "model_type": "qwen3_moe",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_hidden_layers": 2,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 10,
    "moe_intermediate_size": 4,
    "intermediate_size": 6,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
}


@pytest.mark.parametrize(
    "base, field",
    [
        (MIXTRAL, "hidden_size"),
        (MIXTRAL, "num_attention_heads"),
        (MIXTRAL, "num_key_value_heads"),
        (MIXTRAL, "num_hidden_layers"),
        (MIXTRAL, "vocab_size"),
        (MIXTRAL, "num_local_experts"),
        (MIXTRAL, "num_experts_per_tok"),
        (MIXTRAL, "intermediate_size"),
        (QWEN3, "head_dim"),
        (QWEN3, "moe_intermediate_size"),
        (QWEN3, "intermediate_size"),
        (QWEN3, "num_experts"),
        (QWEN3, "decoder_sparse_step"),
    ],
)
@pytest.mark.parametrize("value", [0, -2, "8", 2.5, True])
def test_non_positive_or_non_integer_sizes_name_the_field(base, field, value):
    assert config_from_dict(base).num_layers >= 1  # the base config is valid
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
    path.write_bytes(whole[:-16])  # cut inside the last tensor
    with pytest.raises(CheckpointError, match=r"tensor 'b\.weight' in .*model\.safetensors.* lies outside the file"):
        SafetensorsCheckpoint(str(tmp_path))
    path.write_bytes(whole[:20])  # cut inside the header
    with pytest.raises(CheckpointError, match="header length .* exceeds the file size 20"):
        SafetensorsCheckpoint(str(tmp_path))
    bad_entries = [
        ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "invalid data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "invalid data_offsets"),
        ({"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}, "invalid shape"),
        ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}, "unsupported dtype 'Q4'"),
        ("F32", "corrupt header entry"),
    ]
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


# ---- every tensor checked against the config at load: shapes and values ------------------------------


def _copy_with(src, dst, config_changes=None, tensor_changes=None) -> str:
    """A copy of checkpoint ``src`` with config.json fields and/or tensors replaced."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config_changes:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config_changes}))
    if tensor_changes:
        tensors = load_file(dst / "model.safetensors")
        for name, change in tensor_changes.items():
            tensors[name] = change(tensors[name].copy())
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _shape_error(tensor: str, got: tuple, want: tuple, field: str) -> str:
    return (
        rf"tensor '{tensor.replace('.', chr(92) + '.')}' has shape {re.escape(str(got))} "
        rf"but the config implies {re.escape(str(want))} \(.*{re.escape(field)}"
    )


@pytest.mark.parametrize(
    "arch, change, tensor, got, want, field",
    [
        # the case: vocab_size 1000 over a 256-row embedding (a request with id 700 crashed the job)
        ("mixtral", {"vocab_size": 1000}, "model.embed_tokens.weight", (256, 64), (1000, 64), "vocab_size=1000"),
        ("qwen3_moe", {"vocab_size": 200}, "model.embed_tokens.weight", (256, 64), (200, 64), "vocab_size=200"),
        ("mixtral", {"hidden_size": 32}, "model.embed_tokens.weight", (256, 64), (256, 32), "hidden_size=32"),
        ("qwen3_moe", {"num_experts": 4}, "model.layers.0.mlp.gate.weight", (6, 64), (4, 64), "num_experts=4"),
        (
            "mixtral",
            {"num_local_experts": 8},
            "model.layers.0.block_sparse_moe.gate.weight",
            (6, 64),
            (8, 64),
            "num_local_experts=8",
        ),
        (
            "qwen3_moe",
            {"num_attention_heads": 8},
            "model.layers.0.self_attn.q_proj.weight",
            (64, 64),
            (128, 64),
            "num_attention_heads*head_dim=128",
        ),
        (
            "olmoe",
            {"num_key_value_heads": 4},
            "model.layers.0.self_attn.k_proj.weight",
            (32, 64),
            (64, 64),
            "num_key_value_heads*head_dim=64",
        ),
        (
            "qwen3_moe",
            {"head_dim": 8},
            "model.layers.0.self_attn.q_proj.weight",
            (64, 64),
            (32, 64),
            "num_attention_heads*head_dim=32",
        ),
        (
            "qwen3_moe",
            {"moe_intermediate_size": 32},
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            (48, 64),
            (32, 64),
            "moe_intermediate_size=32",
        ),
        (
            "qwen3_moe",
            {"intermediate_size": 80},
            "model.layers.1.mlp.gate_proj.weight",
            (96, 64),
            (80, 64),
            "intermediate_size=80",
        ),
        (
            "mixtral",
            {"intermediate_size": 80},
            "model.layers.0.block_sparse_moe.experts.0.w1.weight",
            (96, 64),
            (80, 64),
            "intermediate_size=80",
        ),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": 40},
            "model.layers.1.mlp.shared_expert.gate_proj.weight",
            (80, 64),
            (40, 64),
            "shared_expert_intermediate_size=40",
        ),
    ],
)
def test_config_disagreeing_with_a_tensor_names_tensor_and_shapes(
    checkpoint, tmp_path, arch, change, tensor, got, want, field
):
    path = _copy_with(checkpoint(arch), tmp_path / "ck", config_changes=change)
    with pytest.raises(CheckpointError, match=_shape_error(tensor, got, want, field)):
        load_model(path, NumpyOps(), 64)


def test_expert_count_is_checked_on_a_rank_that_reads_few_experts(checkpoint, tmp_path):
    """num_experts 4 over 6 stored experts: rank 0 of 2 reads experts 0-1 only, and still refuses."""
    path = _copy_with(checkpoint("qwen3_moe"), tmp_path / "ck", config_changes={"num_experts": 4})
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight' has shape \(6, 64\).*num_experts=4"):
        load_model(path, NumpyOps(), 64, rank=0, world=2)


def test_lm_head_rows_are_checked_against_vocab_size(checkpoint, tmp_path):
    path = _copy_with(checkpoint("qwen2_moe"), tmp_path / "ck", tensor_changes={"lm_head.weight": lambda a: a[:200]})
    with pytest.raises(CheckpointError, match=_shape_error("lm_head.weight", (200, 64), (256, 64), "vocab_size=256")):
        load_model(path, NumpyOps(), 64)


def test_fused_expert_tensors_are_checked(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "ck"
    shutil.copytree(checkpoint("qwen3_moe"), path)
    tensors = load_file(path / "model.safetensors")
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            np.concatenate([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
            for e in range(6)
        ]
        tensors[f"{p}.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{p}.down_proj"] = np.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(6)])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    a = load_model(checkpoint("qwen3_moe"), NumpyOps(), 64).model.w
    b = load_model(str(path), NumpyOps(), 64, rank=1, world=2).model.w
    np.testing.assert_array_equal(a.layers[2].w_down[3:], b.layers[2].w_down)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 24}))
    with pytest.raises(
        CheckpointError,
        match=_shape_error(
            "model.layers.0.mlp.experts.gate_up_proj", (6, 96, 64), (6, 48, 64), "2*moe_intermediate_size=48"
        ),
    ):
        load_model(str(path), NumpyOps(), 64, rank=1, world=2)


def _poison(value, index=(3, 5)):
    def change(a):
        a[index] = value
        return a

    return change


@pytest.mark.parametrize(
    "arch, dtype, tensor, value",
    [
        ("mixtral", "float32", "model.layers.1.block_sparse_moe.experts.4.w2.weight", np.nan),
        ("qwen3_moe", "float32", "model.embed_tokens.weight", np.inf),
        ("qwen2_moe", "float32", "model.layers.2.self_attn.v_proj.weight", -np.inf),
        ("mixtral", "float16", "lm_head.weight", np.inf),
        ("mixtral", "bfloat16", "model.layers.0.block_sparse_moe.experts.1.w1.weight", np.nan),
        ("mixtral", "bfloat16", "model.layers.0.self_attn.o_proj.weight", -np.inf),
    ],
)
def test_nan_or_inf_weights_are_refused_naming_the_tensor(checkpoint, tmp_path, arch, dtype, tensor, value):
    src = checkpoint(arch, dtype=dtype)
    if dtype == "bfloat16":  # safetensors.numpy has no bfloat16: set the raw bits (NaN 0x7FC0, -Inf 0xFF80)
        bits = np.uint16(0x7FC0) if np.isnan(value) else np.uint16(0xFF80)
        path = tmp_path / "ck"
        shutil.copytree(src, path)
        ck = SafetensorsCheckpoint(str(path))
        info = ck.info(tensor)
        ck.close()
        with open(info.file, "r+b") as f:
            f.seek(info.start + 2 * 77)
            f.write(bits.tobytes())
    else:
        path = _copy_with(src, tmp_path / "ck", tensor_changes={tensor: _poison(value)})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(tensor)}' holds 1 NaN/Inf value\(s\)"):
        load_model(str(path), NumpyOps(), 64)


def test_nan_in_an_expert_another_rank_owns_does_not_stop_this_rank(checkpoint, tmp_path):
    tensor = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    path = _copy_with(checkpoint("mixtral"), tmp_path / "ck", tensor_changes={tensor: _poison(np.nan)})
    load_model(path, NumpyOps(), 64, rank=0, world=2)  # experts 0-2
    with pytest.raises(CheckpointError, match=re.escape(tensor)):
        load_model(path, NumpyOps(), 64, rank=1, world=2)  # experts 3-5


def test_generate_with_nan_weights_exits_nonzero_naming_the_tensor(checkpoint, tmp_path):
    """Was: token 0 forever and exit status 0."""
    import subprocess
    import sys

    tensor = "model.layers.0.self_attn.q_proj.weight"
    path = _copy_with(checkpoint("olmoe"), tmp_path / "ck", tensor_changes={tensor: _poison(np.nan)})
    proc = subprocess.run(
        [sys.executable, "-m", "eprt", "generate", "--model", path, "--prompt-ids", "5,6,7", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert tensor in proc.stderr and "NaN/Inf" in proc.stderr
