"""Bringing one rank up in lock-step with the others (docs/design.md, "One command stream"):
every step that can fail on one rank runs inside ``step``, which ends with
``Transport.startup_barrier``, so the job ends on every rank with the failing ranks named.
Steps: backend and kernels, model; identical arithmetic across ranks; one KV pool size; allocation.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eprt import env
from eprt.cache.window import WindowSpec
from eprt.comm.alltoall import AllToAllExchange
from eprt.comm.device_combine import DeviceCombine, choose_combine
from eprt.comm.dp_combine import DpExchange
from eprt.comm.transport import StartupFailed, Transport
from eprt.engine.config import ALLTOALL_MIN_RANKS, DEFAULT_MULTI_RANK_ATTENTION, EngineConfig
from eprt.engine.cuda_graphs import DecodeGraphs
from eprt.engine.dp_executor import dp_executor
from eprt.engine.eplb import check_same_placement, count_nodes, initial_placement
from eprt.engine.executor import ShardExecutor, window_spec
from eprt.engine.runner import PREFILL_GROUP_TOKENS
from eprt.model.kv_cache import KVCache
from eprt.model.loader import LoadedModel, expert_shard, load_model
from eprt.model.lora import LoraSlots
from eprt.ops.base import Ops
from eprt.ops.device import compute_identity, get_ops

log = logging.getLogger("eprt.engine")


CPU_KV_MEMORY_FRACTION = 0.5  # of the memory available after loading, for the default CPU KV pool


@dataclass
class Started:
    ops: Ops
    loaded: LoadedModel
    executor: ShardExecutor
    max_model_len: int  # prompt + generated tokens per sequence: the model's, bounded by the KV pool
    nodes: int = 1  # nodes of the job (EPLB's hierarchical policy)


def _load(cfg: EngineConfig, device: str, transport: Transport, nodes: int):
    """This rank's backend (warmed up, described in the log) and its shard of the model."""
    ops = get_ops(device, cfg.cpu_weights, cfg.cpu_threads)
    ops.warm_up()
    if ops.describe():
        log.info("%s backend: %s", ops.name, ops.describe())
    rank, world = transport.rank, transport.size
    placement_for = lambda model_cfg: initial_placement(cfg.eplb, model_cfg, world, nodes)  # noqa: E731
    combine, gather_rows = _combine(transport, ops)
    mtp = cfg.speculative_method == "mtp"
    return ops, load_model(cfg.model, ops, cfg.max_model_len, rank, world, combine, placement_for, gather_rows, mtp=mtp)


def _exchange_and_graphs(cfg: EngineConfig, started: Started, transport: Transport, dp: bool) -> None:
    """The MoE exchange (--moe-exchange), then on a GPU with replicated attention the decode steps'
    metadata buffer and CUDA graphs, captured with the exchange the steps will run."""
    exchange, why = choose_exchange(cfg, transport.size, dp)
    log.info("MoE exchange %s (%s)", exchange, why)
    executor = started.executor
    if exchange == "alltoall":
        use_alltoall(started.loaded.model, transport, started.ops, getattr(executor, "exchange", None) if dp else None)
    if started.ops.name == "cuda" and not dp:
        _decode_graphs(cfg, executor, transport.rank)


def start_rank(cfg: EngineConfig, device: str, transport: Transport) -> Started:
    """This rank's backend, model and executor; StartupFailed (on every rank) if any rank failed."""
    rank, world = transport.rank, transport.size

    def step(fn: Callable):
        try:
            value, error = fn(), None
        except Exception as e:
            if world == 1:
                raise
            value, error = None, f"{type(e).__name__}: {e}"
        transport.startup_barrier(error)
        return value

    nodes = count_nodes(transport, cfg.eplb) if cfg.eplb.active else 1

    ops, loaded = step(lambda: _load(cfg, device, transport, nodes))
    if cfg.eplb.active:
        placement = loaded.model.slots.placement
        step(lambda: check_same_placement(transport, placement))
        start, end = placement.rank_range(rank)
        log.info("rank %d: EPLB expert slots [%d, %d) of %d, %d node(s)", rank, start, end, placement.num_slots, nodes)
    sharers = _check_identities(transport, step(lambda: compute_identity(ops)))
    blocks = step(lambda: _kv_blocks(cfg, ops, loaded.config, loaded.model.max_len, sharers))
    every = [int(b) for b in transport.allgather_text(str(blocks))]
    agreed = min(every)
    mode, why = choose_attention(cfg, world, loaded.config, ops.name)
    log.info("attention %s (%s)", mode, why)
    dp = mode == "dp"
    if dp:
        step(lambda: check_dp_features(cfg, loaded.config))
    if agreed < blocks and not dp:
        log.info("rank %d: KV pool of %d blocks, the smallest over the ranks (room here for %d)", rank, agreed, blocks)
    prefill_tokens = prefill_budget(cfg, device, loaded.config)
    window = window_spec(loaded.config, prefill_tokens)
    max_model_len = step(lambda: _max_model_len(cfg, loaded.model.max_len, agreed, window))
    executor = step(lambda: _executor(cfg, ops, loaded, transport, every if dp else agreed, prefill_tokens))
    log.info("%s", kv_capacity_line(cfg.block_size, every if dp else [executor.blocks.num_blocks], dp))
    started = Started(ops, loaded, executor, max_model_len, nodes)
    _exchange_and_graphs(cfg, started, transport, dp)
    if executor.lora is not None:  # every rank reads its share of each adapter once, so a bad one fails here
        step(lambda: [executor.lora.read(path) for _, path in cfg.lora_modules])
    return started


