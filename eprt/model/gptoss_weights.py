"""gpt-oss's tensors beside the common ones (``weights.py``): attention sinks and the o_proj bias, the
router's bias, and the experts with their biases, bf16/float32 or MXFP4.

The checkpoint stores the experts fused: ``experts.gate_up_proj`` [E, D, 2I] (input-major, gate and
up interleaved column by column: gate j is column 2j, up j column 2j + 1), ``experts.down_proj``
[E, I, D], ``experts.gate_up_proj_bias`` [E, 2I], ``experts.down_proj_bias`` [E, D]; MXFP4 checkpoints
hold ``experts.gate_up_proj_blocks`` [E, 2I, D / 32, 16] and ``_scales`` [E, 2I, D / 32] (output-major,
rows interleaved likewise) and the same for ``down_proj`` [E, D, I / 32, ..]. They are read for the
experts ``ids`` only, into eprt's stacks ``w_gate_up[El, 2I, D]`` (gate rows, then up rows) and
``w_down[El, D, I]``; MXFP4 stays MXFP4 (its rows permuted, nothing dequantized).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.safetensors_io import CheckpointError
from eprt.ops.bf16 import bf16_bits_to_f32
from eprt.ops.gptoss_ops import MXFP4_BLOCK

E8M0_NAN = 255  # the e8m0 scale that encodes NaN


def _f32(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)


def _deinterleave(a: np.ndarray, axis: int) -> np.ndarray:
    """Along ``axis`` of size 2I: the even entries (gate) then the odd ones (up)."""
    even = np.take(a, np.arange(0, a.shape[axis], 2), axis=axis)
    odd = np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)
    return np.ascontiguousarray(np.concatenate([even, odd], axis=axis))


def _rows(src, name: str, ids: Sequence[int], shape: tuple) -> np.ndarray:
    """Rows ``ids`` of the tensor ``name`` whose shape must be ``shape`` ((size, config field) pairs)."""
    if name not in src:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    a = src.read(name)
    want = tuple(size for size, _ in shape)
    if tuple(a.shape) != want:
        fields = ", ".join(f"{field}={size}" for size, field in shape if field)
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(a.shape)} but the config implies {want} ({fields}): "
            f"config.json does not describe these weights"
        )
    return np.ascontiguousarray(a[np.asarray(ids, dtype=np.int64)])


def _finite(name: str, a: np.ndarray) -> None:
    bad = int(np.count_nonzero((a & 0x7F80) == 0x7F80)) if a.dtype == np.uint16 else int((~np.isfinite(a)).sum())
    if bad:
        raise CheckpointError(f"tensor {name!r} holds {bad} NaN/Inf value(s) of {a.size}: the checkpoint is corrupt")


def expert_biases(src, cfg: ModelConfig, ops, prefix: str, ids: Sequence[int]) -> tuple:
    """(b_gate_up [El, 2I] gate | up, b_down [El, D]) float32 on the backend."""
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dims_gu = ((E, "num_local_experts"), (2 * I, "2*intermediate_size"))
    gu = _rows(src, f"{prefix}.experts.gate_up_proj_bias", ids, dims_gu)
    down = _rows(src, f"{prefix}.experts.down_proj_bias", ids, ((E, "num_local_experts"), (D, "hidden_size")))
    for name, a in (("gate_up_proj_bias", gu), ("down_proj_bias", down)):
        _finite(f"{prefix}.experts.{name}", a)
    xp = ops.xp
    return xp.asarray(_deinterleave(_f32(gu), 1)), xp.asarray(np.ascontiguousarray(_f32(down)))


def experts(src, cfg: ModelConfig, ops, prefix: str, ids: Sequence[int]) -> tuple:
    """(w_gate_up, w_down) of the experts ``ids``: MXFP4-resident when the checkpoint is MXFP4."""
    if cfg.mxfp4 is not None or f"{prefix}.experts.gate_up_proj_blocks" in src:
        return _mxfp4_experts(src, cfg, ops, prefix, ids)
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    e = (E, "num_local_experts")
    gu = _rows(src, f"{prefix}.experts.gate_up_proj", ids, (e, (D, "hidden_size"), (2 * I, "2*intermediate_size")))
    down = _rows(src, f"{prefix}.experts.down_proj", ids, (e, (I, "intermediate_size"), (D, "hidden_size")))
    for name, a in (("gate_up_proj", gu), ("down_proj", down)):
        _finite(f"{prefix}.experts.{name}", a)
    if gu.dtype in (np.float16, np.float64):
        gu, down = gu.astype(np.float32), down.astype(np.float32)
    gate_up = _deinterleave(gu.transpose(0, 2, 1), 1)  # [El, 2I, D]
    return ops.swiglu_expert_weights(gate_up, np.ascontiguousarray(down.transpose(0, 2, 1)))  # down [El, D, I]


def _mxfp4_experts(src, cfg: ModelConfig, ops, prefix: str, ids: Sequence[int]) -> tuple:
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for size, field in ((D, "hidden_size"), (I, "intermediate_size")):
        if size % MXFP4_BLOCK:
            raise CheckpointError(f"MXFP4 experts need {field} a multiple of {MXFP4_BLOCK}, got {size}")
    e, half = (E, "num_local_experts"), (MXFP4_BLOCK // 2, "")
    parts = []
    for proj, n, k in (("gate_up_proj", (2 * I, "2*intermediate_size"), D), ("down_proj", (D, "hidden_size"), I)):
        kb = (k // MXFP4_BLOCK, f"{'hidden_size' if k == D else 'intermediate_size'}/{MXFP4_BLOCK}")
        blocks = _rows(src, f"{prefix}.experts.{proj}_blocks", ids, (e, n, kb, half))
        scales = _rows(src, f"{prefix}.experts.{proj}_scales", ids, (e, n, kb))
        if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
            raise CheckpointError(
                f"MXFP4 tensors {prefix}.experts.{proj}_blocks/_scales must be U8, got {blocks.dtype}/{scales.dtype}"
            )
        nan = int(np.count_nonzero(scales == E8M0_NAN))
        if nan:
            raise CheckpointError(f"tensor {prefix}.experts.{proj}_scales holds {nan} NaN scale(s) (e8m0 255)")
        if proj == "gate_up_proj":
            blocks, scales = _deinterleave(blocks, 1), _deinterleave(scales, 1)
        parts += [blocks, scales]
    return ops.mxfp4_expert_weights(*parts)


def attention_extras(src, cfg: ModelConfig, ops, a: str) -> dict:
    """sinks [H] float32 and the o_proj bias [D]."""
    out: dict = {}
    if cfg.attention_sinks:
        sinks = _rows(src, f"{a}.sinks", range(cfg.num_heads), ((cfg.num_heads, "num_attention_heads"),))
        _finite(f"{a}.sinks", sinks)
        out["sinks"] = ops.xp.asarray(_f32(sinks))
    if cfg.o_bias:
        bias = _rows(src, f"{a}.o_proj.bias", range(cfg.hidden_size), ((cfg.hidden_size, "hidden_size"),))
        _finite(f"{a}.o_proj.bias", bias)
        out["o_bias"] = ops.weight(bias)
    return out
