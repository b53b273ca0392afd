"""The MoE transformer forward pass, written once for every architecture and backend.

T tokens in the call, B sequences, D hidden, H / Hk query / KV heads, Dh head dim,
E experts, V vocabulary; MLA: C kv_lora_rank, R rope dims, Dn/Dv nope/value head dims.

Expert parallelism: ``combine`` sums the per-rank partial MoE outputs over ranks
(identity on one rank). Attention, router and shared expert are replicated, so every
rank computes identical hidden states and keeps identical KV (and, for hybrid models, identical
recurrent state: ``linear_attention.py``). Under dp attention ``exchange`` replaces the combine:
each rank runs only its own rows and the MoE layer gathers and scatters them (docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.kv_cache import KVCache
from eprt.model.linear_attention import gated_delta_net
from eprt.model.recurrent_state import RecurrentState
from eprt.model.weights import ModelWeights


@dataclass(frozen=True)
class PrefillPart:
    """One sequence's chunk inside a batched prefill: tokens [offset, offset + length) of the call."""

    offset: int
    length: int
    block_table: np.ndarray  # [MB] int32
    start_pos: int  # position of its first token
    state_slot: int = -1  # hybrid models: its recurrent-state slot


@dataclass
class AttnBatch:
    """Where this call's tokens sit in the paged KV cache."""

    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    block_table: np.ndarray | None = None  # prefill: [MB] of the one sequence
    start_pos: int = 0  # prefill: position of the first token
    block_tables: np.ndarray | None = None  # decode: [B, MB]
    context_lens: np.ndarray | None = None  # decode: [B] (new token included)
    query_lens: np.ndarray | None = None  # verify: [S] rows of each sequence (decode fields per row)
    state_slots: np.ndarray | None = None  # hybrid models: recurrent-state slot of the sequence [1] or rows [B]
    parts: tuple = ()  # batched prefill: a PrefillPart per sequence, in token order (block_table unused)
    rope_cos_sin: np.ndarray | None = None  # [T, R] per-token cos|sin (3-D MRoPE of image prompts): replaces positions
    window: AttnBatch | None = None  # windowed KV: the sliding layers' slots and tables (positions as here)
    device: dict = field(default_factory=dict, repr=False, compare=False)  # MoEModel.index's uploads, by field

    @property
    def is_prefill(self) -> bool:
        return self.block_table is not None or bool(self.parts)

    def prefill_parts(self) -> tuple:
        """The sequences of a prefill call: ``parts``, or the one sequence of ``block_table``."""
        if self.parts:
            return self.parts
        slot = -1 if self.state_slots is None else int(self.state_slots[0])
        return (PrefillPart(0, len(self.positions), self.block_table, self.start_pos, slot),)


def _inv_freq(cfg: ModelConfig, dim: int) -> np.ndarray:
    """Inverse frequencies [dim/2] in float32, default or YaRN, as transformers computes them."""
    pos_freqs = (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
    y = cfg.rope_scaling
    if y is None:
        return (1.0 / pos_freqs).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(cfg.rope_theta)
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1.0 - ramp).astype(np.float32)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    inv_inter = (1.0 / (np.float32(y.factor) * pos_freqs)).astype(np.float32)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's factor on cos/sin (1 without scaling)."""
    y = cfg.rope_scaling
    if y is None:
        return 1.0
    if y.attention_factor is not None:
        return y.attention_factor
    if y.mscale and y.mscale_all_dim:
        return _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
    return _yarn_mscale(y.factor)


def attention_scale(cfg: ModelConfig) -> float:
    """Softmax scale: 1/sqrt(query-key dim), times DeepSeek's YaRN mscale(mscale_all_dim)^2 for MLA."""
    if cfg.mla is None:
        return cfg.head_dim**-0.5
    scale = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5
    y = cfg.rope_scaling
    if y is not None and y.mscale_all_dim:
        scale *= _yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


def rope_table(cfg: ModelConfig, max_len: int) -> np.ndarray:
    """cos | sin for positions [0, max_len): [P, rope_dim] float32, as Hugging Face computes it
    (rope_dim: head_dim, glm4_moe's partial rotary dims, or MLA's qk_rope_head_dim)."""
    inv_freq = _inv_freq(cfg, cfg.rope_dim)
    freqs = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]  # [P, R/2]
    factor = np.float32(rope_attention_factor(cfg))
    return np.concatenate([np.cos(freqs) * factor, np.sin(freqs) * factor], axis=-1).astype(np.float32)