def _executor(
    cfg: EngineConfig, ops, loaded: LoadedModel, transport: Transport, blocks, prefill_tokens: int
) -> ShardExecutor:
    """This rank's executor: ``blocks``, every rank's pool sizes under dp attention (each sequence's
    KV lives on its owner only), else the one pool size every rank agreed on; ``prefill_tokens``:
    the largest prefill chunk (what a windowed-KV sequence reserves)."""
    lora = _lora_slots(cfg, ops, loaded)
    model, bs, slots = loaded.model, cfg.block_size, cfg.max_batch
    if isinstance(blocks, list):
        exchange = DpExchange(transport, ops.xp)
        return dp_executor(
            model, blocks, bs, slots, exchange, cfg.prefix_cache, cfg.image_token_id, lora, prefill_tokens
        )
    return ShardExecutor(
        model, blocks, bs, slots, cfg.prefix_cache, cfg.image_token_id, lora=lora, prefill_tokens=prefill_tokens
    )


def _decode_graphs(cfg: EngineConfig, executor: ShardExecutor, rank: int) -> None:
    """The GPU's decode and verify steps: one metadata copy, and with --cuda-graphs on every bucket
    of rows captured now, the same on every rank (rank 0 computes the logits, the workers do not)."""
    executor.compute_logits = rank == 0
    spec = cfg.speculative()
    rows = cfg.max_batch * (1 + (spec.num_tokens if spec is not None else 0))  # a verify step's positions
    graphs = executor.passes.graphs = DecodeGraphs(executor, rows, cfg.cuda_graphs, cfg.record_payloads)
    graphs.capture_all()
    if not cfg.cuda_graphs:
        log.info("CUDA graphs off (--cuda-graphs off): every decode kernel launched from Python")
    elif graphs.unable is not None:
        log.info("CUDA graphs off: %s (every decode kernel launched from Python)", graphs.unable)


def _lora_slots(cfg: EngineConfig, ops, loaded: LoadedModel):
    """This rank's LoRA slots (its experts' share of each adapter), or None without --lora-modules / --enable-lora."""
    if not cfg.lora_enabled:
        return None
    w = loaded.model.w
    experts = not cfg.eplb.active  # EPLB's physical slots: no LoRA on the routed experts
    return LoraSlots(ops, loaded.config, cfg.max_loras, cfg.max_lora_rank, w.expert_start, w.expert_end, experts)


def dp_unserved(cfg: EngineConfig, model_cfg) -> list[str]:
    """What of this job dp attention does not serve yet: MTP speculation and hybrid models."""
    unserved = [
        ("--speculative-method mtp", cfg.speculative_method == "mtp"),
        (f"a {model_cfg.model_type} checkpoint (recurrent state)", model_cfg.is_hybrid),
    ]
    return [what for what, on in unserved if on]


def check_dp_features(cfg: EngineConfig, model_cfg) -> None:
    """An explicit --attention dp with something it does not serve: a clear start-up error naming
    the flag instead of a wrong answer."""
    for what in dp_unserved(cfg, model_cfg):
        raise ValueError(f"--attention dp does not serve {what} yet; use --attention replicated")


