"""EngineConfig and the command-line flags every entry point shares."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from eprt import env
from eprt.engine.speculative import METHODS, SpeculativeConfig
from eprt.ops.cpu_weights import PRECISIONS

# Prompt tokens per prefill chunk by default: a long prompt shares the step with the decoding
# sequences instead of stalling them (README, "Measured figures": 648 ms vs 92 ms worst gap).
DEFAULT_PREFILL_TOKENS = {"cpu": 512, "cuda": 2048}
ATTENTION_MODES = ("auto", "dp", "replicated")
# What --attention auto picks at world size > 1 for a job dp serves (eprt.engine.startup.choose_attention):
# benchmarks/bench_ep.py decides
DEFAULT_MULTI_RANK_ATTENTION = "dp"
MOE_EXCHANGES = ("auto", "allgather", "alltoall")
# --moe-exchange auto picks alltoall under dp attention from this many ranks on
# (eprt.engine.startup.choose_exchange): benchmarks/bench_ep.py --exchange both decides
ALLTOALL_MIN_RANKS = 3


EPLB_POLICIES = ("auto", "contiguous", "global", "hierarchical")


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (docs/eplb.md); on when any field asks for it."""

    enabled: bool = False  # --enable-eplb: experts on physical slots (contiguous until a load estimate)
    num_redundant_experts: int = 0  # extra physical slots over the ranks
    init_expert_placement: str | None = None  # a --stats-out file: balanced placement at start-up
    policy: str = "auto"  # auto | contiguous | global | hierarchical
    interval: int = 0  # rebalance every this many engine steps (0: never while serving)
    window: int = 0  # over the counts of the last this many steps (0: the interval)
    nodes: int = 0  # nodes for the hierarchical policy (0: the distinct host names)

    @property
    def active(self) -> bool:
        return self.enabled or self.num_redundant_experts > 0 or bool(self.init_expert_placement) or self.interval > 0

    def validate(self) -> None:
        for name in ("num_redundant_experts", "interval", "window", "nodes"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{('eplb-' if name in ('interval', 'window', 'nodes') else '')}"
                    f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if self.policy not in EPLB_POLICIES:
            raise ValueError(f"--eplb-policy must be one of {', '.join(EPLB_POLICIES)}, got {self.policy!r}")


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the built-in default model
    device: str = "auto"  # cpu | cuda | auto (cuda when usable)
    cpu_weights: str | None = None  # CPU weights: auto (the checkpoint's) | f32 | bf16 | int8; None: EPRT_CPU_WEIGHTS
    cpu_threads: int | None = None  # CPU threads per rank; 0: the node's cores / its ranks; None: EPRT_CPU_THREADS
    max_batch: int = 32  # sequence slots (decode batch size)
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks per rank; 0: every slot can reach max_model_len, within memory
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's, bounded by the KV pool
    max_prefill_tokens: int | None = None  # prompt tokens per prefill chunk; None: by device; 0: whole prompts
    prefix_cache: bool = True
    batch_prefill: bool = True  # a tick's prefill chunks as one forward pass (off: one pass per sequence)
    overlap: bool = False  # plan a decode step's sampling while its forward pass runs (eprt/engine/overlap.py)
    cuda_graphs: bool = True  # GPU decode steps replayed from CUDA graphs per batch bucket (eprt/engine/cuda_graphs.py)
    check_state: bool = field(default_factory=env.CHECK_STATE.get)  # compare the ranks' state digests each step
    gpu_memory_utilization: float = 0.9
    image_token_id: int | None = None
    seed: int = 0
    log_all_ranks: bool = False
    dump_dir: str = "eprt-dumps"  # the flight recorder's files (docs/observability.md)
    dump_frames: bool = False  # also write them at shutdown
    record_payloads: bool = False  # record every frame, row and combine with its data, for eprt replay
    speculative_method: str | None = None  # ngram or mtp; None: speculative decoding off
    num_speculative_tokens: int = 3  # drafts per sequence and step (1..4)
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched
    eplb: EplbConfig = field(default_factory=lambda: EplbConfig())  # expert-parallel load balancing
    logprobs_mode: str = "raw"  # raw | processed: which logits logprobs come from (docs/serving.md)
    lora_modules: tuple = ()  # (name, adapter dir) pairs served from the start (docs/lora.md)
    enable_lora: bool = False  # LoRA slots even without --lora-modules (adapters loaded at run time)
    max_loras: int = 4  # LoRA slots per rank (adapters in one batch at most)
    max_lora_rank: int = 16

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    attention: str = "auto"  # auto | dp | replicated (auto: eprt.engine.startup.choose_attention)
    moe_exchange: str = "auto"  # auto | allgather | alltoall (auto: eprt.engine.startup.choose_exchange)

    def alltoall_unserved(self) -> list[str]:
        """What of this job the all-to-all exchange does not serve yet (auto then picks allgather)."""
        unserved = [
            # (under EPLB, LoRA adapters never reach the routed experts: eprt.engine.startup._lora_slots)
            ("LoRA adapters on the routed experts (--enable-lora / --lora-modules)", self.lora_enabled),
            ("--record-payloads (eprt replay rebuilds the all-gather exchange only)", self.record_payloads),
        ]
        return [what for what, on in unserved if on and not (self.eplb.active and "LoRA" in what)]

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
        if self.speculative_method is not None:
            self.speculative().drafter()  # raises naming the bad flag
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"--logprobs-mode must be raw or processed, got {self.logprobs_mode!r}")
        if self.lora_enabled and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError(
                f"--max-loras and --max-lora-rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}"
            )
        names = [n for n, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be distinct, got {names}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"--attention must be auto, dp or replicated, got {self.attention!r}")
        if self.attention == "dp" and self.record_payloads:
            raise ValueError("--record-payloads with --attention dp: eprt replay rebuilds replicated attention only")
        if self.moe_exchange not in MOE_EXCHANGES:
            raise ValueError(f"--moe-exchange must be auto, allgather or alltoall, got {self.moe_exchange!r}")
        if self.moe_exchange == "alltoall" and self.alltoall_unserved():
            raise ValueError(
                f"--moe-exchange alltoall does not serve {self.alltoall_unserved()[0]} yet; "
                "use --moe-exchange allgather"
            )
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if self.cpu_weights is not None and self.cpu_weights not in PRECISIONS:
            raise ValueError(f"--cpu-weights must be one of {', '.join(PRECISIONS)}, got {self.cpu_weights!r}")
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ValueError(f"--cpu-threads must be >= 0 (0: the node's cores / its ranks), got {self.cpu_threads}")
        self.eplb.validate()

    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings, or None when it is off."""
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(
            self.speculative_method, self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        )

    def prefill_tokens(self, device: str) -> int:
        """The chunked-prefill budget: the one given, else DEFAULT_PREFILL_TOKENS for the device."""
        return DEFAULT_PREFILL_TOKENS[device] if self.max_prefill_tokens is None else self.max_prefill_tokens


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    _add_model_arguments(g)
    _add_parallel_arguments(g)
    _add_pool_arguments(g)
    _add_step_arguments(g)
    _add_debug_arguments(g)
    _add_speculation_arguments(g)
    _add_lora_arguments(g)
    add_eplb_arguments(parser)


def _add_model_arguments(g) -> None:
    """The checkpoint, the device, how requests are seeded and logprobs taken."""
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
    g.add_argument(
        "--cpu-weights",
        default=None,
        choices=PRECISIONS,
        help="CPU: the weights' resident precision: auto (the checkpoint's: bf16, FP8 with its scales, else f32; "
        "the same tokens as f32), f32, bf16, int8 (per-group int8 weights and activations; outputs differ) "
        "($EPRT_CPU_WEIGHTS, auto)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU: compute threads per rank ($EPRT_CPU_THREADS; default: $OMP_NUM_THREADS, else the cores this "
        "rank is bound to, else the node's cores / its ranks); never changes a bit of the output",
    )
    g.add_argument(
        "--image-token-id",
        type=int,
        default=None,
        help="token id of image placeholders (default: the config's image_token_id)",
    )
    g.add_argument("--engine-seed", type=int, default=0, help="seed for requests that bring none")
    g.add_argument(
        "--logprobs-mode",
        choices=("raw", "processed"),
        default="raw",
        help="logprobs from the model's logits (raw, vLLM's default) or after penalties, temperature and min-p",
    )


def _add_parallel_arguments(g) -> None:
    """How the ranks split attention and exchange the MoE layers' rows."""
    g.add_argument(
        "--attention",
        default="auto",
        choices=list(ATTENTION_MODES),
        help="dp: each sequence's KV and attention on one owner rank, the ranks' KV pools add up; replicated: "
        "on every rank; auto (default): "
        + (
            "replicated (dp does not win benchmarks/bench_ep.py yet)"
            if DEFAULT_MULTI_RANK_ATTENTION == "replicated"
            else "dp on 2+ ranks, replicated for a job using what dp does not serve"
        )
        + "; the start-up log says which and why",
    )
    g.add_argument(
        "--moe-exchange",
        default="auto",
        choices=list(MOE_EXCHANGES),
        help="how the MoE layers exchange rows between ranks: allgather (every rank sees every row; bytes grow "
        "with the ranks) or alltoall (a row goes only to the ranks holding its top-k experts and comes back "
        f"summed; bytes grow with top-k); both give the same bits; auto (default): alltoall under dp attention "
        f"from {ALLTOALL_MIN_RANKS} ranks on, else allgather (and for what alltoall does not serve); the start-up log "
        "says which and why",
    )