MLA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps
_MLA_OPS = ("head_linear", "latent_write", "mla_attention_prefill", "mla_attention_decode", "rms_norm_linear")
_GROUPED_OPS = ("router_grouped", "add")
_HYBRID_OPS = (
    "causal_conv1d",
    "causal_conv1d_update",
    "delta_rule_gates",
    "gated_delta_rule_chunked",
    "gated_delta_rule_step",
    "gated_rms_norm",
    "sigmoid_mul",
)


_GPT_OSS_OPS = (
    "attention_sinks_prefill",
    "attention_sinks_decode",
    "router_topk_softmax",
    "moe_experts_swiglu",
    "swiglu_expert_weights",
    "mxfp4_expert_weights",
)


def _check_backend(cfg: ModelConfig, ops) -> None:
    """A clear start-up error when the backend lacks an operation this architecture needs."""
    from eprt.ops.base import Ops

    needed = (_MLA_OPS if cfg.mla is not None else ()) + (_GROUPED_OPS if cfg.routing is not None else ())
    needed += _HYBRID_OPS if cfg.is_hybrid else ()
    needed += _GPT_OSS_OPS if cfg.swiglu is not None else ()
    missing = [n for n in needed if getattr(type(ops), n) is getattr(Ops, n)]
    if missing:
        raise NotImplementedError(
            f"the {ops.name} backend does not implement {', '.join(missing)} needed by {cfg.model_type}; "
            f"run it with --device cpu"
        )


