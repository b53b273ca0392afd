"""The ops interface: every hot operation of the MoE forward pass.

The model code (``eprt/model``) is written once against this interface; the NumPy
backend (``numpy_ops.py``) is the reference and the CuPy backend (``cupy_ops.py``)
implements the same methods with raw CUDA kernels from ``kernels/*.cu``.

Shape legend used in every backend:
    T tokens in the call        B sequences in a decode batch
    D hidden size               V vocabulary size
    H query heads               Hk key/value heads (GQA: H % Hk == 0)
    Dh head dim                 E experts in the model, El experts on this rank
    I expert intermediate size  k experts per token (top-k)
    NB KV blocks in the pool    BS tokens per block    MB max blocks per sequence

Conventions:
    * Linear weights keep the Hugging Face layout ``[out, in]``: ``y = x @ w.T (+ b)``.
    * Expert weights are stacked per rank: ``w_gate_up[El, 2I, D]`` (rows ``[0, I)`` are
      the gate projection, ``[I, 2I)`` the up projection) and ``w_down[El, D, I]``.
    * KV cache of one layer: ``k_cache[NB, BS, Hk, Dh]`` and ``v_cache[NB, BS, Hk, Dh]``.
      Token position ``p`` of a sequence with block table ``bt`` lives at
      ``cache[bt[p // BS], p % BS]``; ``slot_mapping`` holds ``bt[p // BS] * BS + p % BS``.
    * RoPE is the "rotate half" (GPT-NeoX) form used by every supported architecture;
      ``cos_sin[P, Dh]`` holds ``cos`` in the first ``Dh/2`` columns and ``sin`` in the rest.
    * Index arrays are int32. Float activations are the backend's ``act_dtype``
      (float32 on the CPU; bfloat16 storage with float32 accumulation on the GPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray


class Ops:
    """Abstract backend. Methods return new arrays unless documented otherwise."""

    name = "abstract"
    xp: Any = None  # the array module (numpy or cupy)
    kv_itemsize = 4  # bytes per KV cache element (float32; the GPU backend stores bf16)

    # ---- data movement -------------------------------------------------------------
    def weight(self, host: np.ndarray) -> Array:
        """Upload a weight. ``host`` is float32, or uint16 holding raw bfloat16 bits."""
        raise NotImplementedError

    def activation(self, host: np.ndarray) -> Array:
        """Upload float32 host data as an activation of ``act_dtype``."""
        raise NotImplementedError

    def index(self, host) -> Array:
        """Upload an int32 index array."""
        raise NotImplementedError

    def to_host(self, a: Array) -> np.ndarray:
        """Download; float arrays come back as float32."""
        raise NotImplementedError

    def zeros(self, shape: tuple, dtype: str = "act") -> Array:
        """``dtype``: "act" (activations and KV), "f32" or "i32"."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the CPU)."""

    def warm_up(self) -> None:
        """Prepare everything the forward pass needs (the GPU backend compiles its kernels)."""

    # ---- compute -------------------------------------------------------------------
    def embedding(self, table: Array, ids: Array) -> Array:
        """table[V, D], ids[T] -> [T, D]"""
        raise NotImplementedError

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x[T, D], weight[D] -> [T, D]; also used per head (x[T*H, Dh])."""
        raise NotImplementedError

    def add_rms_norm(self, x: Array, residual: Array, weight: Array, eps: float):
        """Fused residual add: s = x + residual; returns (rms_norm(s), s), both [T, D]."""
        raise NotImplementedError

    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x[T, K], w[N, K], bias[N] -> [T, N] (float32 accumulation)."""
        raise NotImplementedError

    def rope(self, x: Array, positions: Array, cos_sin: Array) -> Array:
        """x[T, H, Dh], positions[T], cos_sin[P, Dh] -> rotated [T, H, Dh]."""
        raise NotImplementedError

    def kv_write(self, k_cache: Array, v_cache: Array, k: Array, v: Array, slot_mapping: Array) -> None:
        """In place: k/v[T, Hk, Dh] go to flat slots slot_mapping[T] of the caches; a negative
        slot marks a padding row that is not written."""
        raise NotImplementedError

    def attention_prefill(
        self, q: Array, k_cache: Array, v_cache: Array, block_table: Array, start_pos: int, scale: float
    ) -> Array:
        """One sequence, causal. q[T, H, Dh] are positions start_pos .. start_pos+T-1;
        query t attends to cache positions [0, start_pos + t] (already written).
        block_table[MB]. Returns [T, H, Dh]."""
        raise NotImplementedError

    def attention_decode(
        self, q: Array, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array, scale: float
    ) -> Array:
        """Batched decode, one query per sequence. q[B, H, Dh], block_tables[B, MB],
        context_lens[B] >= 1 (the new token's KV already written, so it is included).
        Returns [B, H, Dh]."""
        raise NotImplementedError

    def router(self, logits: Array, top_k: int, renormalize: bool):
        """logits[T, E] -> (weights[T, k] float32, ids[T, k] int32): softmax in float32
        over all E experts, the k largest (ties to the lower id), optionally renormalized
        to sum to 1."""
        raise NotImplementedError

    def silu_and_mul(self, x: Array) -> Array:
        """x[T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]"""
        raise NotImplementedError

    def clip(self, x: Array, limit: float) -> Array:
        """Element-wise clamp to [-limit, limit] (OLMoE's clip_qkv). Same shape as x."""
        raise NotImplementedError

    def sigmoid_gate_add(self, out: Array, s: Array, gate: Array) -> Array:
        """out[T, D] (float32) + sigmoid(gate[T, 1]) * s[T, D]: Qwen2-MoE's gated shared expert."""
        raise NotImplementedError

    def moe_experts(
        self, x: Array, weights: Array, ids: Array, w_gate_up: Array, w_down: Array, expert_start: int
    ) -> Array:
        """This rank's share of a MoE layer. x[T, D], weights/ids[T, k], w_gate_up[El, 2I, D],
        w_down[El, D, I]. Local expert e is global expert expert_start + e. Returns [T, D]
        (float32 accumulation): sum over (t, j) with ids[t, j] local of
        weights[t, j] * down_e(silu_and_mul(gate_up_e(x[t]))); zero rows where no local
        expert was chosen. Summing this over all ranks gives the MoE output."""
        raise NotImplementedError

    def argmax(self, logits: Array) -> np.ndarray:
        """logits[B, V] -> host int64[B] (first maximum wins)."""
        raise NotImplementedError