def _add_pool_arguments(g) -> None:
    """The sequence slots and the KV pool."""
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
        help=f"chunked prefill: prompt tokens per step, per owner rank under --attention dp (default "
        f"{DEFAULT_PREFILL_TOKENS['cpu']} on the CPU, {DEFAULT_PREFILL_TOKENS['cuda']} on a GPU; 0: whole prompts)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights plus KV pool (0.9)",
    )


def _add_step_arguments(g) -> None:
    """How a step runs: batched prefill, the overlap, CUDA graphs."""
    g.add_argument(
        "--batch-prefill",
        choices=("on", "off"),
        default="on",
        help="run the prompts (and prompt chunks) admitted in one tick as one forward pass (default on)",
    )
    g.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="off",
        help="rank 0 plans a decode step's sampling and encodes the next step's frame while the step's forward "
        "pass runs (on a helper thread on the CPU); default off: not faster on the CPU as measured "
        '(docs/design.md, "Overlap")',
    )
    g.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default="on",
        help="with --device cuda, capture each decode batch-size bucket's forward pass (1, 2, 4, 8, 16, 32, then "
        "steps of 32 up to --max-batch) as a CUDA graph at start-up and replay it every step; off: launch every "
        'kernel from Python (default on; ignored on the CPU; docs/gpu.md, "CUDA graphs")',
    )


