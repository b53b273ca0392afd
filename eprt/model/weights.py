"""Load a MoE checkpoint's tensors into backend arrays, experts restricted to a range.

Tensor names follow the Hugging Face layout of each architecture (see ``config.py``).
Experts are stacked per layer into ``w_gate_up[El, 2I, D]`` and ``w_down[El, D, I]``
for the local range ``[expert_start, expert_end)``; a rank reads no other expert's
bytes. Checkpoints saved with fused expert tensors (``experts.gate_up_proj``
``[E, 2I, D]`` and ``experts.down_proj`` ``[E, D, I]``) are read too. Every tensor's
shape is checked against the config and its values scanned for NaN/Inf as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.safetensors_io import CheckpointError
from eprt.ops.bf16 import bf16_bits_to_f32


class TensorSource(Protocol):
    def __contains__(self, name: str) -> bool: ...
    def read(self, name: str) -> np.ndarray: ...


@dataclass
class LayerWeights:
    input_norm: object
    post_norm: object
    q: object
    k: object
    v: object
    o: object
    q_bias: object = None
    k_bias: object = None
    v_bias: object = None
    q_norm: object = None
    k_norm: object = None
    router: object = None  # [E, D]
    w_gate_up: object = None  # [El, 2I, D]
    w_down: object = None  # [El, D, I]
    shared_gate_up: object = None  # [2Is, D]
    shared_down: object = None  # [D, Is]
    shared_gate: object = None  # [1, D]
    mlp_gate_up: object = None  # dense layer [2I, D]
    mlp_down: object = None  # dense layer [D, I]


@dataclass
class ModelWeights:
    embed: object  # [V, D]
    norm: object  # [D]
    lm_head: object  # [V, D]
    layers: list = field(default_factory=list)
    expert_start: int = 0
    expert_end: int = 0


@dataclass(frozen=True)
class Dim:
    """One expected tensor dimension and the config field(s) it comes from."""

    size: int
    field: str


def _dims(cfg: ModelConfig) -> dict:
    """The named sizes every tensor shape is built from, labelled with their config.json fields."""
    mixtral_like = cfg.model_type in ("mixtral", "olmoe")
    return {
        "V": Dim(cfg.vocab_size, "vocab_size"),
        "D": Dim(cfg.hidden_size, "hidden_size"),
        "Dh": Dim(cfg.head_dim, "head_dim"),
        "Q": Dim(cfg.num_heads * cfg.head_dim, "num_attention_heads*head_dim"),
        "KV": Dim(cfg.num_kv_heads * cfg.head_dim, "num_key_value_heads*head_dim"),
        "E": Dim(cfg.num_experts, "num_local_experts" if cfg.model_type == "mixtral" else "num_experts"),
        "I": Dim(cfg.moe_intermediate_size, "intermediate_size" if mixtral_like else "moe_intermediate_size"),
        "2I": Dim(
            2 * cfg.moe_intermediate_size, "2*" + ("intermediate_size" if mixtral_like else "moe_intermediate_size")
        ),
        "Id": Dim(cfg.intermediate_size, "intermediate_size"),
        "Is": Dim(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size"),
        "1": Dim(1, "1"),
    }


def _check_shape(name: str, a: np.ndarray, expected: tuple) -> None:
    """``expected`` is a tuple of ``Dim``; the error names the tensor, both shapes and the config fields."""
    want = tuple(d.size for d in expected)
    if tuple(a.shape) != want:
        fields = ", ".join(f"{d.field}={d.size}" for d in expected if d.field != "1")
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(a.shape)} but the config implies {want} "
            f"({fields}): config.json does not describe these weights"
        )


_SCAN_CHUNK = 1 << 22  # elements per step of the bf16 scan (bounds its temporary memory)


def _count_nonfinite(a: np.ndarray) -> int:
    """Number of NaN/Inf values in a float array or bf16 bits (uint16); vectorised, no full-size copy
    on the common (all finite) path: NaN propagates through min/max and Inf shows in them."""
    if a.size == 0:
        return 0
    if a.dtype == np.uint16:  # bf16: exponent bits all ones is Inf or NaN
        flat = a.reshape(-1)
        return sum(
            int(np.count_nonzero((flat[s : s + _SCAN_CHUNK] & 0x7F80) == 0x7F80))
            for s in range(0, flat.size, _SCAN_CHUNK)
        )
    if a.dtype.kind != "f" or (np.isfinite(a.min()) and np.isfinite(a.max())):
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _check_finite(name: str, a: np.ndarray) -> None:
    bad = _count_nonfinite(a)
    if bad:
        raise CheckpointError(
            f"tensor {name!r} holds {bad} NaN/Inf value(s) of {a.size}: "
            f"the checkpoint is corrupt or was saved after a diverged update"
        )


def _read(src: TensorSource, name: str, expected: tuple) -> np.ndarray:
    """The tensor as stored, its shape checked against ``expected`` (a tuple of ``Dim``)."""
    if name not in src:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    a = src.read(name)
    _check_shape(name, a, expected)
    return a


def _host(src: TensorSource, name: str, expected: tuple) -> np.ndarray:
    """A checked (shape, finite) host array; fp16/fp64 widened to float32, bf16 kept as bits."""
    a = _read(src, name, expected)
    _check_finite(name, a)
    return a.astype(np.float32) if a.dtype in (np.float16, np.float64) else a


def _same_dtype(*arrays: np.ndarray) -> list:
    """bf16 bits (uint16) can only be stacked with bf16; otherwise widen everything to float32."""
    if all(a.dtype == np.uint16 for a in arrays):
        return list(arrays)
    return [bf16_bits_to_f32(a) if a.dtype == np.uint16 else a for a in arrays]


def _experts(src: TensorSource, cfg: ModelConfig, prefix: str, start: int, end: int):
    """Stacked host arrays (gate_up [El, 2I, D], down [El, D, I]) of experts [start, end)."""
    n = _dims(cfg)
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in src:
        down_name = f"{prefix}.experts.down_proj"
        gate_up = _read(src, fused, (n["E"], n["2I"], n["D"]))[start:end]
        down = _read(src, down_name, (n["E"], n["D"], n["I"]))[start:end]
        _check_finite(f"{fused}[{start}:{end}]", gate_up)
        _check_finite(f"{down_name}[{start}:{end}]", down)
        return np.ascontiguousarray(gate_up), np.ascontiguousarray(down)
    g_name, u_name, d_name = cfg.expert_names
    gate_up, down = [], []
    for e in range(start, end):
        base = f"{prefix}.experts.{e}"
        g, u, d = _same_dtype(
            _host(src, f"{base}.{g_name}.weight", (n["I"], n["D"])),
            _host(src, f"{base}.{u_name}.weight", (n["I"], n["D"])),
            _host(src, f"{base}.{d_name}.weight", (n["D"], n["I"])),
        )
        gate_up.append(np.concatenate([g, u], axis=0))
        down.append(d)
    return np.stack(_same_dtype(*gate_up)), np.stack(_same_dtype(*down))


def load_weights(
    src: TensorSource, cfg: ModelConfig, ops, expert_start: int = 0, expert_end: int | None = None
) -> ModelWeights:
    """Read every replicated tensor and the experts in [expert_start, expert_end) into ``ops`` arrays."""
    expert_end = cfg.num_experts if expert_end is None else expert_end
    if not 0 <= expert_start <= expert_end <= cfg.num_experts:
        raise ValueError(f"expert range [{expert_start}, {expert_end}) outside [0, {cfg.num_experts})")
    n = _dims(cfg)
    W = lambda name, *shape: ops.weight(_host(src, name, tuple(n[d] for d in shape)))  # noqa: E731
    embed = W("model.embed_tokens.weight", "V", "D")
    if cfg.tie_word_embeddings or "lm_head.weight" not in src:
        if not cfg.tie_word_embeddings:
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        lm_head = embed
    else:
        lm_head = W("lm_head.weight", "V", "D")
    weights = ModelWeights(
        embed=embed, norm=W("model.norm.weight", "D"), lm_head=lm_head, expert_start=expert_start, expert_end=expert_end
    )
    norm_dims = ("Dh", "Dh") if cfg.qk_norm == "head" else ("Q", "KV")
    for i, sparse in enumerate(cfg.sparse_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        lw = LayerWeights(
            input_norm=W(f"{p}.input_layernorm.weight", "D"),
            post_norm=W(f"{p}.post_attention_layernorm.weight", "D"),
            q=W(f"{a}.q_proj.weight", "Q", "D"),
            k=W(f"{a}.k_proj.weight", "KV", "D"),
            v=W(f"{a}.v_proj.weight", "KV", "D"),
            o=W(f"{a}.o_proj.weight", "D", "Q"),
        )
        if cfg.qkv_bias:
            lw.q_bias, lw.k_bias, lw.v_bias = (
                W(f"{a}.q_proj.bias", "Q"),
                W(f"{a}.k_proj.bias", "KV"),
                W(f"{a}.v_proj.bias", "KV"),
            )
        if cfg.qk_norm:
            lw.q_norm, lw.k_norm = W(f"{a}.q_norm.weight", norm_dims[0]), W(f"{a}.k_norm.weight", norm_dims[1])
        m = f"{p}.{cfg.moe_prefix}"
        if sparse:
            lw.router = W(f"{m}.gate.weight", "E", "D")
            gate_up, down = _experts(src, cfg, m, expert_start, expert_end)
            lw.w_gate_up, lw.w_down = ops.weight(gate_up), ops.weight(down)
            if cfg.has_shared_expert:
                s = f"{m}.shared_expert"
                g, u = _same_dtype(
                    _host(src, f"{s}.gate_proj.weight", (n["Is"], n["D"])),
                    _host(src, f"{s}.up_proj.weight", (n["Is"], n["D"])),
                )
                lw.shared_gate_up = ops.weight(np.concatenate([g, u], axis=0))
                lw.shared_down = W(f"{s}.down_proj.weight", "D", "Is")
                lw.shared_gate = W(f"{m}.shared_expert_gate.weight", "1", "D")
        else:
            g, u = _same_dtype(
                _host(src, f"{m}.gate_proj.weight", (n["Id"], n["D"])),
                _host(src, f"{m}.up_proj.weight", (n["Id"], n["D"])),
            )
            lw.mlp_gate_up = ops.weight(np.concatenate([g, u], axis=0))
            lw.mlp_down = W(f"{m}.down_proj.weight", "D", "Id")
        weights.layers.append(lw)
    return weights
