"""Starting a rank (``launch_engine`` in eprt/engine/engine.py runs these in turn): its world and
logging (``open_rank``), its backend, model and executor in lock-step with the other ranks
(``start``: eprt/engine/startup.py), then either a worker's command loop (``serve_worker``,
which never returns) or rank 0's runner and scheduler settings (``rank0_runner``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

from eprt.comm.logging import setup_logging
from eprt.comm.recorder import Recorder
from eprt.comm.transport import StartupFailed
from eprt.comm.worker import run_worker
from eprt.comm.world import open_transport
from eprt.engine.adapter_slots import LoraAdapters
from eprt.engine.adapters import AdapterRegistry
from eprt.engine.config import EngineConfig
from eprt.engine.runner import ModelRunner
from eprt.engine.startup import Started, prefill_budget, start_rank
from eprt.engine.structured import GrammarCompiler, GuidedRows
from eprt.ops.device import bind_local_gpu, device_choice
from eprt.scheduler.config import SchedulerConfig

log = logging.getLogger("eprt.engine")


def open_rank(cfg: EngineConfig, transport=None) -> tuple:
    """(this rank's transport, its device): the device chosen (a GPU bound before MPI initialises:
    a CUDA-aware MPI must see the right GPU), the world opened, logging, the flight recorder."""
    device, why = device_choice(cfg.device)
    if device == "cuda":
        bind_local_gpu()
    transport = open_transport() if transport is None else transport
    setup_logging(transport.rank, cfg.log_all_ranks or None)
    log.info("device %s (%s)", device, why)
    transport.dump_dir = cfg.dump_dir
    if cfg.record_payloads:
        transport.recorder = Recorder(
            transport.rank, transport.size, payload_dir=os.path.join(cfg.dump_dir, "payloads")
        )
    signal.signal(signal.SIGUSR2, lambda signum, frame: transport.dump_frames("SIGUSR2"))
    return transport, device


def start(cfg: EngineConfig, device: str, transport, check=None) -> Started:
    """This rank's backend, model and executor (``start_rank``), after rank 0's ``check`` of its input
    (``precheck``); a worker leaves when any rank could not start (rank 0 names them). What eprt
    replay needs to rebuild the executor goes into the flight recorder."""
    try:
        precheck(transport, check)
        started = start_rank(cfg, device, transport)
    except StartupFailed:
        if transport.rank != 0:
            sys.exit(2)  # rank 0 reports every failing rank, and exits 2 (launchers OR the codes)
        raise
    ops, loaded, executor = started.ops, started.loaded, started.executor
    transport.recorder.meta = {  # what eprt replay needs to rebuild this rank's executor
        "model": cfg.model,
        "backend": ops.name,
        "cpu_weights": getattr(ops, "precision", None),  # the CPU weights' precision (int8 changes the bits)
        "num_blocks": executor.pool_blocks,  # KV blocks plus those recurrent-state snapshots take
        "block_size": cfg.block_size,
        "max_slots": cfg.max_batch,
        "prefix_cache": cfg.prefix_cache,
        "image_token_id": executor.image_token_id,
        "vocab_size": loaded.config.vocab_size,
        "rope_len": loaded.model.max_len,
        "mtp": executor.mtp,  # the MTP layer (VERIFY_MTP) is loaded
        "prefill_tokens": prefill_budget(cfg, ops.name, loaded.config),  # bounds what a windowed-KV sequence reserves
    }
    log.info(
        "rank %d/%d: %s on %s, experts [%d, %d), %d KV blocks of %d tokens, KV %d bytes/token (%s), "
        "read %d tensors (%.1f MB)",
        transport.rank,
        transport.size,
        loaded.name,
        ops.name,
        loaded.model.w.expert_start,
        loaded.model.w.expert_end,
        executor.blocks.num_blocks,
        cfg.block_size,
        executor.kv.allocated_bytes_per_token,
        "MLA latent" if loaded.config.mla is not None else "K+V",
        loaded.tensors_read,
        loaded.bytes_read / 1e6,
    )
    return started


def precheck(transport, check) -> None:
    """Rank 0's ``check()`` of what only rank 0 reads (an input file), before any rank loads the
    model: its ValueError or OSError leaves every rank at once (a world of one: raised as is)."""
    if check is None:
        return
    error = None
    if transport.rank == 0:
        try:
            check()
        except (ValueError, OSError) as e:
            if transport.size == 1:
                raise
            error = str(e)
    transport.startup_barrier(error)


def serve_worker(cfg: EngineConfig, transport, started: Started) -> NoReturn:
    """A worker rank: serve rank 0's command stream, then leave (0 after SHUTDOWN, 1 after a failure)."""
    # mpiexec and srun forward SIGINT/SIGTERM to every rank; only rank 0 decides when the
    # job ends (it finishes what is in flight, then sends SHUTDOWN), so workers ignore them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started.executor.compute_logits = False
    code = run_worker(transport, started.executor, cfg.max_batch, started.loaded.config.vocab_size)
    close_transport(transport, cfg)
    sys.exit(code)