def _add_debug_arguments(g) -> None:
    """The state checks, logs and the flight recorder."""
    g.add_argument(
        "--check-state",
        action="store_true",
        help="after every step compare each rank's digests of the state it mirrors (slots, KV pools, prefix "
        "cache, placement, snapshots) and end the job naming any that differ (also EPRT_CHECK_STATE=1)",
    )
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


def _add_speculation_arguments(g) -> None:
    g.add_argument(
        "--speculative-method",
        default=None,
        choices=METHODS,
        help="speculative decoding: ngram proposes drafts by prompt lookup, mtp by DeepSeek's multi-token "
        "prediction layer (num_nextn_predict_layers) on every rank; verified in one step (default: off)",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per sequence and step, 1..4 (3)")
    g.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest suffix looked up (1)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix looked up (4)")


def _add_lora_arguments(g) -> None:
    g.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable; docs/lora.md)",
    )
    g.add_argument("--enable-lora", action="store_true", help="LoRA slots for adapters loaded at run time")
    g.add_argument("--max-loras", type=int, default=4, help="LoRA adapter slots per rank (4)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank served (16)")


def add_eplb_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("expert-parallel load balancing (docs/eplb.md)")
    g.add_argument("--enable-eplb", action="store_true", help="experts on physical slots (implied by the flags below)")
    g.add_argument("--num-redundant-experts", type=int, default=0, metavar="R", help="extra expert slots (0)")
    g.add_argument(
        "--init-expert-placement",
        default=None,
        metavar="FILE",
        help="balanced placement at start-up from an expert-load file (eprt run --stats-out)",
    )
    g.add_argument("--eplb-policy", default="auto", choices=EPLB_POLICIES, help="placement policy (auto)")
    g.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS", help="rebalance every STEPS steps (0: off)")
    g.add_argument("--eplb-window", type=int, default=0, metavar="STEPS", help="load window (0: the interval)")
    g.add_argument("--eplb-nodes", type=int, default=0, help="nodes for the hierarchical policy (0: distinct hosts)")


