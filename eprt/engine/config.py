"""EngineConfig and the command-line flags every entry point shares."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from eprt import env

# Prompt tokens per prefill chunk by default: a long prompt shares the step with the decoding
# sequences instead of stalling them (README, "Measured figures": 648 ms vs 92 ms worst gap).
DEFAULT_PREFILL_TOKENS = {"cpu": 512, "cuda": 2048}
ATTENTION_MODES = ("dp", "replicated")
# --attention by default at world size > 1 (one rank is always replicated): benchmarks/bench_ep.py decides
DEFAULT_MULTI_RANK_ATTENTION = "replicated"


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the built-in default model
    device: str = "auto"  # cpu | cuda | auto (cuda when usable)
    max_batch: int = 32  # sequence slots (decode batch size)
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks per rank; 0: every slot can reach max_model_len, within memory
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's, bounded by the KV pool
    max_prefill_tokens: int | None = None  # prompt tokens per prefill chunk; None: by device; 0: whole prompts
    prefix_cache: bool = True
    gpu_memory_utilization: float = 0.9
    image_token_id: int | None = None
    seed: int = 0
    log_all_ranks: bool = False
    dump_dir: str = "eprt-dumps"  # the flight recorder's files (docs/observability.md)
    dump_frames: bool = False  # also write them at shutdown
    record_payloads: bool = False  # record every frame, row and combine with its data, for eprt replay
    attention: str | None = None  # dp | replicated; None: attention_mode() by world size

    def attention_mode(self, world: int) -> str:
        """dp (each sequence's attention and KV on one owner rank) or replicated (on every rank)."""
        if self.attention is not None:
            return self.attention
        return DEFAULT_MULTI_RANK_ATTENTION if world > 1 and not self.record_payloads else "replicated"

    def validate(self) -> None:
        for name in ("max_batch", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.num_blocks < 0 or (self.max_prefill_tokens or 0) < 0:
            raise ValueError("--num-blocks and --max-prefill-tokens must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention not in (None, *ATTENTION_MODES):
            raise ValueError(f"--attention must be dp or replicated, got {self.attention!r}")
        if self.attention == "dp" and self.record_payloads:
            raise ValueError("--record-payloads with --attention dp: eprt replay rebuilds replicated attention only")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")

    def prefill_tokens(self, device: str) -> int:
        """The chunked-prefill budget: the one given, else DEFAULT_PREFILL_TOKENS for the device."""
        return DEFAULT_PREFILL_TOKENS[device] if self.max_prefill_tokens is None else self.max_prefill_tokens


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="Hugging Face MoE checkpoint directory (default: the built-in default model)",
    )
    g.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda", "auto"],
        help="backend (default: $EPRT_DEVICE, else cuda when usable)",
    )
    g.add_argument("--max-batch", type=int, default=32, help="sequence slots, i.e. max decode batch (32)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block ($EPRT_BLOCK_SIZE, 16)")
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per rank ($EPRT_NUM_BLOCKS; 0: every slot can reach --max-model-len, within memory)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="max prompt + generated tokens (default: the model's max_position_embeddings, bounded by the KV pool)",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help=f"chunked prefill: prompt tokens per step (default {DEFAULT_PREFILL_TOKENS['cpu']} on the CPU, "
        f"{DEFAULT_PREFILL_TOKENS['cuda']} on a GPU; 0: whole prompts)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights plus KV pool (0.9)",
    )
    g.add_argument(
        "--image-token-id",
        type=int,
        default=None,
        help="token id of image placeholders (default: the config's image_token_id)",
    )
    g.add_argument(
        "--attention",
        default=None,
        choices=list(ATTENTION_MODES),
        help="dp: each sequence's KV and attention on one owner rank, the ranks' KV pools add up; replicated: "
        "on every rank (default: replicated"
        + ("" if DEFAULT_MULTI_RANK_ATTENTION == "replicated" else f"; {DEFAULT_MULTI_RANK_ATTENTION} on 2+ ranks")
        + ")",
    )
    g.add_argument("--engine-seed", type=int, default=0, help="seed for requests that bring none")
    g.add_argument("--log-all-ranks", action="store_true", help="log from every rank, not only rank 0")
    g.add_argument(
        "--dump-dir",
        default=None,
        help="where each rank writes its flight recorder on a failure, SIGUSR2 or --dump-frames "
        "($EPRT_DUMP_DIR, eprt-dumps)",
    )
    g.add_argument("--dump-frames", action="store_true", help="write the flight recorder at shutdown too")
    g.add_argument(
        "--record-payloads",
        action="store_true",
        help="record every frame, vision row and combine with its data under DUMP_DIR/payloads, for eprt replay",
    )


def engine_config_from_args(args) -> EngineConfig:
    cfg = EngineConfig(
        model=args.model,
        device=args.device or env.DEVICE.get() or "auto",
        max_batch=args.max_batch,
        block_size=args.block_size if args.block_size is not None else env.BLOCK_SIZE.get(),
        num_blocks=args.num_blocks if args.num_blocks is not None else env.NUM_BLOCKS.get(),
        max_model_len=args.max_model_len,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_cache=not args.no_prefix_cache,
        gpu_memory_utilization=args.gpu_memory_utilization,
        image_token_id=args.image_token_id,
        seed=args.engine_seed,
        log_all_ranks=args.log_all_ranks or env.LOG_ALL_RANKS.get(),
        dump_dir=args.dump_dir or env.DUMP_DIR.get(),
        dump_frames=args.dump_frames,
        record_payloads=args.record_payloads,
        attention=args.attention,
    )
    cfg.validate()
    return cfg
