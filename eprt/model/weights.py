"""Load a MoE checkpoint's tensors into backend arrays, experts restricted to a range.

Tensor names follow the Hugging Face layout of each architecture (see ``config.py``).
Experts are stacked per layer into ``w_gate_up[El, 2I, D]`` and ``w_down[El, D, I]``
for the local range ``[expert_start, expert_end)``; a rank reads no other expert's
bytes. Checkpoints saved with fused expert tensors (``experts.gate_up_proj``
``[E, 2I, D]`` and ``experts.down_proj`` ``[E, D, I]``) are read too. Every tensor's
shape is checked against the config and its values scanned for NaN/Inf as it is read.
FP8 block-scaled weights (``X.weight`` F8_E4M3 with ``X.weight_scale_inv``) stay FP8 where the backend
keeps them (``ops.keeps_fp8``: the GPU; the CPU under --cpu-weights auto, 16-row panels), else are
dequantized block-wise as read; MLA kv_b_proj is split into W_UK / W_UV.
Qwen3-Next: the Gated DeltaNet projections are regrouped from per-key-head to [q | k | v | z]
and [b | a]; q_proj's per-head output gate is split off; (1 + w) norm weights get their 1 added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from eprt.model import gptoss_weights
from eprt.model.config import Fp8Quantization, ModelConfig
from eprt.model.safetensors_io import CheckpointError, fp8_e4m3_to_f32
from eprt.ops.bf16 import bf16_bits_to_f32


class TensorSource(Protocol):
    def __contains__(self, name: str) -> bool: ...
    def read(self, name: str) -> np.ndarray: ...


@dataclass
class GatedDeltaNetWeights:
    """One Gated DeltaNet layer (qwen3_next's linear attention). Hk/Hv key/value heads, dk/dv their dims,
    C = 2*Hk*dk + Hv*dv conv channels, K the conv kernel."""

    in_proj: object  # [2*Hk*dk + 2*Hv*dv, D]: rows q | k | v | z (regrouped from in_proj_qkvz)
    in_proj_ba: object  # [2*Hv, D]: rows b (beta logits) | a (decay inputs)
    conv: object  # [C, K] depthwise causal conv, no bias
    a_log: object  # [Hv] float32
    dt_bias: object  # [Hv] float32
    norm: object  # [dv] gated RMSNorm weight
    out: object  # [D, Hv*dv]


@dataclass
class LayerWeights:
    input_norm: object
    post_norm: object
    q: object  # [Q, D]; None where qkv holds q, k and v
    k: object
    v: object
    o: object
    qkv: object = None  # [Q + 2 KV, D]: q, k, v in one matrix (one GEMV at decode), when none is FP8
    qkv_bias: object = None  # [Q + 2 KV]
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
    router_bias: object = None  # [E] e_score_correction_bias (selection only)
    q_a: object = None  # MLA with q_lora_rank: [Qr, D] (then q is q_b_proj [H*(Dn+R), Qr]); None in qkv_a
    q_a_norm: object = None  # [Qr]
    kv_a: object = None  # MLA kv_a_proj_with_mqa [C+R, D]; None where qkv_a holds it
    qkv_a: object = None  # MLA [Qr + C+R, D]: q_a | kv_a in one matrix (one product), when q_a is not FP8
    kv_a_norm: object = None  # [C]
    w_uk: object = None  # MLA absorbed key up-projection [H, C, Dn]
    w_uv: object = None  # MLA value up-projection [H, Dv, C]
    q_gate: object = None  # qwen3_next attention output gate [H*Dh, D] (split from q_proj)
    o_bias: object = None  # [D] (gpt_oss)
    sinks: object = None  # [H] float32 attention sink logits (gpt_oss)
    router_logit_bias: object = None  # [E] added to the router's logits (gpt_oss)
    b_gate_up: object = None  # [El, 2I] float32 expert biases (gpt_oss)
    b_down: object = None  # [El, D] float32
    linear: GatedDeltaNetWeights | None = None  # qwen3_next linear-attention layer (then q/k/v/o are None)


@dataclass
class MtpWeights:
    """A multi-token prediction layer (``model.layers.{num_hidden_layers}.*``): the next token's
    embedding and the previous hidden state, each normed, projected to one row, one decoder layer,
    then its own head."""

    enorm: object  # [D] on the next token's embedding
    hnorm: object  # [D] on the previous hidden state
    eh_proj: object  # [D, 2D] over [enorm(embedding) | hnorm(hidden)]
    layer: LayerWeights  # a full decoder layer (MoE with this rank's experts)
    head_norm: object  # [D] shared_head.norm
    head: object  # [V, D] shared_head.head
    embed: object  # [V, D] its own embed_tokens, else the main model's


@dataclass
class ModelWeights:
    embed: object  # [V, D]
    norm: object  # [D]
    lm_head: object  # [V, D]
    layers: list = field(default_factory=list)
    expert_start: int = 0
    expert_end: int = 0
    mtp: MtpWeights | None = None  # DeepSeek's multi-token prediction layer (--speculative-method mtp)


@dataclass(frozen=True)
class Dim:
    """One expected tensor dimension and the config field(s) it comes from."""

    size: int
    field: str


def _dims(cfg: ModelConfig) -> dict:
    """The named sizes every tensor shape is built from, labelled with their config.json fields."""
    mixtral_like = cfg.model_type in ("mixtral", "olmoe", "gpt_oss")
    return {
        "V": Dim(cfg.vocab_size, "vocab_size"),
        "D": Dim(cfg.hidden_size, "hidden_size"),
        "Dh": Dim(cfg.head_dim, "head_dim"),
        "Q": Dim(cfg.num_heads * cfg.head_dim, "num_attention_heads*head_dim"),
        "KV": Dim(cfg.num_kv_heads * cfg.head_dim, "num_key_value_heads*head_dim"),
        "E": Dim(cfg.num_experts, "num_local_experts" if cfg.model_type in ("mixtral", "gpt_oss") else "num_experts"),
        "I": Dim(cfg.moe_intermediate_size, "intermediate_size" if mixtral_like else "moe_intermediate_size"),
        "2I": Dim(
            2 * cfg.moe_intermediate_size, "2*" + ("intermediate_size" if mixtral_like else "moe_intermediate_size")
        ),
        "Id": Dim(cfg.intermediate_size, "intermediate_size"),
        "Is": Dim(
            cfg.shared_expert_intermediate_size,
            "moe_intermediate_size*n_shared_experts" if cfg.routing else "shared_expert_intermediate_size",
        ),
        "1": Dim(1, "1"),
        "2D": Dim(2 * cfg.hidden_size, "2*hidden_size"),
        "2Q": Dim(2 * cfg.num_heads * cfg.head_dim, "2*num_attention_heads*head_dim"),
        **_mla_dims(cfg),
        **_linear_dims(cfg),
    }


def _linear_dims(cfg: ModelConfig) -> dict:
    la = cfg.linear_attention
    if la is None:
        return {}
    return {
        "QKVZ": Dim(2 * la.key_dim + 2 * la.value_dim, "2*linear_num_key_heads*linear_key_head_dim+2*value_dim"),
        "BA": Dim(2 * la.num_value_heads, "2*linear_num_value_heads"),
        "Hv": Dim(la.num_value_heads, "linear_num_value_heads"),
        "Cv": Dim(la.conv_dim, "2*linear_num_key_heads*linear_key_head_dim+value_dim"),
        "Kc": Dim(la.conv_kernel, "linear_conv_kernel_dim"),
        "dv": Dim(la.value_head_dim, "linear_value_head_dim"),
        "HVdv": Dim(la.value_dim, "linear_num_value_heads*linear_value_head_dim"),
    }


def _mla_dims(cfg: ModelConfig) -> dict:
    m, H = cfg.mla, cfg.num_heads
    if m is None:
        return {}
    return {
        "Qr": Dim(m.q_lora_rank, "q_lora_rank"),
        "C": Dim(m.kv_lora_rank, "kv_lora_rank"),
        "C+R": Dim(m.latent_dim, "kv_lora_rank+qk_rope_head_dim"),
        "HQ": Dim(H * (m.qk_nope_head_dim + m.qk_rope_head_dim), "num_attention_heads*(qk_nope+qk_rope_head_dim)"),
        "HKV": Dim(H * (m.qk_nope_head_dim + m.v_head_dim), "num_attention_heads*(qk_nope_head_dim+v_head_dim)"),
        "HV": Dim(H * m.v_head_dim, "num_attention_heads*v_head_dim"),
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


class Fp8Source:
    """A TensorSource that dequantizes FP8 block-scaled weights as they are read: a tensor with a
    ``<name>_scale_inv`` sibling holds float8_e4m3fn bytes, scaled per [block_n, block_k] block.
    Only the requested tensor and its scales are read from the underlying source."""

    def __init__(self, src: TensorSource, quant: Fp8Quantization):
        self.src, self.quant = src, quant

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def read(self, name: str) -> np.ndarray:
        scale_name = f"{name}_scale_inv"
        if not name.endswith(".weight") or scale_name not in self.src:
            return self.src.read(name)
        return dequantize_fp8(name, self.src.read(name), self.src.read(scale_name), self.quant)

    def read_fp8(self, name: str) -> tuple | None:
        """(float8_e4m3fn bytes [N, K], float32 scale_inv) of an FP8 tensor, checked; None for any other."""
        scale_name = f"{name}_scale_inv"
        if not name.endswith(".weight") or scale_name not in self.src:
            return None
        raw = self.src.read(name)
        return raw, fp8_scales(name, raw, self.src.read(scale_name), self.quant)


def dequantize_fp8(name: str, raw: np.ndarray, scale_inv: np.ndarray, quant: Fp8Quantization) -> np.ndarray:
    """float8_e4m3fn bytes raw[N, K] times scale_inv[ceil(N/bn), ceil(K/bk)] block-wise -> float32 [N, K]."""
    bn, bk = quant.block_n, quant.block_k
    scale = fp8_scales(name, raw, scale_inv, quant)
    N, K = raw.shape
    w = fp8_e4m3_to_f32(raw)  # [N, K]
    full = np.repeat(np.repeat(scale, bn, axis=0)[:N], bk, axis=1)[:, :K]  # [N, K]
    return w * full


def fp8_scales(name: str, raw: np.ndarray, scale_inv: np.ndarray, quant: Fp8Quantization) -> np.ndarray:
    """The checked float32 block scales of FP8 tensor ``name`` (raw [N, K] uint8)."""
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise CheckpointError(
            f"tensor {name!r} has a weight_scale_inv, so it must be a 2-D F8_E4M3 tensor; "
            f"got {raw.dtype} of shape {tuple(raw.shape)}"
        )
    N, K = raw.shape
    bn, bk = quant.block_n, quant.block_k
    want = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"tensor {name + '_scale_inv'!r} has shape {tuple(scale_inv.shape)} but {name!r} {(N, K)} in "
            f"weight_block_size [{bn}, {bk}] blocks needs {want}"
        )
    scale = scale_inv if scale_inv.dtype != np.uint16 else bf16_bits_to_f32(scale_inv)
    return np.asarray(scale, dtype=np.float32)


def _resident_fp8(src: TensorSource, ops, names: list, expected: tuple):
    """The FP8 tensors ``names`` (each of shape ``expected``, stacked by rows) uploaded as FP8 on a
    backend that keeps them (``ops.fp8_resident``); None when any is not FP8 (then read dequantized)."""
    if not (ops.fp8_resident and isinstance(src, Fp8Source)) or any(name not in src for name in names):
        return None
    q = src.quant
    if len(expected) != 2 or not ops.keeps_fp8((len(names) * expected[0].size, expected[1].size), q.block_k):
        return None
    parts = [src.read_fp8(name) for name in names]
    if any(p is None for p in parts):
        return None
    for name, (raw, scale) in zip(names, parts):
        _check_shape(name, raw, expected)
        _check_fp8_finite(name, raw, scale)
    raw, scale = (np.concatenate([p[i] for p in parts]) for i in (0, 1))
    return ops.weight_fp8(raw, scale, q.block_n, q.block_k, expected[0].size)


def _check_fp8_finite(name: str, raw: np.ndarray, scale: np.ndarray) -> None:
    nan = int(np.count_nonzero((raw & 0x7F) == 0x7F))  # float8_e4m3fn has NaN but no infinity
    if nan:
        raise CheckpointError(f"tensor {name!r} holds {nan} NaN value(s) of {raw.size}: the checkpoint is corrupt")
    _check_finite(name + "_scale_inv", scale)


def _weight(src: TensorSource, ops, name: str, expected: tuple):
    """One weight: FP8-resident where the backend keeps FP8, else a checked host array uploaded (a
    matrix as a linear layer's: every matrix read through here is one)."""
    fp8 = _resident_fp8(src, ops, [name], expected)
    if fp8 is not None:
        return fp8
    host = _host(src, name, expected)
    return ops.linear_weight(host) if host.ndim == 2 else ops.weight(host)


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
    if a.dtype == np.uint8:
        raise CheckpointError(
            f"tensor {name!r} holds 8-bit values but has no {name + '_scale_inv'!r} (or config.json no fp8 "
            f"quantization_config): eprt reads 8-bit weights only as FP8 with block scales"
        )
    _check_finite(name, a)
    return a.astype(np.float32) if a.dtype in (np.float16, np.float64) else a


def _same_dtype(*arrays: np.ndarray) -> list:
    """bf16 bits (uint16) can only be stacked with bf16; otherwise widen everything to float32."""
    if all(a.dtype == np.uint16 for a in arrays):
        return list(arrays)
    return [bf16_bits_to_f32(a) if a.dtype == np.uint16 else a for a in arrays]


def _experts(src: TensorSource, cfg: ModelConfig, prefix: str, ids: Sequence[int]):
    """Stacked host arrays (gate_up [El, 2I, D], down [El, D, I]) of the experts ``ids``, in that order."""
    n = _dims(cfg)
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in src:
        down_name = f"{prefix}.experts.down_proj"
        rows = np.asarray(ids, dtype=np.int64)
        gate_up = _read(src, fused, (n["E"], n["2I"], n["D"]))[rows]
        down = _read(src, down_name, (n["E"], n["D"], n["I"]))[rows]
        _check_finite(f"{fused}[{_id_text(ids)}]", gate_up)
        _check_finite(f"{down_name}[{_id_text(ids)}]", down)
        return np.ascontiguousarray(gate_up), np.ascontiguousarray(down)
    g_name, u_name, d_name = cfg.expert_names
    gate_up, down = [], []
    for e in ids:
        base = f"{prefix}.experts.{e}"
        g, u, d = _same_dtype(
            _host(src, f"{base}.{g_name}.weight", (n["I"], n["D"])),
            _host(src, f"{base}.{u_name}.weight", (n["I"], n["D"])),
            _host(src, f"{base}.{d_name}.weight", (n["D"], n["I"])),
        )
        gate_up.append(np.concatenate([g, u], axis=0))
        down.append(d)
    return np.stack(_same_dtype(*gate_up)), np.stack(_same_dtype(*down))


def _id_text(ids: Sequence[int]) -> str:
    ids = list(ids)
    contiguous = ids and ids == list(range(ids[0], ids[0] + len(ids)))
    return f"{ids[0]}:{ids[-1] + 1}" if contiguous else ",".join(map(str, ids))


def load_weights(
    src: TensorSource,
    cfg: ModelConfig,
    ops,
    expert_start: int = 0,
    expert_end: int | None = None,
    local_experts: np.ndarray | None = None,
) -> ModelWeights:
    """Read every replicated tensor and the experts in [expert_start, expert_end) into ``ops`` arrays;
    with ``local_experts`` ([layers, slots] logical ids, an EPLB placement) layer i holds those experts."""
    expert_end = cfg.num_experts if expert_end is None else expert_end
    if not 0 <= expert_start <= expert_end <= cfg.num_experts:
        raise ValueError(f"expert range [{expert_start}, {expert_end}) outside [0, {cfg.num_experts})")
    if cfg.fp8 is not None:
        src = Fp8Source(src, cfg.fp8)
    n = _dims(cfg)
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    embed = ops.weight(_host(src, "model.embed_tokens.weight", (n["V"], n["D"])))  # a table: never FP8-resident
    if cfg.tie_word_embeddings or "lm_head.weight" not in src:
        if not cfg.tie_word_embeddings:
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        lm_head = ops.tied_head(embed)
    else:
        lm_head = W("lm_head.weight", "V", "D")
    N = lambda name, *shape: _norm_weight(src, cfg, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    weights = ModelWeights(
        embed=embed, norm=N("model.norm.weight", "D"), lm_head=lm_head, expert_start=expert_start, expert_end=expert_end
    )
    for i, sparse in enumerate(cfg.sparse_layers):  # layers past num_hidden_layers (MTP): load_mtp_weights
        ids = range(expert_start, expert_end) if local_experts is None else local_experts[i].tolist()
        weights.layers.append(_layer(src, cfg, ops, f"model.layers.{i}", cfg.is_linear_layer(i), sparse, ids))
    return weights


def _layer(src: TensorSource, cfg: ModelConfig, ops, p: str, linear: bool, sparse: bool, ids) -> LayerWeights:
    """One decoder layer under prefix ``p``; a sparse one holds the experts ``ids``."""
    n = _dims(cfg)
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    N = lambda name, *shape: _norm_weight(src, cfg, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    if linear:
        mixer = dict(q=None, k=None, v=None, o=None, linear=_gated_delta_net(src, cfg, ops, f"{p}.linear_attn"))
    else:
        mixer = (_mla_attention if cfg.mla is not None else _attention)(src, cfg, ops, f"{p}.self_attn")
    lw = LayerWeights(
        input_norm=N(f"{p}.input_layernorm.weight", "D"),
        post_norm=N(f"{p}.post_attention_layernorm.weight", "D"),
        **mixer,
    )
    m = f"{p}.{cfg.moe_prefix}"
    if sparse:
        _load_moe(src, cfg, ops, lw, m, ids)
    else:
        lw.mlp_gate_up = _gate_up(src, ops, m, (n["Id"], n["D"]))
        lw.mlp_down = W(f"{m}.down_proj.weight", "D", "Id")
    return lw


def load_mtp_weights(src: TensorSource, cfg: ModelConfig, ops, weights: ModelWeights) -> MtpWeights:
    """The first multi-token prediction layer, ``model.layers.{num_hidden_layers}``: its experts are
    this rank's range of the main model's (``weights.expert_start..end``); its embedding, when the
    checkpoint leaves it out, is the main model's."""
    if cfg.fp8 is not None and not isinstance(src, Fp8Source):
        src = Fp8Source(src, cfg.fp8)
    n, p = _dims(cfg), f"model.layers.{cfg.num_layers}"
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    N = lambda name, *shape: _norm_weight(src, cfg, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    own_embed = f"{p}.embed_tokens.weight"
    return MtpWeights(
        enorm=N(f"{p}.enorm.weight", "D"),
        hnorm=N(f"{p}.hnorm.weight", "D"),
        eh_proj=W(f"{p}.eh_proj.weight", "D", "2D"),
        layer=_layer(src, cfg, ops, p, False, True, range(weights.expert_start, weights.expert_end)),
        head_norm=N(f"{p}.shared_head.norm.weight", "D"),
        head=W(f"{p}.shared_head.head.weight", "V", "D"),
        embed=ops.weight(_host(src, own_embed, (n["V"], n["D"]))) if own_embed in src else weights.embed,
    )


def _attention(src: TensorSource, cfg: ModelConfig, ops, a: str) -> dict:
    """Grouped-query attention: q/k/v/o, optional biases and q/k norms."""
    n = _dims(cfg)
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    out: dict = {}
    if cfg.attention_output_gate:  # rows per head: query (Dh) | gate (Dh)
        both = _host(src, f"{a}.q_proj.weight", (n["2Q"], n["D"])).reshape(cfg.num_heads, 2, cfg.head_dim, -1)
        out.update(
            q=ops.linear_weight(np.ascontiguousarray(both[:, 0].reshape(-1, both.shape[-1]))),
            q_gate=ops.linear_weight(np.ascontiguousarray(both[:, 1].reshape(-1, both.shape[-1]))),
        )
        out.update(k=W(f"{a}.k_proj.weight", "KV", "D"), v=W(f"{a}.v_proj.weight", "KV", "D"))
    else:
        out.update(_fused_qkv(src, cfg, ops, a))
    out.update(o=W(f"{a}.o_proj.weight", "D", "Q"), **gptoss_weights.attention_extras(src, cfg, ops, a))
    if cfg.qkv_bias and "qkv" in out:
        host = [_host(src, f"{a}.{p}_proj.bias", (n[d],)) for p, d in (("q", "Q"), ("k", "KV"), ("v", "KV"))]
        out.update(qkv_bias=ops.weight(np.concatenate(_same_dtype(*host))))
    elif cfg.qkv_bias:
        out.update(
            q_bias=W(f"{a}.q_proj.bias", "Q"), k_bias=W(f"{a}.k_proj.bias", "KV"), v_bias=W(f"{a}.v_proj.bias", "KV")
        )
    if cfg.qk_norm:
        norm_dims = ("Dh", "Dh") if cfg.qk_norm == "head" else ("Q", "KV")
        out.update(
            q_norm=_norm_weight(src, cfg, ops, f"{a}.q_norm.weight", (n[norm_dims[0]],)),
            k_norm=_norm_weight(src, cfg, ops, f"{a}.k_norm.weight", (n[norm_dims[1]],)),
        )
    return out


def _f32(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)


def _norm_weight(src: TensorSource, cfg: ModelConfig, ops, name: str, expected: tuple):
    """An RMSNorm weight; with ``norm_unit_offset`` (Qwen3-Next's ``x * (1 + w)``) the 1 is added here in float32."""
    w = _host(src, name, expected)
    return ops.weight(_f32(w) + np.float32(1.0)) if cfg.norm_unit_offset else ops.weight(w)


def _gated_delta_net(src: TensorSource, cfg: ModelConfig, ops, a: str) -> GatedDeltaNetWeights:
    """A Gated DeltaNet layer. in_proj_qkvz holds per key head [q (dk) | k (dk) | v (r*dv) | z (r*dv)] rows
    and in_proj_ba [b (r) | a (r)] (r = Hv / Hk); both are regrouped so each part is contiguous."""
    n, la = _dims(cfg), cfg.linear_attention
    W = lambda name, *shape: ops.weight(_host(src, name, tuple(n[d] for d in shape)))  # noqa: E731
    Hk, dk, r, dv = la.num_key_heads, la.key_head_dim, la.num_value_heads // la.num_key_heads, la.value_head_dim
    qkvz = _host(src, f"{a}.in_proj_qkvz.weight", (n["QKVZ"], n["D"])).reshape(Hk, 2 * dk + 2 * r * dv, -1)
    cuts = np.cumsum([dk, dk, r * dv])
    qkvz = np.concatenate([p.reshape(-1, qkvz.shape[-1]) for p in np.split(qkvz, cuts, axis=1)], axis=0)
    ba = _host(src, f"{a}.in_proj_ba.weight", (n["BA"], n["D"])).reshape(Hk, 2 * r, -1)
    ba = np.concatenate([ba[:, :r].reshape(-1, ba.shape[-1]), ba[:, r:].reshape(-1, ba.shape[-1])], axis=0)
    conv = _host(src, f"{a}.conv1d.weight", (n["Cv"], n["1"], n["Kc"]))
    return GatedDeltaNetWeights(
        in_proj=ops.linear_weight(np.ascontiguousarray(qkvz)),
        in_proj_ba=ops.linear_weight(np.ascontiguousarray(ba)),
        conv=ops.weight(np.ascontiguousarray(conv[:, 0, :])),
        a_log=ops.weight(_f32(_host(src, f"{a}.A_log", (n["Hv"],)))),
        dt_bias=ops.weight(_f32(_host(src, f"{a}.dt_bias", (n["Hv"],)))),
        norm=W(f"{a}.norm.weight", "dv"),
        out=ops.linear_weight(_host(src, f"{a}.out_proj.weight", (n["D"], n["HVdv"]))),
    )


def _deinterleave(rows: np.ndarray, start: int, width: int, period: int) -> np.ndarray:
    """Permute output rows [start, start+width) of every ``period`` rows from interleaved pairs
    (x0, x1), (x2, x3), ... to halves (x0, x2, ..) | (x1, x3, ..): rotate-half RoPE on the permuted
    projection equals DeepSeek's pairwise RoPE (the q.k products are unchanged)."""
    order = np.arange(rows.shape[0]).reshape(-1, period)
    part = order[:, start : start + width]
    order[:, start : start + width] = np.concatenate([part[:, 0::2], part[:, 1::2]], axis=1)
    return np.ascontiguousarray(rows[order.reshape(-1)])


def _fused_qkv(src: TensorSource, cfg: ModelConfig, ops, a: str) -> dict:
    """q, k and v as one matrix ``qkv`` [Q + 2 KV, D] (q, k, v None), or apart where one is FP8-resident."""
    n = _dims(cfg)
    named = [(f"{a}.{p}_proj.weight", (n[d], n["D"])) for p, d in (("q", "Q"), ("k", "KV"), ("v", "KV"))]
    fp8 = [_resident_fp8(src, ops, [name], shape) for name, shape in named]
    if any(w is not None for w in fp8):
        return dict(zip("qkv", (w if w is not None else _weight(src, ops, *nd) for w, nd in zip(fp8, named))))
    host = _same_dtype(*(_host(src, name, shape) for name, shape in named))
    return dict(q=None, k=None, v=None, qkv=ops.linear_weight(np.concatenate(host)))


def _mla_attention(src: TensorSource, cfg: ModelConfig, ops, a: str) -> dict:
    """MLA: q (direct or low-rank with its norm), kv_a with its norm, kv_b split into W_UK/W_UV, o.
    With a q LoRA, q_a and kv_a are one matrix ``qkv_a`` (one product, as vLLM's fused_qkv_a_proj),
    unless q_a stays FP8-resident."""
    n, m, H = _dims(cfg), cfg.mla, cfg.num_heads
    Dn, R, C = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    out: dict = dict(k=None, v=None, o=W(f"{a}.o_proj.weight", "D", "HV"))
    kv_a = _host(src, f"{a}.kv_a_proj_with_mqa.weight", (n["C+R"], n["D"]))
    if m.rope_interleave:
        kv_a = _deinterleave(kv_a, C, R, C + R)
    if m.q_lora_rank:
        out.update(_mla_q_a(src, ops, a, n, kv_a), q_a_norm=W(f"{a}.q_a_layernorm.weight", "Qr"))
        q = _host(src, f"{a}.q_b_proj.weight", (n["HQ"], n["Qr"]))
    else:
        out.update(kv_a=ops.linear_weight(kv_a))
        q = _host(src, f"{a}.q_proj.weight", (n["HQ"], n["D"]))
    if m.rope_interleave:
        q = _deinterleave(q, Dn, R, Dn + R)
    kv_b = _same_dtype(_host(src, f"{a}.kv_b_proj.weight", (n["HKV"], n["C"])))[0]
    kv_b = kv_b.reshape(H, Dn + m.v_head_dim, C)  # [H, Dn+Dv, C]
    out.update(
        q=ops.linear_weight(q),
        kv_a_norm=W(f"{a}.kv_a_layernorm.weight", "C"),
        w_uk=ops.weight(np.ascontiguousarray(kv_b[:, :Dn, :].transpose(0, 2, 1))),  # [H, C, Dn]
        w_uv=ops.weight(np.ascontiguousarray(kv_b[:, Dn:, :])),  # [H, Dv, C]
    )
    return out


def _mla_q_a(src: TensorSource, ops, a: str, n: dict, kv_a: np.ndarray) -> dict:
    """q_a and kv_a [C+R, D] (host, de-interleaved) as ``qkv_a`` [Qr + C+R, D], or apart where q_a is
    FP8-resident or the backend keeps products apart (``ops.joins_mla_products``)."""
    name = f"{a}.q_a_proj.weight"
    fp8 = _resident_fp8(src, ops, [name], (n["Qr"], n["D"]))
    if fp8 is not None or not ops.joins_mla_products:
        q_a = fp8 if fp8 is not None else _weight(src, ops, name, (n["Qr"], n["D"]))
        return dict(q_a=q_a, kv_a=ops.linear_weight(kv_a))
    return dict(qkv_a=ops.linear_weight(np.concatenate(_same_dtype(_host(src, name, (n["Qr"], n["D"])), kv_a))))


def load_expert_stack(src: TensorSource, cfg: ModelConfig, ops, layer: int, ids: Sequence[int]) -> tuple:
    """The ``ops`` arrays (gate_up [El, 2I, D], down [El, D, I]) of layer ``layer``'s experts ``ids``:
    what an EPLB rebalance reads of the experts a rank newly holds."""
    if cfg.fp8 is not None and not isinstance(src, Fp8Source):
        src = Fp8Source(src, cfg.fp8)
    m = f"model.layers.{layer}.{cfg.moe_prefix}"
    fp8 = _resident_fp8_experts(src, cfg, ops, m, ids)
    if fp8 is not None:
        return fp8
    return ops.expert_weights(*_experts(src, cfg, m, ids))


def _load_moe(src: TensorSource, cfg: ModelConfig, ops, lw: LayerWeights, m: str, ids: Sequence[int]) -> None:
    """Router (and its score bias), this rank's experts ``ids``, the shared expert(s)."""
    n = _dims(cfg)
    W = lambda name, *shape: _weight(src, ops, name, tuple(n[d] for d in shape))  # noqa: E731
    if cfg.swiglu is not None:  # gpt_oss: a router with a bias, experts with biases (gptoss_weights.py)
        lw.router, lw.router_logit_bias = W(f"{m}.router.weight", "E", "D"), W(f"{m}.router.bias", "E")
        lw.w_gate_up, lw.w_down = gptoss_weights.experts(src, cfg, ops, m, ids)
        lw.b_gate_up, lw.b_down = gptoss_weights.expert_biases(src, cfg, ops, m, ids)
        return
    lw.router = W(f"{m}.gate.weight", "E", "D")
    if cfg.router_bias:
        bias = _host(src, f"{m}.gate.e_score_correction_bias", (n["E"],))
        bias = bf16_bits_to_f32(bias) if bias.dtype == np.uint16 else bias
        lw.router_bias = ops.xp.asarray(np.ascontiguousarray(bias, dtype=np.float32))  # float32 on every backend
    fp8 = _resident_fp8_experts(src, cfg, ops, m, ids)
    if fp8 is not None:
        lw.w_gate_up, lw.w_down = fp8
    else:
        lw.w_gate_up, lw.w_down = ops.expert_weights(*_experts(src, cfg, m, ids))
    if not cfg.has_shared_expert:
        return
    s = f"{m}.{cfg.shared_expert_prefix}"
    lw.shared_gate_up = _gate_up(src, ops, s, (n["Is"], n["D"]))
    lw.shared_down = W(f"{s}.down_proj.weight", "D", "Is")
    if cfg.shared_expert_gated:
        lw.shared_gate = W(f"{m}.shared_expert_gate.weight", "1", "D")


def _gate_up(src: TensorSource, ops, prefix: str, expected: tuple):
    """A dense MLP's (or shared expert's) gate and up projections stacked: [2I, D]."""
    names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
    fp8 = _resident_fp8(src, ops, names, expected)
    if fp8 is not None:
        return fp8
    g, u = _same_dtype(*(_host(src, name, expected) for name in names))
    return ops.linear_weight(np.concatenate([g, u], axis=0))


def _resident_fp8_experts(src: TensorSource, cfg: ModelConfig, ops, prefix: str, ids: Sequence[int]):
    """Experts ``ids`` as FP8 on a backend that keeps FP8: (gate_up [El, 2I, D] blocked per half,
    down [El, D, I]) with their scales; None when not FP8 (or fused / no local experts)."""
    if not (ops.fp8_resident and isinstance(src, Fp8Source)) or not ids or f"{prefix}.experts.gate_up_proj" in src:
        return None
    n, (g_name, u_name, d_name) = _dims(cfg), cfg.expert_names
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    if not (ops.keeps_fp8((2 * I, D), src.quant.block_k) and ops.keeps_fp8((D, I), src.quant.block_k)):
        return None
    gate_up, down = [], []
    for e in ids:
        base = f"{prefix}.experts.{e}"
        names = [f"{base}.{g_name}.weight", f"{base}.{u_name}.weight", f"{base}.{d_name}.weight"]
        shapes = [(n["I"], n["D"]), (n["I"], n["D"]), (n["D"], n["I"])]
        if any(name not in src for name in names):
            return None  # the dequantizing path names the missing tensor
        parts = [src.read_fp8(name) for name in names]
        if any(p is None for p in parts):
            return None
        for name, shape, (raw, scale) in zip(names, shapes, parts):
            _check_shape(name, raw, shape)
            _check_fp8_finite(name, raw, scale)
        gate_up.append([np.concatenate([parts[0][i], parts[1][i]]) for i in (0, 1)])
        down.append(parts[2])
    q = src.quant
    stacked = [np.stack([p[i] for p in gate_up]) for i in (0, 1)] + [np.stack([p[i] for p in down]) for i in (0, 1)]
    return (
        ops.weight_fp8(stacked[0], stacked[1], q.block_n, q.block_k, cfg.moe_intermediate_size),
        ops.weight_fp8(stacked[2], stacked[3], q.block_n, q.block_k, cfg.hidden_size),
    )
