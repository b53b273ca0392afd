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
    Is a shared expert's intermediate size (DeepSeek-V2's 2 shared experts: one MLP of 2 x I)
    NB KV blocks in the pool    BS tokens per block    MB max blocks per sequence
    L latent width per token (MLA: kv_lora_rank C + rope dims R)
    S recurrent-state slots     Hv / dk / dv linear-attention value heads, key / value head dims
    C conv channels (2*Hk*dk + Hv*dv)   K conv kernel width

Conventions:
    * Linear weights keep the Hugging Face layout ``[out, in]``: ``y = x @ w.T (+ b)``. A backend
      may store those only ``linear`` reads otherwise (``linear_weight``; NumpyOps' compiled path:
      panels ``[N / 16, K, 16]``).
    * Expert weights are stacked per rank: ``w_gate_up[El, 2I, D]`` (rows ``[0, I)`` are
      the gate projection, ``[I, 2I)`` the up projection) and ``w_down[El, D, I]``. A backend
      may store them otherwise (``expert_weights``; NumpyOps' compiled path: panels
      ``[El, N / 16, K, 16]``); only its own ops read them.
    * KV cache of one layer: ``k_cache[NB, BS, Hk, Dh]`` and ``v_cache[NB, BS, Hk, Dh]``.
      Token position ``p`` of a sequence with block table ``bt`` lives at
      ``cache[bt[p // BS], p % BS]``; ``slot_mapping`` holds ``bt[p // BS] * BS + p % BS``.
    * MLA (multi-head latent attention) caches one row per token and layer:
      ``latent_cache[NB, BS, L]`` = [normed latent (C) | roped key (R)]; a query ``[.., H, L]`` is
      [latent-space query (C) | roped query (R)], and the values are the latent part ``[:C]``.
    * RoPE is the "rotate half" (GPT-NeoX) form used by every supported architecture;
      ``cos_sin[P, Dh]`` holds ``cos`` in the first ``Dh/2`` columns and ``sin`` in the rest.
      (Interleaved-pair checkpoints, DeepSeek's, are permuted to this form at load.)
    * Linear attention (Gated DeltaNet) keeps per-sequence state in slots, float32 always:
      ``conv_state[S, K-1, C]`` (the last K-1 conv inputs, oldest first) and
      ``delta_state[S, Hv, dk, dv]``; the ops read and update the rows of the slots they are given.
    * Index arrays are int32. Float activations are the backend's ``act_dtype``
      (float32 on the CPU; bfloat16 storage with float32 accumulation on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray

ROUTING_SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-style expert selection (``Ops.router_grouped``). Experts split into ``n_group``
    contiguous groups; only the ``topk_group`` best groups compete for the top-k."""

    scoring: str  # "softmax" (deepseek_v2) or "sigmoid" (deepseek_v3, glm4_moe)
    n_group: int
    topk_group: int
    group_score: str  # "max" of a group's scores or "top2_sum" of its two best
    renormalize: bool  # chosen weights divided by their sum (+1e-20)
    scaling: float  # routed_scaling_factor, applied last

    def __post_init__(self):
        if self.scoring not in ROUTING_SCORINGS:
            raise ValueError(f"scoring must be one of {ROUTING_SCORINGS}, got {self.scoring!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")


@dataclass(frozen=True)
class Permutation:
    """This rank's (token, choice) slots s = t * k + j grouped by local expert (``Ops.route``,
    ``Ops.moe_experts``): local expert e owns sorted rows [offsets[e], offsets[e + 1]) (offsets
    [El + 1], offsets[El] = P), sorted_slot[p] is row p's slot (ascending within an expert; [P] used
    of its length), slot_pos[T * k] the row of each slot, -1 where its expert is not local."""

    offsets: Any
    sorted_slot: Any
    slot_pos: Any


@dataclass(frozen=True)
class DecodeLayer:
    """One layer's weights for ``Ops.decode_layer`` (``Ops.decode_layer_weights`` makes it): a layer
    whose attention is ``attention_decode_block``'s ops alone and whose MLP is this rank's routed
    experts alone, routed by ``route_rows`` without a logit bias, a selection bias or groups.
    ``compiled``: what a backend keeps to run the layer its own way (None: the ops one by one)."""

    input_norm: Any  # [D]
    qkv: Any  # [(H + 2 Hk) Dh, D] (``linear_weight``)
    o: Any  # [D, H Dh]
    norms: Any  # None or (q_norm [Dh], k_norm [Dh])
    post_norm: Any  # [D]
    router: Any  # [E, D]
    w_gate_up: Any  # [El, 2I, D] (``expert_weights``)
    w_down: Any  # [El, D, I]
    heads: int  # H
    eps: float  # the RMS norms' epsilon (input, q/k, post)
    scale: float  # attention's softmax scale
    top_k: int
    renormalize: bool  # the chosen experts' weights divided by their sum
    local: tuple  # (expert_start, El): this rank's experts
    compiled: Any = None


class Ops:
    """Abstract backend. Methods return new arrays unless documented otherwise."""

    name = "abstract"
    xp: Any = None  # the array module (numpy or cupy)
    kv_itemsize = 4  # bytes per KV cache element (float32; the GPU backend stores bf16)
    fp8_resident = False  # True: FP8 checkpoint weights stay FP8 in memory (weight_fp8); else dequantized at load
    # the loader stacks MLA's q_a and kv_a into one matrix (one product, LayerWeights.qkv_a); a backend
    # whose product bits depend on the matrix's row count keeps them apart
    joins_mla_products = True

    def moe_split_rows(self, w_gate_up) -> int:
        """EPLB splits an expert's rows over its replicas only in parts of at least this many rows of
        experts stored as ``w_gate_up`` (a backend whose row bits depend on the group keeps them whole)."""
        return 1

    # ---- data movement -------------------------------------------------------------
    def weight(self, host: np.ndarray) -> Array:
        """Upload a weight. ``host`` is float32, or uint16 holding raw bfloat16 bits."""
        raise NotImplementedError

    def weight_fp8(self, raw: np.ndarray, scale_inv: np.ndarray, block_n: int, block_k: int, part_rows: int):
        """Upload an FP8 block-scaled weight that stays FP8 (backends with ``fp8_resident``):
        raw[.., N, K] float8_e4m3fn bytes (uint8), scale_inv[.., (N / part_rows) * ceil(part_rows /
        block_n), ceil(K / block_k)] float32. Rows [i * part_rows, (i + 1) * part_rows) are blocked
        on their own (gate | up stacked). ``linear`` and ``moe_experts`` accept the result."""
        raise NotImplementedError

    def keeps_fp8(self, shape: tuple, block_k: int) -> bool:
        """Whether an FP8 matrix (or stack) of matrices ``shape`` [N, K] in k blocks of ``block_k``
        stays FP8 (``weight_fp8``); else the loader dequantizes it."""
        return self.fp8_resident

    def linear_weight(self, host: np.ndarray) -> Array:
        """Upload a matrix [N, K] that only ``linear`` reads, in the layout it reads fastest; the
        default is ``weight``'s."""
        return self.weight(host)

    def tied_head(self, embed: Array) -> Array:
        """The lm_head of a model whose head is its embedding table ``embed`` (``weight``'s [V, D]);
        the default is the table itself."""
        return embed

    def expert_weights(self, gate_up: np.ndarray, down: np.ndarray) -> tuple:
        """Upload one layer's expert stacks, host gate_up[El, 2I, D] and down[El, D, I] (as for
        ``weight``), in the layout ``moe_experts`` reads; the default is ``weight``'s."""
        return self.weight(gate_up), self.weight(down)

    def take_experts(self, gate_up: Array, down: Array, source: list) -> tuple:
        """The stacks of experts ``source`` (indices into gate_up / down, in that order), in
        ``expert_weights``' layout."""
        rows = self.index(np.asarray(source, np.int32))
        return self.xp.ascontiguousarray(gate_up[rows]), self.xp.ascontiguousarray(down[rows])

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

    def bind_thread(self) -> None:
        """Make the calling thread compute on this backend's device (a thread that launches GPU
        work calls it first: CUDA's current device is per thread; no-op on the CPU)."""

    def warm_up(self) -> None:
        """Prepare everything the forward pass needs (the GPU backend compiles its kernels)."""

    def describe(self) -> str:
        """Implementation choices made at start-up that change the arithmetic ("" if none)."""
        return ""

    # ---- compute -------------------------------------------------------------------
    def embedding(self, table: Array, ids: Array) -> Array:
        """table[V, D], ids[T] -> [T, D]"""
        raise NotImplementedError

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x[T, D], weight[D] -> [T, D]; also used per head (x[T*H, Dh])."""
        raise NotImplementedError

    def add_rms_norm(self, x: Array, residual: Array, weight: Array, eps: float, extra: Array | None = None):
        """Fused residual add: s = x + residual; returns (rms_norm(s), s), both [T, D]. ``extra``
        [T, D] (a shared expert's output): s = add(x, extra) + residual, the add as ``add`` does it."""
        raise NotImplementedError

    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x[T, K], w[N, K], bias[N] -> [T, N] (float32 accumulation)."""
        raise NotImplementedError

    def rms_norm_linear(self, x: Array, norm: Array, eps: float, w: Array) -> Array:
        """linear(rms_norm(x, norm, eps), w): x[T, K] (rows may be spaced: a column slice of a larger
        product), norm[K], w[N, K] -> [T, N]. MLA's q LoRA (q_a's norm, then q_b); the GPU runs it as
        one launch at decode's row counts."""
        raise NotImplementedError

    def rope(self, x: Array, positions: Array, cos_sin: Array) -> Array:
        """x[T, H, Dh], positions[T], cos_sin[P, Dh] -> rotated [T, H, Dh]."""
        raise NotImplementedError

    def kv_write(self, k_cache: Array, v_cache: Array, k: Array, v: Array, slot_mapping: Array) -> None:
        """In place: k/v[T, Hk, Dh] go to flat slots slot_mapping[T] of the caches; a negative
        slot marks a padding row that is not written."""
        raise NotImplementedError

    def qk_rope_kv_write(self, q, k, v, norms, eps: float, positions, cos_sin, k_cache, v_cache, slot_mapping):
        """The attention prologue: q[T, H, Dh], k/v[T, Hk, Dh] (row views of one product allowed);
        ``norms`` None or (q_norm[Dh], k_norm[Dh]): each head RMS-normed first (Qwen3's q/k norm);
        q and k rotated over the first R columns of each head (cos_sin[P, R], R <= Dh: partial
        rotary keeps the rest); k and v written to the caches as ``kv_write`` does. Returns the
        rotated q [T, H, Dh]. Exactly rms_norm, rope and kv_write in that order."""
        raise NotImplementedError

    def attention_decode_block(
        self, x, qkv, o, heads: int, norms, eps: float, positions, cos_sin, k_cache, v_cache, slots, tables, lens, scale
    ) -> Array:
        """A decode step's attention of x[T, D] with fused q, k and v weights qkv[(H + 2 Hk) Dh, D] (no
        bias), ``heads`` = H: ``linear`` into [T, Q + 2KV], q, k and v its row views [T, H|Hk, Dh],
        ``qk_rope_kv_write`` (norms, eps, positions, cos_sin, the caches, slots), ``attention_decode``
        (tables, lens, scale), then ``linear`` through o[D, H Dh]. Returns [T, D]. Exactly those ops
        (a backend may run them as one call)."""
        T, Hk, Dh = x.shape[0], k_cache.shape[-2], k_cache.shape[-1]
        y = self.linear(x, qkv)  # [T, Q + 2KV]
        nq, nk = heads * Dh, Hk * Dh
        q, k, v = (y[:, a:b].reshape(T, -1, Dh) for a, b in ((0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk)))
        q = self.qk_rope_kv_write(q, k, v, norms, eps, positions, cos_sin, k_cache, v_cache, slots)
        return self.linear(self.attention_decode(q, k_cache, v_cache, tables, lens, scale).reshape(T, -1), o)

    def decode_layer_weights(self, *weights, **constants) -> DecodeLayer:
        """``DecodeLayer``(*weights, **constants) of weights this backend holds (a backend may note in
        its ``compiled`` field how it runs the layer)."""
        return DecodeLayer(*weights, **constants)

    def decode_layer(self, h, residual, layer: DecodeLayer, k_cache, v_cache, meta: tuple, counts):
        """One decode layer (``DecodeLayer``) over h[T, D], the last layer's output summed over the
        ranks (layer 0: the embeddings, ``residual`` None): ``add_rms_norm`` of h and the residual
        (layer 0: ``rms_norm`` of h, the residual h) with input_norm, ``attention_decode_block``
        (meta = (positions, cos_sin, slots, tables, lens), this layer's caches), ``add_rms_norm`` of
        its output and the residual with post_norm, ``route_rows`` (counting into counts[E] when
        given), ``moe_experts``. Returns (this rank's MoE partial [T, D], the residual [T, D]).
        Exactly those ops (a backend may run them as fewer calls)."""
        L, (positions, cos_sin, slots, tables, lens) = layer, meta
        if residual is None:
            x, residual = self.rms_norm(h, L.input_norm, L.eps), h
        else:
            x, residual = self.add_rms_norm(h, residual, L.input_norm, L.eps)
        cache = (positions, cos_sin, k_cache, v_cache, slots, tables, lens, L.scale)
        a = self.attention_decode_block(x, L.qkv, L.o, L.heads, L.norms, L.eps, *cache)  # [T, D]
        x, residual = self.add_rms_norm(a, residual, L.post_norm, L.eps)
        weights, ids, perm = self.route_rows(x, L.router, None, L.top_k, L.renormalize, None, counts, L.local)
        return self.moe_experts(x, weights, ids, L.w_gate_up, L.w_down, L.local[0], perm), residual

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

    def attention_verify(
        self,
        q: Array,
        k_cache: Array,
        v_cache: Array,
        block_tables: Array,
        context_lens: Array,
        query_lens: np.ndarray,
        scale: float,
    ) -> Array:
        """A verify step (speculative decoding): B sequences of query_lens[B] (host) consecutive
        new positions each, N = sum(query_lens) rows in q[N, H, Dh], a sequence's rows together.
        Row n attends like a decode row: block_tables[N, MB], context_lens[N] >= 1 (its KV and
        that of the positions before it written). Returns [N, H, Dh]. By default one decode row
        per position; a backend may gather each sequence's KV once for its rows."""
        return self.attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)

    def router(self, logits: Array, top_k: int, renormalize: bool):
        """logits[T, E] -> (weights[T, k] float32, ids[T, k] int32): softmax in float32
        over all E experts, the k largest (ties to the lower id), optionally renormalized
        to sum to 1."""
        raise NotImplementedError

    def router_grouped(self, logits: Array, bias: Array | None, top_k: int, routing: GroupedRouting):
        """logits[T, E], bias[E] (e_score_correction_bias) or None -> (weights[T, k] float32,
        ids[T, k] int32). scores = softmax or sigmoid of logits in float32; choice = scores + bias;
        a group's score is the max (or sum of the two largest) of its choice values; experts of
        all but the ``topk_group`` best groups are excluded; ids = the k largest remaining choice
        values (ties to the lower id); weights = their scores (not choice), renormalized if asked,
        times ``routing.scaling``."""
        raise NotImplementedError

    def route(self, logits: Array, top_k: int, routing, bias: Array | None, counts: Array | None, local):
        """A MoE layer's routing: ``router`` (``routing`` a bool: renormalize) or ``router_grouped``
        (``routing`` a GroupedRouting, ``bias`` its bias), then ``count_experts`` into counts[E] when
        given, then, when ``local`` = (expert_start, El) is given, the permutation of the slots to this
        rank's El experts for ``moe_experts``. Returns (weights[T, k], ids[T, k], a Permutation or
        None: a backend may leave the permutation to ``moe_experts``). The GPU does it all in one launch
        at decode's token counts (issue 39's launch budget)."""
        raise NotImplementedError

    def route_rows(self, x: Array, router: Array, logit_bias, top_k: int, routing, bias, counts, local):
        """``route`` of the router's logits linear(x, router, logit_bias) [T, E] over x[T, D]. Exactly
        those two ops (a backend may run the product with the routing)."""
        return self.route(self.linear(x, router, logit_bias), top_k, routing, bias, counts, local)

    def add(self, x: Array, y: Array) -> Array:
        """x[T, D] + y[T, D] (float32 accumulation): an ungated shared expert's output."""
        raise NotImplementedError

    def rank_sum(self, parts: Array) -> Array:
        """parts[P, T, D] float32 (every rank's MoE partial) -> [T, D] float32: parts[0] + parts[1] +
        ... added left to right in rank order, as the host combine sums (the same bits on every rank)."""
        raise NotImplementedError

    def head_linear(self, x: Array, w: Array) -> Array:
        """Per-head matmul: x[T, H, K], w[H, N, K] -> [T, H, N] with y[t, h] = w[h] @ x[t, h]
        (MLA's absorbed key and value up-projections)."""
        raise NotImplementedError

    def mla_prologue(self, q, compressed, kv_a_norm, eps: float, positions, cos_sin, w_uk, latent_cache, slot_mapping):
        """MLA's attention prologue: q[T, H, Dn + R] (the q product), compressed[T, C + R] (kv_a's; rows
        may be spaced: a column slice of the q_a | kv_a product), kv_a_norm[C], cos_sin[P, R],
        w_uk[H, C, Dn]. Writes the cache row [rms_norm(compressed[:, :C]) | rope(compressed[:, C:])] at
        slot_mapping[T] as ``latent_write`` does and returns the query [T, H, C + R] =
        [head_linear(q[.., :Dn], w_uk) | rope(q[.., Dn:])]. Exactly those ops; the GPU runs them as one
        launch at decode's row counts (w_uk's product on CUDA cores)."""
        raise NotImplementedError

    def latent_write(self, latent_cache: Array, x: Array, slot_mapping: Array) -> None:
        """In place: x[T, L] goes to flat slots slot_mapping[T] of latent_cache[NB, BS, L];
        a negative slot marks a padding row that is not written."""
        raise NotImplementedError

    def mla_attention_prefill(
        self, q: Array, latent_cache: Array, block_table: Array, start_pos: int, scale: float, value_dim: int
    ) -> Array:
        """One sequence, causal, in the latent space. q[T, H, L] are positions start_pos ..
        start_pos+T-1; query t attends to cache positions [0, start_pos + t] (already written),
        keys the whole rows [L], values their first ``value_dim`` (C) columns. block_table[MB].
        Returns [T, H, C]."""
        raise NotImplementedError

    def mla_attention_decode(
        self,
        q: Array,
        latent_cache: Array,
        block_tables: Array,
        context_lens: Array,
        scale: float,
        value_dim: int,
        w_uv: Array | None = None,
    ) -> Array:
        """Batched decode in the latent space, one query per sequence. q[B, H, L],
        block_tables[B, MB], context_lens[B] >= 1 (new token included). Returns [B, H, C]; with
        w_uv[H, Dv, C] (MLA's value up-projection) head_linear(that, w_uv) [B, H, Dv], which the GPU
        runs inside the attention launches at decode's row counts."""
        raise NotImplementedError

    def mla_attention_verify(
        self,
        q: Array,
        latent_cache: Array,
        block_tables: Array,
        context_lens: Array,
        query_lens: np.ndarray,
        scale: float,
        value_dim: int,
        w_uv: Array | None = None,
    ) -> Array:
        """attention_verify in the latent space: q[N, H, L], rows as in attention_verify.
        Returns [N, H, C], or with w_uv [N, H, Dv] as mla_attention_decode."""
        return self.mla_attention_decode(q, latent_cache, block_tables, context_lens, scale, value_dim, w_uv)

    def silu_and_mul(self, x: Array) -> Array:
        """x[T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]"""
        raise NotImplementedError

    def gate_up_silu(self, x: Array, w: Array) -> Array:
        """A dense MLP's (or shared expert's) first half: silu_and_mul(linear(x, w)), x[T, D],
        w[2I, D] -> [T, I]; the GPU runs it as one launch at decode's row counts."""
        raise NotImplementedError

    def add_rms_norm_gate_up_silu(self, x: Array, residual: Array, weight: Array, eps: float, w_gate_up: Array):
        """A dense MLP's post-attention norm and first half: (gate_up_silu(n, w_gate_up) [T, I], s [T, D])
        with (n, s) = add_rms_norm(x, residual, weight, eps); x, residual [T, D], w_gate_up [2I, D].
        Exactly those ops (this default); the GPU runs it as one launch at decode's row counts."""
        n, s = self.add_rms_norm(x, residual, weight, eps)
        return self.gate_up_silu(n, w_gate_up), s

    def clip(self, x: Array, limit: float) -> Array:
        """Element-wise clamp to [-limit, limit] (OLMoE's clip_qkv). Same shape as x."""
        raise NotImplementedError

    def sigmoid_gate_add(self, out: Array, s: Array, gate: Array) -> Array:
        """out[T, D] (float32) + sigmoid(gate[T, 1]) * s[T, D]: Qwen2-MoE's gated shared expert."""
        raise NotImplementedError

    def count_experts(self, ids: Array, counts: Array) -> None:
        """Expert-load statistics, in place: counts[E] int32 += how often each expert id occurs
        in ids[T, k]; ids outside [0, E) are not counted."""
        raise NotImplementedError

    def moe_experts(
        self, x: Array, weights: Array, ids: Array, w_gate_up: Array, w_down: Array, expert_start: int, perm=None
    ) -> Array:
        """This rank's share of a MoE layer. x[T, D], weights/ids[T, k], w_gate_up[El, 2I, D],
        w_down[El, D, I]. Local expert e is global expert expert_start + e. ``perm``: the slots'
        Permutation to these experts from ``route``, or None (the backend permutes). Returns [T, D]
        (float32 accumulation): sum over (t, j) with ids[t, j] local of
        weights[t, j] * down_e(silu_and_mul(gate_up_e(x[t]))); zero rows where no local
        expert was chosen. Summing this over all ranks gives the MoE output."""
        raise NotImplementedError

    def moe_experts_shared(
        self, x, weights, ids, w_gate_up, w_down, expert_start: int, perm, shared_gate_up, shared_down
    ):
        """``moe_experts`` and an ungated shared expert over every row, returned apart: (the experts'
        [T, D] float32, linear(gate_up_silu(x, shared_gate_up), shared_down) [T, D] of x's dtype) with
        shared_gate_up [2Is, D], shared_down [D, Is]. Exactly those ops (this default); the GPU runs the
        shared expert's products inside the experts' launches at decode's row counts."""
        out = self.moe_experts(x, weights, ids, w_gate_up, w_down, expert_start, perm)
        return out, self.linear(self.gate_up_silu(x, shared_gate_up), shared_down)

    # ---- gpt-oss (eprt/ops/gptoss_ops.py, the NumPy reference) ------------------------------------
    def mxfp4_expert_weights(self, gate_up_blocks, gate_up_scales, down_blocks, down_scales) -> tuple:
        """Upload one layer's MXFP4 expert stacks, kept MXFP4: gate_up_blocks[El, 2I, D / 32, 16] uint8
        (two e2m1 values a byte, the low nibble first), gate_up_scales[El, 2I, D / 32] uint8 (e8m0:
        2^(s - 127) per 32 weights), down_blocks[El, D, I / 32, 16], down_scales[El, D, I / 32]. Returns
        (w_gate_up, w_down) as ``moe_experts_swiglu`` reads them (``gptoss_ops.Mxfp4Weight``)."""
        raise NotImplementedError

    def swiglu_expert_weights(self, gate_up: np.ndarray, down: np.ndarray) -> tuple:
        """Upload one layer's bf16/float32 expert stacks gate_up[El, 2I, D], down[El, D, I] (as for
        ``weight``) in the layout ``moe_experts_swiglu`` reads."""
        raise NotImplementedError

    def attention_sinks_prefill(
        self, q: Array, k_cache: Array, v_cache: Array, block_table: Array, start_pos: int, scale: float, sinks, window
    ) -> Array:
        """``attention_prefill`` with a sink per query head, sinks[H] float32: a logit in the softmax's
        denominator only (p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sinks[h] - m))). ``window`` > 0:
        query t reads only keys in (start_pos + t - window, start_pos + t] (the block table's entries
        before them may be stale); 0: every key before it. Returns [T, H, Dh]."""
        raise NotImplementedError

    def attention_sinks_decode(
        self, q: Array, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array, scale, sinks, window
    ) -> Array:
        """``attention_decode`` with sinks[H] and ``window`` as in ``attention_sinks_prefill``: row b
        reads keys [max(0, context_lens[b] - window), context_lens[b]). Returns [B, H, Dh]."""
        raise NotImplementedError

    def attention_sinks_verify(
        self, q, k_cache, v_cache, block_tables, context_lens, query_lens: np.ndarray, scale: float, sinks, window
    ) -> Array:
        """``attention_verify`` with sinks and ``window``; by default one decode row per position."""
        return self.attention_sinks_decode(q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window)

    def router_topk_softmax(self, logits: Array, top_k: int):
        """gpt-oss's router: logits[T, E] -> (weights[T, k] float32, ids[T, k] int32): the k largest
        logits (ties to the lower id), softmax over those k in float32."""
        raise NotImplementedError

    def moe_experts_swiglu(
        self, x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, expert_start: int, alpha: float, limit: float
    ) -> Array:
        """``moe_experts`` with gpt-oss's experts: h = gate_up_e(x[t]) + b_gate_up[e] ([2I]: gate | up),
        a = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), and
        down_e(a) + b_down[e]; b_gate_up[El, 2I], b_down[El, D] float32; w_gate_up / w_down from
        ``swiglu_expert_weights`` or ``mxfp4_expert_weights`` (dequantized inside). Returns [T, D] float32."""
        raise NotImplementedError

    # ---- multi-LoRA (eprt/ops/lora_ops.py: LoraRows, the NumPy reference) --------------------------
    def lora_apply(self, y: Array, x: Array, a: Array, b: Array, rows) -> Array:
        """In place and returned: y[T, N] += (x[t] @ a[s].T) @ b[s] for each row t whose adapter slot
        rows.slots[t] = s >= 0; x[T, K], a[S, R, K], b[S, R, N] float32 (B transposed, rank zero-padded)."""
        raise NotImplementedError

    def moe_experts_lora(self, x, weights, ids, w_gate_up, w_down, expert_start, rows, gate_up, down) -> Array:
        """``moe_experts`` where token t's expert projections also carry its adapter slot's delta:
        gate_up = (a[S, El, R, D], b[S, El, R, 2I]) and down = (a[S, El, R, I], b[S, El, R, D]), or None."""
        raise NotImplementedError

    # ---- hybrid linear-attention models (Qwen3-Next's Gated DeltaNet) -------------------------
    def causal_conv1d(self, x: Array, weight: Array, conv_state: Array, slot: int) -> Array:
        """One sequence's chunk x[T, C] through the depthwise causal conv weight[C, K] that
        continues from conv_state[slot] ([K-1, C] earlier inputs; zeros at a sequence start):
        y[t] = silu(sum_j weight[:, j] * xs[t + j]) with xs = conv_state[slot] ++ x. In place:
        conv_state[slot] = the last K-1 rows of xs. Returns [T, C]."""
        raise NotImplementedError

    def causal_conv1d_update(self, x: Array, weight: Array, conv_state: Array, slots: Array) -> Array:
        """One token per sequence: x[B, C], slots[B] (distinct) -> [B, C]; the one-step form of
        ``causal_conv1d`` for row b on conv_state[slots[b]], updated in place."""
        raise NotImplementedError

    def delta_rule_gates(self, b: Array, a: Array, a_log: Array, dt_bias: Array):
        """b, a [T, Hv], a_log, dt_bias [Hv] -> (g[T, Hv] = -exp(a_log) * softplus(a + dt_bias),
        the log decay, and beta[T, Hv] = sigmoid(b)), both float32."""
        raise NotImplementedError

    def gated_delta_rule_chunked(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, delta_state: Array, slot: int
    ) -> Array:
        """One sequence's chunk, continuing from delta_state[slot] ([Hv, dk, dv]). q, k [T, Hk, dk]
        (value head h reads key head h // (Hv // Hk)), v [T, Hv, dv], g, beta [T, Hv]. q and k are
        L2-normalized (eps 1e-6) and q scaled by dk**-0.5; then per token t: S = exp(g_t) * S;
        S += k_t (beta_t * (v_t - k_t S))^T; o_t = q_t S. Computed in chunks (the WY/UT form);
        equal to ``gated_delta_rule_step`` applied token by token. In place: delta_state[slot] = S.
        Returns o[T, Hv, dv] float32."""
        raise NotImplementedError

    def gated_delta_rule_step(
        self, q: Array, k: Array, v: Array, g: Array, beta: Array, delta_state: Array, slots: Array
    ) -> Array:
        """One token per sequence: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], slots[B]
        (distinct) -> o[B, Hv, dv]; the recurrence of ``gated_delta_rule_chunked`` for one step on
        delta_state[slots[b]], updated in place."""
        raise NotImplementedError

    def gated_rms_norm(self, x: Array, weight: Array, gate: Array, eps: float) -> Array:
        """x[N, dv], weight[dv], gate[N, dv] -> rms_norm(x) * weight * silu(gate)  [N, dv]."""
        raise NotImplementedError

    def sigmoid_mul(self, x: Array, gate: Array) -> Array:
        """x[T, N] * sigmoid(gate[T, N]): Qwen3-Next's attention output gate."""
        raise NotImplementedError

    def argmax(self, logits: Array) -> np.ndarray:
        """logits[B, V] -> host int64[B] (first maximum wins)."""
        raise NotImplementedError

    def argmax_values(self, logits: Array) -> tuple[np.ndarray, np.ndarray]:
        """logits[B, V] -> (argmax, host int64 [B]; each row's logit there, host float32 [B])."""
        tokens = self.argmax(logits)
        rows = np.arange(len(tokens))
        return tokens, np.asarray(self.to_host(logits[self.index(rows), self.index(tokens)]), np.float32)

    # ---- logits processing on the device (the GPU backend; the host's is eprt.engine.sampling) ----
    def gather_logits(self, logits: Array, rows: np.ndarray) -> Array:
        """logits[B, V], rows[m] (host int) -> a float32 copy [m, V] of those rows."""
        raise NotImplementedError

    def mask_logits(self, x: Array, rows: np.ndarray, bits: np.ndarray) -> None:
        """In place on float32 x[m, V]: token t of row rows[i] becomes -inf unless bit t % 32 of
        bits[i, t // 32] (host uint32 [R, ceil(V / 32)]) is set."""
        raise NotImplementedError

    def edit_logits(self, x: Array, rows, tokens, banned, bias, scale, subtract) -> None:
        """In place on float32 x[m, V], per pair p (host arrays [P]): x[rows[p], tokens[p]] = -inf
        if banned[p], else ((v + bias[p]) / scale[p] when positive, * scale[p] otherwise) - subtract[p]."""
        raise NotImplementedError

    def sample_logits(self, x: Array, inv_temp: np.ndarray, min_p: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """A token per row of float32 x[m, V] (host int64 [m]), drawn on the device by inverse CDF in
        index order over exp((x - max) * inv_temp[r]) cut below min_p[r], with uniforms[r]: the host
        sampler's draw when no top-k / top-p cut applies (only the ids come back)."""
        raise NotImplementedError