def choose_attention(cfg: EngineConfig, world: int, model_cfg, device: str = "cpu") -> tuple[str, str]:
    """The job's attention mode and why (logged at start-up): --attention dp or replicated as given;
    auto picks replicated on one rank, with --record-payloads, with --overlap on (dp runs no
    overlap), on a GPU with --cuda-graphs on (dp's decode steps run without graphs), or when the job
    uses something dp does not serve, else DEFAULT_MULTI_RANK_ATTENTION (``device``: the backend's name).
    Every rank decides the same from the same flags and checkpoint."""
    if cfg.attention != "auto":
        return cfg.attention, f"--attention {cfg.attention}"
    if world == 1:
        return "replicated", "auto: one rank"
    if cfg.record_payloads:
        return "replicated", "auto: --record-payloads (eprt replay rebuilds replicated attention only)"
    if cfg.overlap:
        return "replicated", "auto: --overlap on (dp attention's decode steps run without overlap)"
    if device == "cuda" and cfg.cuda_graphs:
        return "replicated", "auto: --cuda-graphs on (dp attention's decode steps run without CUDA graphs)"
    unserved = dp_unserved(cfg, model_cfg)
    if unserved:
        return "replicated", f"auto: dp does not serve {', '.join(unserved)} yet"
    if DEFAULT_MULTI_RANK_ATTENTION != "dp":
        return "replicated", "auto: dp does not win benchmarks/bench_ep.py yet (DEFAULT_MULTI_RANK_ATTENTION)"
    return "dp", f"auto: {world} ranks, and dp serves everything this job uses"


def choose_exchange(cfg: EngineConfig, world: int, dp: bool) -> tuple[str, str]:
    """The job's MoE exchange and why (logged at start-up): --moe-exchange as given; auto picks
    alltoall under dp attention from ALLTOALL_MIN_RANKS ranks on, when the job uses nothing it does
    not serve, else allgather (under replicated attention alltoall moves fewer bytes but runs two
    collectives a layer where allgather runs one, and lost benchmarks/bench_ep.py's step time:
    docs/design.md, "All-to-all MoE exchange"). Every rank decides the same from the same flags."""
    if cfg.moe_exchange != "auto":
        return cfg.moe_exchange, f"--moe-exchange {cfg.moe_exchange}"
    if world < ALLTOALL_MIN_RANKS:
        return "allgather", f"auto: {world} rank(s), fewer than {ALLTOALL_MIN_RANKS} (benchmarks/bench_ep.py)"
    if not dp:
        return "allgather", "auto: replicated attention (alltoall wins benchmarks/bench_ep.py under dp attention only)"
    unserved = cfg.alltoall_unserved()
    if unserved:
        return "allgather", f"auto: alltoall does not serve {', '.join(unserved)} yet"
    return "alltoall", f"auto: dp attention on {world} ranks (from {ALLTOALL_MIN_RANKS} on: benchmarks/bench_ep.py)"


def use_alltoall(model, transport: Transport, ops: Ops, dp_exchange=None) -> None:
    """Run ``model``'s MoE layers through the all-to-all exchange (``dp_exchange``: dp attention's):
    on GPU ranks with the NCCL combine, by NCCL send/recv on the device; else through the host."""
    device = model.combine if isinstance(model.combine, DeviceCombine) and hasattr(model.combine.comm, "send") else None
    log.info("MoE all-to-all: %s", "NCCL send/recv on the device" if device is not None else "through the host")
    model.alltoall = AllToAllExchange(transport, ops.xp, dp_exchange, device)
    if model.slots is None:  # EPLB's slots name their ranks themselves
        E, P = model.cfg.num_experts, transport.size
        sizes = [b - a for a, b in (expert_shard(E, r, P) for r in range(P))]
        model.expert_rank = np.repeat(np.arange(P), sizes)


def kv_capacity_line(block_size: int, pools: list[int], dp: bool) -> str:
    """The start-up line stating the job's KV capacity in tokens: under dp attention the sum of the
    ranks' pools (each sequence on one owner), else one pool (replicated on every rank)."""
    tokens = sum(pools) * block_size
    if dp:
        each = " + ".join(str(b) for b in pools)
        return f"KV capacity {tokens} tokens (attention dp: the ranks' pools, {each} blocks of {block_size} tokens)"
    return f"KV capacity {tokens} tokens (attention replicated: {pools[0]} blocks of {block_size} tokens on every rank)"


