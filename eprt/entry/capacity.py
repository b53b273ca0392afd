"""The capacity planner's arithmetic: weight bytes, KV pool and wire bytes per rank as eprt makes
them, and roofline lower bounds of a decode step, from ``config.json`` and the safetensors headers
alone (no tensor data is read). Rules and assumptions: docs/plan.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from functools import partial

from eprt.comm.mpi_transport import REDUCE_SCATTER_MIN_BYTES
from eprt.comm.protocol import DecodeBatch, PrefillNext, encode
from eprt.comm.transport import DEFAULT_FRAME_WORDS
from eprt.engine.executor import window_spec
from eprt.entry.resident import EMBED, HEAD, CpuWeights, Tensor, cpu_held, gpu_held
from eprt.model.config import ModelConfig
from eprt.model.kv_cache import KVCache
from eprt.model.loader import expert_shard
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint
from eprt.ops import cpu_weights
from eprt.ops.device import pool_blocks

# KV (and a GPU's weights) as the GPU (bf16) or CPU (fp32) backend holds them; the CPU's weights: --cpu-weights
DEVICE_ITEMSIZE = {"bf16": 2, "fp32": 4}
CHECKPOINT_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}  # config.json's dtype names
_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
DECODE_BATCHES = (1, 32, 256)
_GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gib: float = 141.0  # memory per GPU
    hbm_tbps: float = 4.8  # HBM bandwidth, TB/s
    link_gbps: float = 900.0  # per-GPU link bandwidth (NVLink), GB/s, charged for the bytes one rank receives
    tflops: float = 990.0  # dense bf16 compute peak, TFLOP/s


@dataclass(frozen=True)
class Settings:
    ranks: int
    max_batch: int = 32
    block_size: int = 16
    max_model_len: int | None = None
    num_blocks: int = 0  # as --num-blocks: 0 sizes the pool from the GPU's memory
    gpu_memory_utilization: float = 0.9
    reserved_gib: float = 1.0  # memory per GPU besides weights and KV (CUDA context, activations)
    dtype: str = "bf16"  # the backend: bf16 (GPU: weights and KV bf16) or fp32 (CPU: KV float32, weights below)
    cpu_weights: str | None = None  # the CPU's --cpu-weights (None: EPRT_CPU_WEIGHTS, as the engine reads it)
    int8_group: int | None = None  # --cpu-weights int8's k group (None: EPRT_CPU_INT8_GROUP)
    context: int = 0  # tokens of context per sequence whose KV a decode step reads
    prefill_chunk: int = 2048  # prompt tokens per prefill chunk (the GPU default)
    num_redundant_experts: int = 0  # EPLB's extra expert slots (docs/eplb.md); > 0: slots, not experts, per rank


@dataclass(frozen=True)
class RankWeights:
    rank: int
    expert_start: int
    expert_end: int
    read_bytes: int  # checkpoint bytes the loader reads (LoadedModel.bytes_read)
    replicated_bytes: int  # resident on the device, as the backend holds them
    expert_bytes: int
    lm_head_bytes: int  # of replicated_bytes: a head apart from the embedding table (untied, or int8's copy)
    embed_bytes: int = 0  # of replicated_bytes: the embedding table (a tied head reads it)
    body_params: int = 0  # parameters of the replicated weights besides the embedding and the head
    precisions: tuple = ()  # (precision, bytes) of replicated_bytes + expert_bytes, the most bytes first

    @property
    def resident_bytes(self) -> int:
        return self.replicated_bytes + self.expert_bytes


@dataclass(frozen=True)
class KVPlan:
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_rank: tuple  # room on each rank (None: the weights leave no room)
    blocks: int  # the pool every rank allocates: the smallest over the ranks (0: does not fit)
    tokens: int  # the job's capacity: blocks x block_size (replicated), the ranks' pools added up (dp)
    max_model_len: int  # as the engine sets it (0: does not fit)
    problem: str = ""  # why the job does not fit, else empty


@dataclass(frozen=True)
class Wire:
    frame_bytes: int  # the broadcast command frame(s)
    combine_bytes: int  # MoE combine bytes received, the busiest rank
    combine: str  # "all-gather" | "reduce-scatter + all-gather" | "none (one rank)"

    @property
    def total(self) -> int:
        return self.frame_bytes + self.combine_bytes


@dataclass(frozen=True)
class StepBound:
    batch: int
    rank: int  # the slowest rank
    hbm_bytes: int
    wire_bytes: int
    flops: int
    hbm_s: float
    link_s: float
    compute_s: float
    bound_s: float
    binding: str  # "HBM" | "link" | "compute"


@dataclass(frozen=True)
class Plan:
    model: str
    model_type: str
    ranks: int
    attention: str
    settings: Settings
    hardware: Hardware
    weight_source: str  # "safetensors headers" or "config.json dtype ..."
    params: int
    weights: tuple  # RankWeights per rank
    kv: KVPlan
    decode_wire: tuple  # Wire per DECODE_BATCHES
    prefill_wire: Wire  # one chunk of settings.prefill_chunk tokens
    decode: tuple  # StepBound per DECODE_BATCHES


# -- weights ------------------------------------------------------------------------------------
def _replicated_shapes(cfg: ModelConfig) -> list[tuple[str, tuple]]:
    """Every replicated tensor load_weights reads (eprt/model/weights.py), with its shape."""
    D, V, E = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    Is, Id = cfg.shared_expert_intermediate_size, cfg.intermediate_size
    out = [("model.embed_tokens.weight", (V, D)), ("model.norm.weight", (D,))]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, D)))
    for i, sparse in enumerate(cfg.sparse_layers):
        p, a, m = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.{cfg.moe_prefix}"
        out += [(f"{p}.input_layernorm.weight", (D,)), (f"{p}.post_attention_layernorm.weight", (D,))]
        out += _mla_shapes(cfg, a) if cfg.mla is not None else _attention_shapes(cfg, a)
        if sparse and cfg.router_linear_bias:  # gpt_oss
            out += [(f"{m}.router.weight", (E, D)), (f"{m}.router.bias", (E,))]
        elif sparse:
            out.append((f"{m}.gate.weight", (E, D)))
            if cfg.router_bias:
                out.append((f"{m}.gate.e_score_correction_bias", (E,)))
            if cfg.has_shared_expert:
                s = f"{m}.{cfg.shared_expert_prefix}"
                out += [(f"{s}.gate_proj.weight", (Is, D)), (f"{s}.up_proj.weight", (Is, D))]
                out.append((f"{s}.down_proj.weight", (D, Is)))
                if cfg.shared_expert_gated:
                    out.append((f"{m}.shared_expert_gate.weight", (1, D)))
        else:
            out += [(f"{m}.gate_proj.weight", (Id, D)), (f"{m}.up_proj.weight", (Id, D))]
            out.append((f"{m}.down_proj.weight", (D, Id)))
    return out


def _attention_shapes(cfg: ModelConfig, a: str) -> list[tuple[str, tuple]]:
    """Grouped-query attention's tensors (weights._attention)."""
    D, Dh = cfg.hidden_size, cfg.head_dim
    Q, KV = cfg.num_heads * Dh, cfg.num_kv_heads * Dh
    out = [(f"{a}.q_proj.weight", (Q, D)), (f"{a}.k_proj.weight", (KV, D)), (f"{a}.v_proj.weight", (KV, D))]
    out.append((f"{a}.o_proj.weight", (D, Q)))
    if cfg.qkv_bias:
        out += [(f"{a}.q_proj.bias", (Q,)), (f"{a}.k_proj.bias", (KV,)), (f"{a}.v_proj.bias", (KV,))]
    if cfg.o_bias:
        out.append((f"{a}.o_proj.bias", (D,)))
    if cfg.attention_sinks:
        out.append((f"{a}.sinks", (cfg.num_heads,)))
    if cfg.qk_norm:
        q_norm, k_norm = ((Dh,), (Dh,)) if cfg.qk_norm == "head" else ((Q,), (KV,))
        out += [(f"{a}.q_norm.weight", q_norm), (f"{a}.k_norm.weight", k_norm)]
    return out