def eplb_config_from_args(args) -> EplbConfig:
    return EplbConfig(
        enabled=getattr(args, "enable_eplb", False),
        num_redundant_experts=getattr(args, "num_redundant_experts", 0),
        init_expert_placement=getattr(args, "init_expert_placement", None),
        policy=getattr(args, "eplb_policy", "auto"),
        interval=getattr(args, "eplb_interval", 0),
        window=getattr(args, "eplb_window", 0),
        nodes=getattr(args, "eplb_nodes", 0),
    )


def parse_lora_modules(values) -> tuple:
    """--lora-modules NAME=DIR values as (name, dir) pairs."""
    pairs = []
    for v in values or ():
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=DIR, got {v!r}")
        pairs.append((name, path))
    return tuple(pairs)


def engine_config_from_args(args) -> EngineConfig:
    cfg = EngineConfig(
        model=args.model,
        device=args.device or env.DEVICE.get() or "auto",
        cpu_weights=getattr(args, "cpu_weights", None),
        cpu_threads=getattr(args, "cpu_threads", None),
        max_batch=args.max_batch,
        block_size=args.block_size if args.block_size is not None else env.BLOCK_SIZE.get(),
        num_blocks=args.num_blocks if args.num_blocks is not None else env.NUM_BLOCKS.get(),
        max_model_len=args.max_model_len,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_cache=not args.no_prefix_cache,
        batch_prefill=args.batch_prefill == "on",
        overlap=args.overlap == "on",
        cuda_graphs=getattr(args, "cuda_graphs", "on") == "on",
        check_state=args.check_state or env.CHECK_STATE.get(),
        gpu_memory_utilization=args.gpu_memory_utilization,
        image_token_id=args.image_token_id,
        seed=args.engine_seed,
        log_all_ranks=args.log_all_ranks or env.LOG_ALL_RANKS.get(),
        dump_dir=args.dump_dir or env.DUMP_DIR.get(),
        dump_frames=args.dump_frames,
        record_payloads=args.record_payloads,
        speculative_method=getattr(args, "speculative_method", None),
        num_speculative_tokens=getattr(args, "num_speculative_tokens", 3),
        prompt_lookup_min=getattr(args, "prompt_lookup_min", 1),
        prompt_lookup_max=getattr(args, "prompt_lookup_max", 4),
        eplb=eplb_config_from_args(args),
        logprobs_mode=getattr(args, "logprobs_mode", "raw"),
        lora_modules=parse_lora_modules(getattr(args, "lora_modules", ())),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 4),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        attention=args.attention,
        moe_exchange=getattr(args, "moe_exchange", "auto"),
    )
    cfg.validate()
    return cfg