def _check_identities(transport: Transport, mine: tuple[str, str]) -> int:
    """Refuse ranks that do not compute identically (``mine``: this rank's compute_identity);
    returns how many ranks share this rank's device. Nothing here can fail on one rank only:
    every rank decides from the same gathered texts."""
    identity, device_key = mine[0][:300], mine[1][:150]  # the JSON fits the exchange's 480 bytes
    every = [json.loads(t) for t in transport.allgather_text(json.dumps([identity, device_key]))]
    differ = [
        (
            r,
            f"it computes with {i!r}, rank 0 with {every[0][0]!r}; expert parallelism needs "
            f"identical arithmetic on every rank (same GPU model and CUDA/CuPy, or the same NumPy/BLAS)",
        )
        for r, (i, _) in enumerate(every)
        if i != every[0][0]
    ]
    if differ:
        raise StartupFailed(differ)
    return sum(key == device_key for _, key in every)


def _combine(transport: Transport, ops: Ops):
    """The MoE combine for this backend and EPLB's row gather (``gather_rows(rows, counts)``: every
    rank's rows in rank order), chosen once and logged: on GPUs ``device_combine.choose_combine``
    (NCCL on the device, or pinned host buffers where NCCL cannot run: EPRT_COMBINE), else the
    transport's host sum."""
    if transport.size == 1:
        return (lambda partial: partial), (lambda rows, counts: rows)
    if ops.name == "cpu":
        return transport.allsum, transport.allgather_rows
    return choose_combine(transport, ops, env.COMBINE.get())


def prefill_budget(cfg: EngineConfig, device: str, model_cfg) -> int:
    """Prompt tokens a tick prefills: ``--max-prefill-tokens`` (by device; 0: whole prompts), with
    windowed KV at most PREFILL_GROUP_TOKENS, which bounds the window blocks a prompt reserves while
    it is prefilled (docs/design.md, "Sliding-window KV")."""
    tokens = cfg.prefill_tokens(device)
    if model_cfg.windowed_kv and not 0 < tokens <= PREFILL_GROUP_TOKENS:
        return PREFILL_GROUP_TOKENS
    return tokens


def _kv_blocks(cfg: EngineConfig, ops: Ops, model_cfg, model_len: int, sharers: int = 1) -> int:
    """KV blocks this rank has room for (before the ranks agree on the smallest): ``--num-blocks``,
    else enough for every slot to reach the context length, within this rank's share of memory."""
    if cfg.num_blocks:
        return cfg.num_blocks
    wanted = cfg.max_batch * (model_len // cfg.block_size + 1)
    window = window_spec(model_cfg, prefill_budget(cfg, ops.name, model_cfg))
    if window is not None:  # and each slot's window (a prefill chunk's at most)
        wanted += cfg.max_batch * window.span(max(window.prefill_tokens, window.decode_tokens), cfg.block_size)
    per_block = KVCache.bytes_per_block(model_cfg, cfg.block_size, ops.kv_itemsize)
    if cfg.speculative_method == "mtp":  # the MTP layer's KV: one more attention layer in every block
        per_block += per_block // model_cfg.num_attention_layers
    if ops.name != "cpu":
        from eprt.ops.device import kv_pool_blocks

        return min(kv_pool_blocks(per_block, cfg.gpu_memory_utilization, sharers), wanted)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(wanted, int(available * CPU_KV_MEMORY_FRACTION / sharers) // per_block))


def _max_model_len(cfg: EngineConfig, model_len: int, blocks: int, window: WindowSpec | None = None) -> int:
    """The context length: ``--max-model-len`` (refused when the pool cannot hold one such
    sequence), else the model's, bounded by what one sequence can hold of the pool (with windowed
    KV, its window's blocks too)."""
    pool_len = blocks * cfg.block_size - 1  # a sequence of L tokens holds L // block_size + 1 blocks
    if window is not None:
        pool_len = window.longest(blocks, cfg.block_size)
    if cfg.max_model_len is not None:
        if cfg.max_model_len > pool_len:
            raise ValueError(
                f"--max-model-len {cfg.max_model_len} does not fit the KV pool of {blocks} blocks of "
                f"{cfg.block_size} tokens (one sequence can hold at most {pool_len} tokens): lower "
                f"--max-model-len or give the pool more room (--num-blocks, --gpu-memory-utilization)"
            )
        return min(cfg.max_model_len, model_len)
    if pool_len < 2:
        raise ValueError(f"a KV pool of {blocks} blocks of {cfg.block_size} tokens holds no sequence")
    if pool_len < model_len:
        log.info(
            "max_model_len %d: the model's %d, bounded by the KV pool (%d blocks of %d tokens)",
            pool_len,
            model_len,
            blocks,
            cfg.block_size,
        )
    return min(model_len, pool_len)