def rank0_runner(cfg: EngineConfig, device: str, transport, started: Started) -> tuple:
    """Rank 0: (its ModelRunner over this rank's executor, the scheduler's settings)."""
    loaded, executor = started.loaded, started.executor
    model_cfg = loaded.config
    spec = cfg.speculative()
    if spec is not None and model_cfg.is_hybrid:
        raise ValueError(
            f"--speculative-method {spec.method}: {model_cfg.model_type} keeps recurrent state, "
            "which cannot roll back rejected drafts"
        )
    if cfg.overlap and executor.dp:
        log.info("--overlap is off under --attention dp (its decode steps run on each row's owner)")
    runner = ModelRunner(
        executor,
        transport,
        seed=cfg.seed,
        drafter=None if spec is None else spec.drafter(),
        batch_prefill=cfg.batch_prefill,
        adapters=_adapters(cfg, executor),
        overlap=cfg.overlap and not executor.dp,
    )
    if runner.overlap is not None:
        log.info(
            "overlap: decode steps' forward passes %s while rank 0 plans their sampling",
            "with rows for the host sampler run on a helper thread" if runner.overlap.threaded else "are launched",
        )
    eos = tuple(loaded.tokenizer.eos_token_ids if loaded.tokenizer is not None else model_cfg.eos_token_ids)
    runner.set_guides(GuidedRows(GrammarCompiler(loaded.tokenizer, model_cfg.vocab_size, eos)))
    sched_cfg = SchedulerConfig(
        vocab_size=model_cfg.vocab_size,
        eos_token_ids=eos,
        max_batch=cfg.max_batch,
        max_prefill_tokens=prefill_budget(cfg, device, model_cfg),
        block_size=cfg.block_size,
        max_model_len=started.max_model_len,
        num_speculative_tokens=0 if spec is None else spec.num_tokens,
    )
    chunks = f"{sched_cfg.max_prefill_tokens} tokens" if sched_cfg.max_prefill_tokens else "whole prompts"
    chunks += " per owner rank" if executor.dp and sched_cfg.max_prefill_tokens else ""
    log.info("max_model_len %d, prefill chunks of %s, up to %d sequences", started.max_model_len, chunks, cfg.max_batch)
    runner.sampler.eos_token_ids, runner.sampler.logprobs_mode = eos, cfg.logprobs_mode
    return runner, sched_cfg


def _adapters(cfg: EngineConfig, executor) -> LoraAdapters | None:
    """Rank 0's adapters: --lora-modules registered (each checked by reading rank 0's share)."""
    if executor.lora is None:
        return None
    registry = AdapterRegistry(cfg.max_loras, validate=executor.lora.read)
    for name, path in cfg.lora_modules:
        registry.register(name, path, check=False)  # every rank read it at start-up
        log.info("LoRA adapter %r from %s", name, path)
    return LoraAdapters(registry)


def close_transport(transport, cfg: EngineConfig) -> None:
    """Close the transport after writing the flight recorder when asked to (with payloads, always:
    the header is what eprt replay reads)."""
    if cfg.dump_frames or cfg.record_payloads:
        transport.dump_frames("shutdown")
    transport.close()