class MoEModel:
    def __init__(
        self, cfg: ModelConfig, weights: ModelWeights, ops, max_len: int, combine: Callable = lambda partial: partial
    ):
        self.cfg, self.w, self.ops, self.combine = cfg, weights, ops, combine
        self.exchange = None  # dp attention: eprt.comm.dp_combine.DpExchange (this rank's rows only)
        self.alltoall = None  # --moe-exchange alltoall: eprt.comm.alltoall.AllToAllExchange
        self.expert_rank: np.ndarray | None = None  # [E] the rank holding each expert (alltoall, no EPLB)
        self.moe_layers_run = 0  # MoE layers run (each one exchange between the ranks): the per-layer figures
        self.expert_counts = ops.zeros((cfg.num_layers, cfg.num_experts), "i32")  # [L, E] tokens routed
        self.slots = None  # eprt.model.placement.ExpertSlots under EPLB: experts on physical slots
        self.max_len = max_len
        _check_backend(cfg, ops)
        self.inv_freq = _inv_freq(cfg, cfg.rope_dim)  # [R/2] float32
        self.cos_sin = ops.activation(rope_table(cfg, max_len))
        self.scale = attention_scale(cfg)
        self.lora = None  # LoraSlots (eprt/model/lora.py) when adapters are served
        self.lora_rows = None  # LoraRows of the forward pass in progress; None: no adapter in the batch
        self.exchange_lora_rows = None  # dp attention: LoraRows of the rows the MoE exchange gathers
        self.row_mask = None  # [T, 1] int32 on the device, 1 for a real row, 0 for padding (CUDA graph buckets)
        self.decode_layers = [self._decode_layer(lw, i) for i, lw in enumerate(weights.layers)]  # or None each

    # ---- pieces ------------------------------------------------------------------------
    def embed(self, ids: np.ndarray, image_rows: np.ndarray | None = None, image_mask: np.ndarray | None = None):
        h = self.ops.embedding(self.w.embed, self.ops.index(ids))  # [T, D]
        if image_rows is not None and len(image_rows):
            h[self.ops.index(np.nonzero(image_mask)[0])] = self.ops.activation(image_rows)
        return h

    def index(self, batch: AttnBatch, name: str):
        """The int32 field ``name`` of ``batch`` on the device, uploaded once per forward pass: every
        layer reads the same positions, slots, tables and lengths (issue 39: copies per layer)."""
        if name not in batch.device:
            batch.device[name] = self.ops.index(getattr(batch, name))
        return batch.device[name]

    def _linear(self, x, w, layer: int, target: str, bias=None):
        """ops.linear plus the LoRA delta of each row's adapter (nothing more without adapters)."""
        y = self.ops.linear(x, w, bias)
        return y if self.lora_rows is None else self.lora.apply(y, x, self.lora_rows, layer, target)

    def _qkv(self, lw, x, layer: int):
        """q [T, H, Dh], k and v [T, Hk, Dh]: row views of one product where the weights are fused."""
        cfg, ops, T = self.cfg, self.ops, x.shape[0]
        if lw.qkv is not None:  # one product for the three
            qkv = ops.linear(x, lw.qkv, lw.qkv_bias)  # [T, Q + 2KV]
            nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            q, k, v = (qkv[:, a:b] for a, b in ((0, nq), (nq, nq + nk), (nq + nk, None)))
            if self.lora_rows is not None:
                q, k, v = (
                    self.lora.apply(ops.xp.ascontiguousarray(y), x, self.lora_rows, layer, t)
                    for y, t in ((q, "q"), (k, "k"), (v, "v"))
                )
        else:
            q = self._linear(x, lw.q, layer, "q", lw.q_bias)  # [T, H*Dh]
            k = self._linear(x, lw.k, layer, "k", lw.k_bias)  # [T, Hk*Dh]
            v = self._linear(x, lw.v, layer, "v", lw.v_bias)
        if cfg.qk_norm == "full" or cfg.clip_qkv is not None:
            q, k, v = (ops.xp.ascontiguousarray(a) for a in (q, k, v))
        if cfg.qk_norm == "full":  # OLMoE
            q = ops.rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (ops.clip(t, cfg.clip_qkv) for t in (q, k, v))
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        return (a.reshape(T, h, cfg.head_dim) for a, h in zip((q, k, v), heads))

    def _plain_attention(self, lw) -> bool:
        """Whether this layer's attention can be ops.attention_decode_block's ops alone: fused q, k and
        v without bias, no q/k clip, full q/k norm, gate or sinks."""
        cfg = self.cfg
        plain = lw.qkv is not None and lw.qkv_bias is None and lw.q_gate is None
        return plain and cfg.qk_norm != "full" and cfg.clip_qkv is None and not cfg.attention_sinks

    def _plain_step(self, batch: AttnBatch) -> bool:
        """Whether the batch is a plain decode step: no prompt or verify rows, no per-token rope
        table, no adapters."""
        plain = batch.query_lens is None and batch.rope_cos_sin is None and self.lora_rows is None
        return plain and not batch.is_prefill

    def _plain_decode(self, lw, batch: AttnBatch) -> bool:
        """Whether this layer's attention is ops.attention_decode_block's ops alone."""
        return self._plain_attention(lw) and self._plain_step(batch)

    def _decode_layer(self, lw, layer: int):
        """ops.decode_layer's weights of a layer whose attention can be attention_decode_block's and
        whose MLP is routed experts alone (no shared expert), routed by the plain softmax router
        (no biases, no groups, no gpt-oss router), else None."""
        cfg = self.cfg
        moe = cfg.sparse_layers[layer] and lw.linear is None and cfg.mla is None and cfg.swiglu is None
        moe = moe and cfg.routing is None and lw.shared_gate_up is None and lw.router_bias is None
        if not (moe and lw.router_logit_bias is None and self._plain_attention(lw)):
            return None
        weights = (lw.input_norm, lw.qkv, lw.o, (lw.q_norm, lw.k_norm) if cfg.qk_norm == "head" else None)
        weights += (lw.post_norm, lw.router, lw.w_gate_up, lw.w_down)
        local = (self.w.expert_start, self.w.expert_end - self.w.expert_start)
        constants = dict(heads=cfg.num_heads, eps=cfg.rms_norm_eps, scale=self.scale, top_k=cfg.top_k)
        return self.ops.decode_layer_weights(*weights, **constants, renormalize=cfg.norm_topk_prob, local=local)

    def _decode_meta(self, batch: AttnBatch):
        """ops.decode_layer's per-step arguments (positions, cos_sin, slots, tables, lens) where every
        decode layer of this step may run as that one op: a plain decode step, this rank's own experts
        (no EPLB, dp attention or all-to-all exchange) and no padded rows; else None."""
        alone = self.exchange is None and self.alltoall is None and self.slots is None and self.row_mask is None
        if not (alone and self._plain_step(batch)):
            return None
        names = ("positions", "slot_mapping", "block_tables", "context_lens")
        positions, slots, tables, lens = (self.index(batch, n) for n in names)
        return positions, self.cos_sin, slots, tables, lens

    def _attention(self, lw, x, batch: AttnBatch, kv: KVCache, layer: int):
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        norms = (lw.q_norm, lw.k_norm) if cfg.qk_norm == "head" else None  # Qwen3-MoE's per-head norm
        slots = self.index(self._kv_batch(batch, layer), "slot_mapping")
        if self._plain_decode(lw, batch):  # one op (one compiled call on the CPU)
            cache = (self.index(batch, "positions"), self.cos_sin, kv.k[layer], kv.v[layer], slots)
            tables, lens = self.index(batch, "block_tables"), self.index(batch, "context_lens")
            args = (norms, cfg.rms_norm_eps, *cache, tables, lens, self.scale)
            return ops.attention_decode_block(x, lw.qkv, lw.o, cfg.num_heads, *args)  # [T, D]
        q, k, v = self._qkv(lw, x, layer)
        if batch.rope_cos_sin is None:
            pos, table = self.index(batch, "positions"), self.cos_sin
        else:  # each token's own cos|sin row
            pos, table = ops.index(np.arange(T, dtype=np.int32)), ops.activation(batch.rope_cos_sin)
        q = ops.qk_rope_kv_write(q, k, v, norms, cfg.rms_norm_eps, pos, table, kv.k[layer], kv.v[layer], slots)
        if cfg.attention_sinks:
            return self._linear(self._sink_attention(lw, q, batch, kv, layer), lw.o, layer, "o", lw.o_bias)
        if batch.is_prefill:
            o = self._per_sequence(
                batch,
                lambda rows, p: ops.attention_prefill(
                    q[rows], kv.k[layer], kv.v[layer], ops.index(p.block_table), p.start_pos, self.scale
                ),
            )
        elif batch.query_lens is not None:
            tables, lens = self.index(batch, "block_tables"), self.index(batch, "context_lens")
            o = ops.attention_verify(q, kv.k[layer], kv.v[layer], tables, lens, batch.query_lens, self.scale)
        else:
            o = ops.attention_decode(
                q,
                kv.k[layer],
                kv.v[layer],
                self.index(batch, "block_tables"),
                self.index(batch, "context_lens"),
                self.scale,
            )
        o = o.reshape(T, -1)  # [T, H*Dh]
        if lw.q_gate is not None:  # Qwen3-Next's gated attention
            o = ops.sigmoid_mul(o, ops.linear(x, lw.q_gate))
        return self._linear(o, lw.o, layer, "o")  # [T, D]

    def _kv_batch(self, batch: AttnBatch, layer: int) -> AttnBatch:
        """The batch whose slots and tables layer ``layer``'s KV uses: a sliding layer's own when
        the KV is windowed (gpt-oss), else ``batch``."""
        sliding = self.cfg.attention_sinks and self.cfg.is_sliding_layer(layer)
        return batch.window if sliding and batch.window is not None else batch

    def _sink_attention(self, lw, q, batch: AttnBatch, kv: KVCache, layer: int):
        """gpt-oss's attention over the paged KV (this step's keys already written): sinks in the
        denominator; a sliding layer reads the last ``sliding_window`` keys, through its own tables
        when the KV is windowed. Returns [T, H*Dh]."""
        ops = self.ops
        window = self.cfg.sliding_window if self.cfg.is_sliding_layer(layer) else 0
        b = self._kv_batch(batch, layer)
        kc, vc = kv.k[layer], kv.v[layer]
        if b.is_prefill:
            o = self._per_sequence(
                b,
                lambda rows, p: ops.attention_sinks_prefill(
                    q[rows], kc, vc, ops.index(p.block_table), p.start_pos, self.scale, lw.sinks, window
                ),
            )
        else:
            tables, lens = self.index(b, "block_tables"), self.index(b, "context_lens")
            if b.query_lens is not None:
                o = ops.attention_sinks_verify(q, kc, vc, tables, lens, b.query_lens, self.scale, lw.sinks, window)
            else:
                o = ops.attention_sinks_decode(q, kc, vc, tables, lens, self.scale, lw.sinks, window)
        return o.reshape(q.shape[0], -1)  # [T, H*Dh]

    def _per_sequence(self, batch: AttnBatch, run: Callable):
        """A prefill's per-sequence step (causal attention over each one's own paged KV) on each
        part's rows, concatenated in token order: [T, ..]."""
        outs = [run(slice(p.offset, p.offset + p.length), p) for p in batch.prefill_parts()]
        return outs[0] if len(outs) == 1 else self.ops.xp.concatenate(outs, axis=0)

    def _mla_attention(self, lw, x, batch: AttnBatch, kv: KVCache, layer: int):
        """Multi-head latent attention: the cache keeps [normed latent | roped key] per token; queries
        are absorbed into the latent space (q_nope @ W_UK), so attention reads C + R values per
        position, and the latent output goes up through W_UV."""
        cfg, ops, m = self.cfg, self.ops, self.cfg.mla
        T, H, C, Dn = x.shape[0], cfg.num_heads, m.kv_lora_rank, m.qk_nope_head_dim
        if lw.qkv_a is not None:  # q_a | kv_a in one product: [T, Qr + C+R], two column slices
            qkv_a = ops.linear(x, lw.qkv_a)
            q_a, compressed = qkv_a[:, : m.q_lora_rank], qkv_a[:, m.q_lora_rank :]
        else:  # no q LoRA, or q_a FP8-resident
            q_a = None if lw.q_a is None else ops.linear(x, lw.q_a)  # [T, Qr]
            compressed = ops.linear(x, lw.kv_a)  # [T, C+R]
        q = ops.linear(x, lw.q) if q_a is None else ops.rms_norm_linear(q_a, lw.q_a_norm, MLA_NORM_EPS, lw.q)
        q = q.reshape(T, H, Dn + m.qk_rope_head_dim)  # [T, H, Dn+R]
        cache, pos, slots = kv.latent[layer], self.index(batch, "positions"), self.index(batch, "slot_mapping")
        args = (MLA_NORM_EPS, pos, self.cos_sin, lw.w_uk, cache, slots)
        q_all = ops.mla_prologue(q, compressed, lw.kv_a_norm, *args)  # [T, H, C+R]; the cache row written
        if batch.is_prefill:
            o = self._per_sequence(
                batch,
                lambda rows, p: ops.mla_attention_prefill(
                    q_all[rows], cache, ops.index(p.block_table), p.start_pos, self.scale, value_dim=C
                ),
            )
        else:  # decode or verify: w_uv's up-projection inside (the GPU's attention launches at few rows)
            tables, lens = self.index(batch, "block_tables"), self.index(batch, "context_lens")
            if batch.query_lens is not None:
                o = ops.mla_attention_verify(q_all, cache, tables, lens, batch.query_lens, self.scale, C, lw.w_uv)
            else:
                o = ops.mla_attention_decode(q_all, cache, tables, lens, self.scale, C, lw.w_uv)  # [T, H, Dv]
            return ops.linear(o.reshape(T, -1), lw.o)  # [T, H*Dv] -> [T, D]
        return ops.linear(ops.head_linear(o, lw.w_uv).reshape(T, -1), lw.o)  # [T, H, C] -> [T, H, Dv] -> [T, D]

    def _moe(self, lw, x, layer: int):
        """The MoE layer's output [T, D] (the shared expert's added)."""
        out, shared = self._moe_parts(lw, x, layer)
        return out if shared is None else self.ops.add(out, shared)

    def _moe_parts(self, lw, x, layer: int):
        """(the MoE layer's output [T, D], an ungated shared expert's output [T, D] not yet added or
        None): the forward pass folds the add into the next add_rms_norm (one launch fewer). Each rank
        runs the shared expert over its rows; without adapters, on the rows its experts see (not dp
        attention's, nor the all-to-all's), inside the experts' launches (ops.moe_experts_shared)."""
        self.moe_layers_run += 1
        shared = lw.shared_gate_up is not None and x.shape[0] > 0
        fuse = shared and lw.shared_gate is None and self.lora_rows is None and self.exchange is None
        if self.alltoall is not None:
            out, s = self._routed_alltoall(lw, x, layer), None
        else:
            out, s = self._routed(lw, x, layer, fuse)
        if not shared:
            return out, None
        if s is None:
            up = self._gate_up_silu(x, lw.shared_gate_up, layer, "shared_gate_up")
            s = self._linear(up, lw.shared_down, layer, "shared_down")
        if lw.shared_gate is not None:  # Qwen2-MoE's gated shared expert
            return self.ops.sigmoid_gate_add(out, s, self.ops.linear(x, lw.shared_gate)), None  # gate [T, 1]
        return out, s  # DeepSeek / GLM shared experts: added by the caller

    def _route(self, lw, x, layer: int, count: bool = True, own=None):
        """The router over x [T, D]: (weights [T, k], ids [T, k], the permutation to this rank's experts
        or None); ``count``: into the expert-load counters (an MTP layer's routing is not counted: EPLB
        balances the main layers); ``own``: (expert_start, El) for the permutation (ops.route)."""
        ops, cfg = self.ops, self.cfg
        counted = count and layer < cfg.num_layers
        if cfg.swiglu is not None:  # gpt-oss: softmax over the top-k logits
            weights, ids = ops.router_topk_softmax(ops.linear(x, lw.router, lw.router_logit_bias), cfg.top_k)
            perm, fused = None, False
        else:  # the count goes into the fused launch unless padded rows (a graph's) must be left out
            fused = counted and self.row_mask is None
            counts = self.expert_counts[layer] if fused else None
            routing = cfg.norm_topk_prob if cfg.routing is None else cfg.routing
            args = (cfg.top_k, routing, lw.router_bias, counts, own)
            weights, ids, perm = ops.route_rows(x, lw.router, lw.router_logit_bias, *args)  # [T, k]
        if counted and not fused:
            ops.count_experts(self._counted(ids), self.expert_counts[layer])
        return weights, ids, perm

    def _owner_route(self, lw, x, layer: int, rows: bool):
        """dp attention: each row routed by its owner (the router's product over the rows attention gave
        it, whichever the exchange: the same bits), the routing all-gathered (``rows``: with the rows
        themselves, in the same all-gather); counted in the expert load. Returns (every rank's rows
        [N, D] or None, weights [N, k] and ids [N, k] on the host)."""
        if x.shape[0]:
            weights, ids, _ = self._route(lw, x, layer, count=False)
        else:  # a rank without rows: it still serves the others' rows
            weights, ids = np.zeros((0, self.cfg.top_k), np.float32), np.zeros((0, self.cfg.top_k), np.int32)
        if rows:
            x, weights, ids = self.exchange.gather_routed(x, weights, ids)
        else:
            x, (weights, ids) = None, self.exchange.routing(weights, ids)
        if layer < self.cfg.num_layers:
            self.ops.count_experts(self.ops.index(ids), self.expert_counts[layer])
        return x, weights, ids

    def _routed(self, lw, x, layer: int, shared: bool = False):
        """(the routed experts' output, summed over ranks: [T, D] (dp attention: this rank's rows), the
        shared expert's output [T, D] or None). ``shared``: run the layer's shared expert in the experts'
        launches where the plain path serves (this rank's experts, replicated attention, no EPLB)."""
        ops, cfg = self.ops, self.cfg
        rows = self.lora_rows if self.exchange is None else self.exchange_lora_rows  # the MoE's rows' adapters
        experts = (None, None) if rows is None or cfg.swiglu is not None else self.lora.experts(layer)
        perm = None
        if self.exchange is not None:  # dp attention: the experts see every rank's rows
            x, weights, ids = self._owner_route(lw, x, layer, rows=True)  # [N, D], [N, k]
            weights, ids = ops.xp.asarray(weights), ops.index(ids)
        else:
            plain = experts == (None, None) and self.slots is None  # this rank's own experts, no adapter
            own = (self.w.expert_start, self.w.expert_end - self.w.expert_start) if plain else None
            weights, ids, perm = self._route(lw, x, layer, own=own)
        if cfg.swiglu is not None:  # gpt-oss: biased experts, clamped SwiGLU
            args = (lw.w_gate_up, lw.w_down, lw.b_gate_up, lw.b_down, self.w.expert_start)
            out = ops.moe_experts_swiglu(x, weights, ids, *args, cfg.swiglu.alpha, cfg.swiglu.limit)
            return self._combine(out), None
        if experts != (None, None):  # (never under EPLB: LoraSlots.read refuses such adapters there)
            args = (lw.w_gate_up, lw.w_down, self.w.expert_start, rows, *experts)
            return self._combine(ops.moe_experts_lora(x, weights, ids, *args)), None  # [T, D] summed over ranks
        if self.slots is None:
            args = (x, weights, ids, lw.w_gate_up, lw.w_down, self.w.expert_start, perm)
            if shared:
                partial, s = ops.moe_experts_shared(*args, lw.shared_gate_up, lw.shared_down)
                return self._combine(partial), s
            return self._combine(ops.moe_experts(*args)), None  # [T, D] summed over ranks
        # EPLB: every rank gets every row's sum; under dp attention it keeps its own
        out = self.slots.moe(ops, x, weights, ids, lw.w_gate_up, lw.w_down, layer)  # [T, D]
        return (out if self.exchange is None else self.exchange.mine(out)), None

    def _routed_alltoall(self, lw, x, layer: int):
        """``--moe-exchange alltoall``: the rows go to the ranks holding their experts and come back
        summed (eprt.comm.alltoall; the bits of ``_routed``). x: this rank's rows under dp attention."""
        ops, cfg, a2a = self.ops, self.cfg, self.alltoall
        if self.exchange is not None:
            _, weights, ids = self._owner_route(lw, x, layer, rows=False)
        else:
            weights, ids = (np.asarray(ops.to_host(a)) for a in self._route(lw, x, layer)[:2])  # [N, k] on the host
        if self.slots is not None:  # EPLB: each choice to the rank of its replica, chosen alike everywhere
            slots = self.slots.choose(ops, ids, layer, lw.w_gate_up)
            start = self.slots.start
            run = lambda xs, w, s: ops.moe_experts(xs, w, s, lw.w_gate_up, lw.w_down, start)  # noqa: E731
            return a2a.run(x, weights, slots, self.slots.placement.slot_rank[slots], run, per_choice=True)
        start = self.w.expert_start
        if cfg.swiglu is not None:
            args = (lw.w_gate_up, lw.w_down, lw.b_gate_up, lw.b_down, start, cfg.swiglu.alpha, cfg.swiglu.limit)
            run = lambda xs, w, i: ops.moe_experts_swiglu(xs, w, i, *args)  # noqa: E731
        else:
            run = lambda xs, w, i: ops.moe_experts(xs, w, i, lw.w_gate_up, lw.w_down, start)  # noqa: E731
        return a2a.run(x, weights, ids, self.expert_rank[ids], run, per_choice=False)

    def _counted(self, ids):
        """The expert ids [T, k] the expert load counts: a padded row's are -1 (not counted)."""
        if self.row_mask is None:
            return ids
        return ids * self.row_mask + (self.row_mask - 1)  # [T, k]

    def _combine(self, partial):
        """The experts' partial sums [T, D] summed over ranks (dp attention: this rank's rows of it)."""
        return self.combine(partial) if self.exchange is None else self.exchange.scatter(partial)

    def _gate_up_silu(self, x, w, layer: int, target: str):
        """silu_and_mul of the gate_up product (one fused op without adapters; with them the
        LoRA delta joins the product first)."""
        if self.lora_rows is None:
            return self.ops.gate_up_silu(x, w)
        return self.ops.silu_and_mul(self._linear(x, w, layer, target))

    def _dense_mlp(self, lw, x, layer: int):
        up = self._gate_up_silu(x, lw.mlp_gate_up, layer, "mlp_gate_up")
        return self._linear(up, lw.mlp_down, layer, "mlp_down")

    def _mlp(self, lw, h, residual, layer: int):
        """The post-attention norm and the MLP of layer ``layer`` over the attention output h [T, D]:
        (its output [T, D], a shared expert's output [T, D] not yet added or None, the residual [T, D]).
        A dense MLP without adapters takes the norm into its gate_up product (one launch at decode)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if not self.cfg.sparse_layers[layer] and self.lora_rows is None:
            up, residual = ops.add_rms_norm_gate_up_silu(h, residual, lw.post_norm, eps, lw.mlp_gate_up)
            return ops.linear(up, lw.mlp_down), None, residual
        x, residual = ops.add_rms_norm(h, residual, lw.post_norm, eps)
        if self.cfg.sparse_layers[layer]:
            return *self._moe_parts(lw, x, layer), residual
        return self._dense_mlp(lw, x, layer), None, residual

    # ---- forward -----------------------------------------------------------------------
    def hidden_states(self, h, batch: AttnBatch, kv: KVCache, state: RecurrentState | None = None, deepstack=None):
        """Run every layer over h[T, D]; returns the final-normed hidden states [T, D]. ``state``:
        the recurrent state of a hybrid model's linear layers (rows ``batch.state_slots``).
        ``deepstack``: (mask [T], rows [K, n, D]) added to the outputs of layers 0..K-1 at the masked tokens."""
        ops, cfg = self.ops, self.cfg
        if cfg.is_hybrid and (state is None or batch.state_slots is None):
            raise ValueError(f"{cfg.model_type} has linear-attention layers: the forward pass needs their state slots")
        residual, shared = None, None  # shared: the last MoE layer's shared expert, added by the next norm
        meta = self._decode_meta(batch)
        for i, lw in enumerate(self.w.layers):
            one_op = None if meta is None or shared is not None else self.decode_layers[i]
            if one_op is not None:  # the whole layer as one op (on the CPU: two compiled calls)
                self.moe_layers_run += 1
                partial, residual = ops.decode_layer(h, residual, one_op, kv.k[i], kv.v[i], meta, self.expert_counts[i])
                h = self._combine(partial)
            else:
                h, shared, residual = self._layer(lw, h, residual, shared, batch, kv, state, i)
            if deepstack is not None and i < len(deepstack[1]):
                h, shared = self._add_deepstack(h if shared is None else ops.add(h, shared), *deepstack, i), None
        x, _ = ops.add_rms_norm(h, residual, self.w.norm, cfg.rms_norm_eps, shared)
        return x

    def _layer(self, lw, h, residual, shared, batch: AttnBatch, kv: KVCache, state, i: int):
        """Layer i over the last layer's output h [T, D] (layer 0: the embeddings, residual None):
        (its output [T, D], a shared expert's output not yet added or None, the residual [T, D])."""
        ops, cfg = self.ops, self.cfg
        if residual is None:
            x, residual = ops.rms_norm(h, lw.input_norm, cfg.rms_norm_eps), h
        else:
            x, residual = ops.add_rms_norm(h, residual, lw.input_norm, cfg.rms_norm_eps, shared)
        if lw.linear is not None and batch.is_prefill:  # each sequence continues its own state
            h = self._per_sequence(
                batch,
                lambda rows, p: gated_delta_net(
                    ops, cfg, lw.linear, x[rows], state, i, np.asarray([p.state_slot], np.int32), True
                ),
            )
        elif lw.linear is not None:
            h = gated_delta_net(ops, cfg, lw.linear, x, state, i, batch.state_slots, False)
        else:
            h = (self._attention if cfg.mla is None else self._mla_attention)(lw, x, batch, kv, i)
        return self._mlp(lw, h, residual, i)

    def _add_deepstack(self, h, mask, rows, layer: int):
        """h[T, D] with the layer's deepstack rows [n, D] added at the n masked tokens."""
        idx = self.ops.index(np.nonzero(mask)[0])
        h[idx] = self.ops.add(h[idx], self.ops.activation(np.ascontiguousarray(rows[layer])))  # [n, D]
        return h

    def idle_pass(self) -> None:
        """dp attention, a forward pass without rows on this rank: its experts still serve every
        MoE layer of the other ranks' rows."""
        empty = self.ops.xp.zeros((0, self.cfg.hidden_size), dtype=self.ops.act_dtype)  # [0, D]
        for i, lw in enumerate(self.w.layers):
            if self.cfg.sparse_layers[i]:
                self._moe(lw, empty, i)

    def expert_load(self) -> np.ndarray:
        """Tokens routed to each expert so far: [L, E] int32 on the host (a device read)."""
        return np.asarray(self.ops.to_host(self.expert_counts), dtype=np.int64)

    def logits(self, x):
        return self.ops.linear(x, self.w.lm_head)  # [T, V]

    # ---- multi-token prediction (DeepSeek's nextn layer; --speculative-method mtp) -----------
    def mtp_hidden(self, ids: np.ndarray, previous, batch: AttnBatch, kv: KVCache):
        """The MTP layer over T rows: row t at position ``batch.positions[t]`` joins the embedding of
        the token after that position (``ids[t]``; zeroed at position 0, as vLLM does) with the hidden
        state ``previous[t]`` [T, D] that predicted it (the main model's final-normed one, or the
        MTP's own output when drafting further), runs one decoder layer whose KV is layer
        ``num_layers`` of ``kv``, and returns its output [T, D] before the head's norm."""
        ops, cfg, mw, xp = self.ops, self.cfg, self.w.mtp, self.ops.xp
        eps = cfg.rms_norm_eps
        e = ops.embedding(mw.embed, ops.index(ids))  # [T, D]
        first = np.flatnonzero(np.asarray(batch.positions) == 0)
        if first.size:
            e[ops.index(first)] = 0
        joined = xp.concatenate([ops.rms_norm(e, mw.enorm, eps), ops.rms_norm(previous, mw.hnorm, eps)], axis=-1)
        residual = ops.linear(joined, mw.eh_proj)  # [T, 2D] -> [T, D]
        lw, layer = mw.layer, cfg.num_layers
        x = ops.rms_norm(residual, lw.input_norm, eps)
        h = (self._attention if cfg.mla is None else self._mla_attention)(lw, x, batch, kv, layer)  # [T, D]
        x, residual = ops.add_rms_norm(h, residual, lw.post_norm, eps)
        return ops.add(self._moe(lw, x, layer), residual)  # [T, D]

    def mtp_logits(self, h):
        """The MTP head over its output rows h [T, D]: [T, V]."""
        return self.ops.linear(self.ops.rms_norm(h, self.w.mtp.head_norm, self.cfg.rms_norm_eps), self.w.mtp.head)