def _mla_shapes(cfg: ModelConfig, a: str) -> list[tuple[str, tuple]]:
    """Multi-head latent attention's tensors (weights._mla_attention)."""
    m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
    HQ, C = H * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.kv_lora_rank
    out = [(f"{a}.o_proj.weight", (D, H * m.v_head_dim))]
    if m.q_lora_rank:
        out += [(f"{a}.q_a_proj.weight", (m.q_lora_rank, D)), (f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))]
        out.append((f"{a}.q_b_proj.weight", (HQ, m.q_lora_rank)))
    else:
        out.append((f"{a}.q_proj.weight", (HQ, D)))
    out += [(f"{a}.kv_a_proj_with_mqa.weight", (m.latent_dim, D)), (f"{a}.kv_a_layernorm.weight", (C,))]
    out.append((f"{a}.kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), C)))
    return out


def _expert_shapes(cfg: ModelConfig, start: int, end: int, fused: bool) -> list[tuple[str, tuple, int]]:
    """(name, shape, resident elements) of the expert tensors the loader reads for experts [start, end)
    (EPLB physical slots past E hold expert slot mod E, as the contiguous placement has them).
    A fused tensor ``experts.gate_up_proj [E, 2I, D]`` is read whole (the loader slices it after)."""
    D, I, E, El = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, end - start
    out = []
    for i, sparse in enumerate(cfg.sparse_layers):
        if not sparse:
            continue
        m = f"model.layers.{i}.{cfg.moe_prefix}.experts"
        if cfg.swiglu is not None:
            out += _gptoss_expert_shapes(cfg, m, El)
            continue
        if fused:
            out += [(f"{m}.gate_up_proj", (E, 2 * I, D), El * 2 * I * D), (f"{m}.down_proj", (E, D, I), El * D * I)]
            continue
        g, u, d = cfg.expert_names
        for e in (s % E for s in range(start, end)):
            out += [(f"{m}.{e}.{g}.weight", (I, D), I * D), (f"{m}.{e}.{u}.weight", (I, D), I * D)]
            out.append((f"{m}.{e}.{d}.weight", (D, I), D * I))
    return out


def _gptoss_expert_shapes(cfg: ModelConfig, m: str, El: int) -> list[tuple[str, tuple, int]]:
    """gpt-oss's fused expert tensors (eprt/model/gptoss_weights.py), read whole: MXFP4 blocks and scales
    (resident as bytes) or bf16 [E, D, 2I] / [E, I, D], and the biases."""
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    out = [(f"{m}.gate_up_proj_bias", (E, 2 * I), El * 2 * I), (f"{m}.down_proj_bias", (E, D), El * D)]
    if cfg.mxfp4 is None:
        return out + [(f"{m}.gate_up_proj", (E, D, 2 * I), El * 2 * I * D), (f"{m}.down_proj", (E, I, D), El * D * I)]
    for proj, n, k in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
        out.append((f"{m}.{proj}_blocks", (E, n, k // 32, 16), El * n * k // 2))
        out.append((f"{m}.{proj}_scales", (E, n, k // 32), El * n * k // 32))
    return out


class _Sizes:
    """Bytes and dtype of each tensor as stored: from the safetensors headers when the directory has
    them, else from config.json's dtype (a config-only directory: no tensor is known to be FP8).
    ``quantized``: config.json names FP8 block scales, so the loader reads a ``.weight``'s
    ``weight_scale_inv`` with it (``weights.Fp8Source``)."""

    def __init__(self, model_dir: str, quantized: bool = False):
        try:
            self.headers = SafetensorsCheckpoint(model_dir)  # reads the headers only
        except CheckpointError as e:
            if "no .safetensors files" not in str(e):
                raise
            self.headers = None
        self.itemsize, self.source, self.quantized, self.dtype_name = 0, "safetensors headers", quantized, ""
        if self.headers is None:
            self.itemsize, dtype = _config_itemsize(model_dir)
            self.source, self.dtype_name = f"config.json dtype {dtype}", _SAFETENSORS_DTYPE[dtype]

    def dtype(self, name: str) -> str:
        """The safetensors dtype name ("BF16", "F32", "F8_E4M3", ...) of a tensor ``stored`` has checked."""
        return self.dtype_name if self.headers is None else self.headers.info(name).dtype

    def fp8(self, name: str) -> bool:
        """Whether the loader reads ``name`` as FP8 with block scales."""
        return (
            self.quantized
            and self.headers is not None
            and name.endswith(".weight")
            and f"{name}_scale_inv" in self.headers
        )

    def fused(self, cfg: ModelConfig) -> bool:
        first = next((i for i, sparse in enumerate(cfg.sparse_layers) if sparse), None)
        if self.headers is None or first is None:
            return False
        return f"model.layers.{first}.{cfg.moe_prefix}.experts.gate_up_proj" in self.headers

    def stored(self, name: str, shape: tuple) -> int:
        if self.headers is None:
            return math.prod(shape) * self.itemsize
        if name not in self.headers:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        info = self.headers.info(name)
        if tuple(info.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(info.shape)} but the config implies {shape}: "
                f"config.json does not describe these weights"
            )
        scales = self.headers.info(f"{name}_scale_inv") if self.fp8(name) else None
        return info.end - info.start + (0 if scales is None else scales.end - scales.start)


def _config_itemsize(model_dir: str) -> tuple[int, str]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if dtype not in CHECKPOINT_ITEMSIZE:
        raise CheckpointError(
            f"config.json field 'dtype' is {dtype!r}; expected one of {', '.join(CHECKPOINT_ITEMSIZE)}"
        )
    return CHECKPOINT_ITEMSIZE[dtype], dtype


def rank_tensors(cfg: ModelConfig, sizes: _Sizes, start: int, end: int) -> tuple[list[Tensor], list[Tensor]]:
    """(replicated, expert) tensors the loader reads on a rank owning experts [start, end)."""
    replicated = [Tensor(n, s, sizes.stored(n, s), math.prod(s)) for n, s in _replicated_shapes(cfg)]
    experts = [Tensor(n, s, sizes.stored(n, s), r) for n, s, r in _expert_shapes(cfg, start, end, sizes.fused(cfg))]
    return replicated, experts


def holding(cfg: ModelConfig, settings: Settings, sizes: _Sizes):
    """hold(replicated, experts, local experts) -> resident.Held, as the backend holds them: the GPU's
    bf16, or the CPU's at settings.cpu_weights (``cpu_settings`` resolved it)."""
    if settings.dtype != "fp32":
        return lambda replicated, experts, local: gpu_held(replicated, experts, DEVICE_ITEMSIZE[settings.dtype])
    cpu = CpuWeights(
        settings.cpu_weights,
        settings.int8_group or 0,
        bf16=lambda name: sizes.dtype(name) == "BF16",
        fp8=sizes.fp8,
        block_k=cfg.fp8.block_k if cfg.fp8 is not None else 0,
    )
    return partial(cpu_held, cfg, cpu=cpu)


def plan_weights(cfg: ModelConfig, sizes: _Sizes, ranks: int, hold, redundant: int = 0) -> tuple:
    """Each rank's weights as ``hold`` (``holding``) keeps them; with ``redundant`` EPLB slots its
    expert range is of physical slots."""
    out = []
    for rank in range(ranks):
        start, end = expert_shard(cfg.num_experts + redundant, rank, ranks)
        replicated, experts = rank_tensors(cfg, sizes, start, end)
        held = hold(replicated, experts, end - start)
        kinds = {k: held.replicated.get(k, 0) + held.experts.get(k, 0) for k in {**held.replicated, **held.experts}}
        out.append(
            RankWeights(
                rank=rank,
                expert_start=start,
                expert_end=end,
                read_bytes=sum(t.read for t in replicated + experts),
                replicated_bytes=sum(held.replicated.values()),
                expert_bytes=sum(held.experts.values()),
                lm_head_bytes=held.head,
                embed_bytes=held.embed,
                body_params=sum(t.params for t in replicated if t.name not in (EMBED, HEAD)),
                precisions=tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
            )
        )
    return tuple(out)


# -- KV pool ------------------------------------------------------------------------------------
def plan_kv(
    cfg: ModelConfig, settings: Settings, hardware: Hardware, weights: tuple, attention: str = "replicated"
) -> KVPlan:
    """The pool eprt/engine/startup.py sizes: --num-blocks, else what the GPU's memory leaves after the
    weights (eprt.ops.device.pool_blocks), at most enough for every slot to reach the context length;
    replicated attention: the ranks agree on the smallest pool; dp: each keeps its own, and they add up
    (``blocks`` stays the smallest: it bounds the context length)."""
    itemsize, bs = DEVICE_ITEMSIZE[settings.dtype], settings.block_size
    per_token = KVCache.bytes_per_block(cfg, 1, itemsize)
    per_block = KVCache.bytes_per_block(cfg, bs, itemsize)
    model_len = cfg.max_position_embeddings
    if settings.max_model_len is not None:
        model_len = min(settings.max_model_len, model_len)
    wanted = settings.max_batch * (model_len // bs + 1)
    window = window_spec(cfg, settings.prefill_chunk)  # windowed KV: each sequence's window blocks besides
    if window is not None:
        wanted += settings.max_batch * window.span(max(window.prefill_tokens, window.decode_tokens), bs)
    total = int(hardware.gpu_mem_gib * _GIB)
    rooms, problem = [], ""
    for w in weights:
        if settings.num_blocks:
            rooms.append(settings.num_blocks)
            continue
        used = w.resident_bytes + int(settings.reserved_gib * _GIB)
        usable = total * settings.gpu_memory_utilization
        if used > usable:
            rooms.append(None)
            problem = problem or does_not_fit(w, cfg, settings, hardware, weights)
            continue
        try:
            rooms.append(min(pool_blocks(total - used, total, per_block, settings.gpu_memory_utilization), wanted))
        except RuntimeError as e:
            rooms.append(None)
            problem = problem or f"rank {w.rank}: {e}"
    blocks = 0 if problem else min(rooms)
    max_len = 0 if problem else model_len
    if not problem:
        pool_len = blocks * bs - 1 if window is None else window.longest(blocks, bs)  # as startup._max_model_len
        if settings.max_model_len is not None and settings.max_model_len > pool_len:
            problem = (
                f"--max-model-len {settings.max_model_len} does not fit the KV pool of {blocks} blocks of {bs} "
                f"tokens (one sequence can hold at most {pool_len} tokens)"
            )
        elif pool_len < 2:
            problem = f"a KV pool of {blocks} blocks of {bs} tokens holds no sequence"
        max_len = 0 if problem else min(model_len, pool_len)
    tokens = sum(rooms) * bs if attention == "dp" and not problem else blocks * bs
    return KVPlan(per_token, per_block, tuple(rooms), blocks, tokens, max_len, problem)


def size(n: float) -> str:
    """Bytes as GiB, MiB, KiB or B, two decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def does_not_fit(w: RankWeights, cfg: ModelConfig, settings: Settings, hardware: Hardware, weights: tuple) -> str:
    """Why rank ``w`` has no room left for KV, naming what does not fit and what would help: the
    reserve alone, the weights every rank holds whatever the rank count, or the experts (then the
    rank count at which each rank's share of them fits)."""
    usable = hardware.gpu_mem_gib * _GIB * settings.gpu_memory_utilization
    reserved = settings.reserved_gib * _GIB
    gpu = (
        f"the {size(usable)} usable of a {hardware.gpu_mem_gib:g} GiB GPU at "
        f"gpu_memory_utilization={settings.gpu_memory_utilization:g}"
    )
    if reserved >= usable:
        return (
            f"rank {w.rank}: the reserved {settings.reserved_gib:g} GiB (--reserved-gib: CUDA context, activations) "
            f"alone exceeds {gpu}: more ranks do not help; lower --reserved-gib or give the GPU's real --gpu-mem-gib"
        )
    head = (
        f"rank {w.rank}: its weights ({size(w.resident_bytes)}: {size(w.replicated_bytes)} replicated, "
        f"{size(w.expert_bytes)} experts) and the reserved {settings.reserved_gib:g} GiB "
        f"exceed {gpu}"
    )
    room = usable - reserved - w.replicated_bytes  # what this rank's experts may take
    slots = cfg.num_experts + settings.num_redundant_experts
    per_expert = sum(r.expert_bytes for r in weights) / slots
    if room < per_expert:
        what = "the replicated weights (attention, embeddings, norms" + (", the LM head)" if w.lm_head_bytes else ")")
        return (
            f"{head}: {what}, which every rank holds, leave no room for even one expert: more ranks do not "
            f"help; a GPU with more memory does"
        )
    ranks = -(-slots // int(room // per_expert))
    return f"{head}: the experts do not fit: use at least {ranks} ranks (each then holds at most its share)"


# -- wire ---------------------------------------------------------------------------------------
def frame_bytes(words: int, ranks: int, frame_words: int = DEFAULT_FRAME_WORDS) -> int:
    """Bytes a flush of ``words`` command words broadcasts: the fixed buffer (count word first),
    plus one more broadcast of the rest when they do not fit (docs/protocol.md, "Framing")."""
    if ranks == 1 or words == 0:
        return 0
    return 4 * max(frame_words, words + 1)


def combine_received(rows: int, hidden: int, ranks: int, eplb: bool = False) -> tuple[int, str]:
    """Bytes the busiest rank receives in one MoE combine of float32 [rows, hidden] partials
    (eprt/comm/mpi_transport.py: an all-gather, or on 3+ ranks for partials of 1 MiB and more a
    reduce-scatter then an all-gather of the sums). Under EPLB ``rows`` are every rank's (token,
    choice) rows together and each rank all-gathers only its own; counted as split evenly, the
    busiest rank receiving all but its rows // ranks (docs/eplb.md)."""
    if ranks == 1:
        return 0, "none (one rank)"
    if eplb:
        return 4 * hidden * (rows - rows // ranks), "all-gather of each rank's rows"
    n = rows * hidden
    if ranks < 3 or 4 * n < REDUCE_SCATTER_MIN_BYTES:
        return 4 * (ranks - 1) * n, "all-gather"
    counts = [(r + 1) * n // ranks - r * n // ranks for r in range(ranks)]
    return max(4 * ((ranks - 1) * c + n - c) for c in counts), "reduce-scatter + all-gather"


def moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.sparse_layers)


def decode_wire(cfg: ModelConfig, batch: int, ranks: int, eplb: bool = False) -> Wire:
    """``eplb``: combines of one row per (token, choice) (docs/eplb.md)."""
    words = len(encode(DecodeBatch(tuple(range(batch)), (0,) * batch)))
    combine, how = combine_received(batch * (cfg.top_k if eplb else 1), cfg.hidden_size, ranks, eplb)
    return Wire(frame_bytes(words, ranks), moe_layers(cfg) * combine, how)


def prefill_wire(cfg: ModelConfig, chunk: int, ranks: int, eplb: bool = False) -> Wire:
    """One later chunk (PREFILL_NEXT) of ``chunk`` prompt tokens; divide by ``chunk`` for per token."""
    words = len(encode(PrefillNext(0, chunk, (0,) * chunk)))
    combine, how = combine_received(chunk * (cfg.top_k if eplb else 1), cfg.hidden_size, ranks, eplb)
    return Wire(frame_bytes(words, ranks), moe_layers(cfg) * combine, how)


# -- roofline -----------------------------------------------------------------------------------
def experts_touched(local: int, cfg: ModelConfig, batch: int) -> float:
    """Expected distinct local experts a step of ``batch`` tokens routes to, under uniform routing."""
    return local * (1.0 - (1.0 - cfg.top_k / cfg.num_experts) ** batch)


def step_bound(
    cfg: ModelConfig, w: RankWeights, batch: int, settings: Settings, hardware: Hardware, wire: Wire
) -> StepBound:
    """Lower bounds of one decode step on rank ``w.rank``: the bytes it must read from HBM, receive
    over the link, and the FLOPs it must do, each at its peak; the step takes at least the largest.
    The weights' bytes are the resident ones (``RankWeights``: the backend's precisions)."""
    D, V, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    expert_elems = 3 * D * cfg.moe_intermediate_size  # one expert, one layer
    held = w.expert_end - w.expert_start  # slots
    slots = cfg.num_experts + settings.num_redundant_experts
    local = held * cfg.num_experts / slots  # expected share of the experts' tokens
    expert_bytes = w.expert_bytes / (held * moe_layers(cfg)) if moe_layers(cfg) else 0  # one, as held
    body_bytes = w.replicated_bytes - w.embed_bytes - w.lm_head_bytes  # read per step, all layers
    head_elems, head_bytes = V * D, w.lm_head_bytes or w.embed_bytes  # only rank 0 computes logits
    logits = w.rank == 0
    kv_read = batch * settings.context * KVCache.bytes_per_block(cfg, 1, DEVICE_ITEMSIZE[settings.dtype])
    hbm = (
        body_bytes
        + batch * w.embed_bytes // V  # the batch's embedding rows
        + (head_bytes if logits else 0)
        + moe_layers(cfg) * experts_touched(local, cfg, batch) * expert_bytes
        + kv_read
    )
    routed = batch * cfg.top_k * local / cfg.num_experts  # expected (token, local expert) pairs per layer
    attention = 4 * batch * settings.context * cfg.num_heads * cfg.head_dim * layers
    flops = 2 * batch * (w.body_params + (head_elems if logits else 0)) + 2 * routed * expert_elems * moe_layers(cfg)
    flops += attention
    times = {
        "HBM": hbm / (hardware.hbm_tbps * 1e12),
        "link": wire.total / (hardware.link_gbps * 1e9),
        "compute": flops / (hardware.tflops * 1e12),
    }
    binding = max(times, key=times.get)
    return StepBound(
        batch=batch,
        rank=w.rank,
        hbm_bytes=int(hbm),
        wire_bytes=wire.total,
        flops=int(flops),
        hbm_s=times["HBM"],
        link_s=times["link"],
        compute_s=times["compute"],
        bound_s=times[binding],
        binding=binding,
    )


# -- the plan -----------------------------------------------------------------------------------
def check_settings(cfg: ModelConfig, settings: Settings, hardware: Hardware, attention: str) -> None:
    if attention not in ("replicated", "dp"):
        raise ValueError(f"--attention must be replicated or dp, got {attention!r}")
    if settings.num_redundant_experts < 0:
        raise ValueError(f"--num-redundant-experts must be >= 0, got {settings.num_redundant_experts}")
    slots = cfg.num_experts + settings.num_redundant_experts
    if not 1 <= settings.ranks <= slots:
        bound = f"num_experts={cfg.num_experts}" + (
            f" + {settings.num_redundant_experts} redundant" if slots > cfg.num_experts else ""
        )
        raise ValueError(f"--ranks must be in [1, {bound}], got {settings.ranks}")
    if settings.dtype not in DEVICE_ITEMSIZE:
        raise ValueError(f"--dtype must be bf16 or fp32, got {settings.dtype!r}")
    for name in ("max_batch", "block_size", "prefill_chunk"):
        if getattr(settings, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    for name in ("num_blocks", "context"):
        if getattr(settings, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(settings, name)}")
    if settings.max_model_len is not None and settings.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {settings.max_model_len}")
    if not 0.0 < settings.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {settings.gpu_memory_utilization}")
    if settings.reserved_gib < 0:
        raise ValueError(f"--reserved-gib must be >= 0, got {settings.reserved_gib}")
    for name in ("gpu_mem_gib", "hbm_tbps", "link_gbps", "tflops"):
        if not getattr(hardware, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(hardware, name)}")


def cpu_precision(dtype: str, choice: str | None) -> str | None:
    """The CPU backend's --cpu-weights (``dtype`` fp32; None: EPRT_CPU_WEIGHTS, as the engine reads it),
    checked; None for the GPU backend, which takes no --cpu-weights."""
    if dtype == "fp32":
        return cpu_weights.precision_choice(choice)
    if choice is not None:
        raise ValueError(
            f"--cpu-weights {choice} is the CPU backend's (--dtype fp32); --dtype {dtype} is the GPU backend, "
            f"which holds its weights in bf16: drop --cpu-weights or give --dtype fp32"
        )
    return None


def cpu_settings(settings: Settings) -> Settings:
    """``settings`` with the CPU backend's weights resolved as the engine resolves them: --cpu-weights
    and, for int8, its k group (None: EPRT_CPU_INT8_GROUP; 32 or 64)."""
    precision = cpu_precision(settings.dtype, settings.cpu_weights)
    group = settings.int8_group
    if group is not None and precision != "int8":
        raise ValueError(f"int8_group {group} is --cpu-weights int8's, but the CPU weights are {precision}")
    if precision == "int8":
        group = cpu_weights.int8_group() if group is None else group
        if group not in cpu_weights.INT8_GROUPS:
            raise ValueError(f"int8_group must be one of {cpu_weights.INT8_GROUPS}, got {group}")
    return replace(settings, cpu_weights=precision, int8_group=group)


def make_plan(
    model_dir: str, cfg: ModelConfig, settings: Settings, hardware: Hardware, attention: str = "replicated"
) -> Plan:
    check_settings(cfg, settings, hardware, attention)
    settings = cpu_settings(settings)
    sizes = _Sizes(model_dir, quantized=cfg.fp8 is not None)
    hold = holding(cfg, settings, sizes)
    weights = plan_weights(cfg, sizes, settings.ranks, hold, settings.num_redundant_experts)
    kv = plan_kv(cfg, settings, hardware, weights, attention)
    eplb = settings.num_redundant_experts > 0
    wires = tuple(decode_wire(cfg, b, settings.ranks, eplb) for b in DECODE_BATCHES)
    bounds = tuple(
        max((step_bound(cfg, w, b, settings, hardware, wire) for w in weights), key=lambda s: s.bound_s)
        for b, wire in zip(DECODE_BATCHES, wires)
    )
    return Plan(
        model=model_dir.rstrip("/").split("/")[-1],
        model_type=cfg.model_type,
        ranks=settings.ranks,
        attention=attention,
        settings=settings,
        hardware=hardware,
        weight_source=sizes.source,
        params=sum(t.params for t in sum(rank_tensors(cfg, sizes, 0, cfg.num_experts), [])),
        weights=weights,
        kv=kv,
        decode_wire=wires,
        prefill_wire=prefill_wire(cfg, settings.prefill_chunk, settings.ranks, eplb),
        decode=bounds,
    )
