"""``eprt plan``: will a model fit on N GPUs, and what will a decode step cost at best? Computed from
``config.json`` and the safetensors headers (no tensor data is read) by ``eprt.entry.capacity``;
a table by default, ``--json`` for machines. See docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from eprt.engine.config import DEFAULT_PREFILL_TOKENS
from eprt.entry.capacity import DECODE_BATCHES, Hardware, Plan, Settings, cpu_precision, make_plan, size
from eprt.entry.exchange_plan import Links, exchange_json, exchange_rows, render_exchange
from eprt.model.config import load_config
from eprt.model.default import DEFAULT_MODEL_DIR
from eprt.ops.cpu_weights import PRECISIONS

_HW = Hardware()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="Hugging Face MoE checkpoint directory (default: the built-in model)",
    )
    parser.add_argument(
        "--ranks",
        type=rank_list,
        default=[1],
        help="ranks (GPUs) the experts are split over (default 1); several, comma-separated, with --exchange",
    )
    parser.add_argument(
        "--exchange",
        choices=["allgather", "alltoall", "both"],
        default=None,
        help="instead of the plan: the MoE exchange's bytes and link time per decode step at each --ranks "
        "(--max-batch rows per rank, dp attention) for that exchange or both; the all-gather's rows stay as the "
        "base of the x column (docs/plan.md)",
    )
    _add_hardware_arguments(parser)
    _add_engine_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPU and its links the plan assumes."""
    hw = parser.add_argument_group("hardware (defaults: an H200-class GPU)")
    hw.add_argument("--gpu-mem-gib", type=float, default=_HW.gpu_mem_gib, help=f"GPU memory, GiB ({_HW.gpu_mem_gib:g})")
    hw.add_argument("--hbm-tbps", type=float, default=_HW.hbm_tbps, help=f"HBM bandwidth, TB/s ({_HW.hbm_tbps:g})")
    hw.add_argument(
        "--link-gbps",
        type=float,
        default=_HW.link_gbps,
        help=f"link bandwidth per GPU (NVLink), GB/s, charged for the bytes one rank receives ({_HW.link_gbps:g})",
    )
    hw.add_argument(
        "--tflops", type=float, default=_HW.tflops, help=f"dense compute peak, TFLOP/s ({_HW.tflops:g}: bf16)"
    )
    hw.add_argument(
        "--ib-gbps", type=float, default=Links.ib_gbps, help=f"--exchange: GB/s a GPU between nodes ({Links.ib_gbps:g})"
    )
    hw.add_argument(
        "--gpus-per-node",
        type=int,
        default=Links.gpus_per_node,
        help=f"--exchange: GPUs a node, joined by NVLink ({Links.gpus_per_node})",
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine settings the plan is made for (as the engine's flags)."""
    g = parser.add_argument_group("engine settings (as the engine flags)")
    g.add_argument("--max-batch", type=int, default=32, help="sequence slots (32)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    g.add_argument("--num-blocks", type=int, default=0, help="KV blocks per rank (0: sized from the GPU memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction for weights plus KV (0.9)")
    g.add_argument(
        "--reserved-gib",
        type=float,
        default=1.0,
        help="GPU memory taken besides weights and KV: CUDA context, activations (1.0)",
    )
    g.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the backend: bf16, the GPU's (weights and KV in bf16), or fp32, the CPU's (activations and KV "
        "float32, weights as --cpu-weights holds them)",
    )
    g.add_argument(
        "--cpu-weights",
        choices=PRECISIONS,
        default=None,
        help="with --dtype fp32: the CPU's resident weights, as the engine flag (default: EPRT_CPU_WEIGHTS, auto: "
        "the checkpoint's bf16, FP8 or f32; int8 in groups of EPRT_CPU_INT8_GROUP); the compiled path's ([cpu])",
    )
    g.add_argument(
        "--attention",
        choices=["replicated", "dp"],
        default="replicated",
        help="replicated: every rank holds all attention and KV; dp: each sequence's on one owner rank, the "
        "ranks' pools add up (wire and bounds below are replicated attention's)",
    )
    g.add_argument("--context", type=int, default=0, help="context tokens per sequence read by a decode step (0)")
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_TOKENS["cuda"],
        help=f"prompt tokens per prefill chunk ({DEFAULT_PREFILL_TOKENS['cuda']})",
    )
    g.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="EPLB's extra expert slots (0): each rank's slots and their memory, per-choice combines (docs/eplb.md)",
    )


def rank_list(text: str) -> list[int]:
    """--ranks: "16" or "8,32,144"."""
    try:
        ranks = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes whole numbers, comma-separated, got {text!r}") from None
    if any(r < 1 for r in ranks):
        raise argparse.ArgumentTypeError(f"--ranks must be >= 1, got {text!r}")
    return ranks


def main(args) -> int:
    model = args.model or DEFAULT_MODEL_DIR
    if args.exchange is not None:
        return _exchange(args, model)
    if len(args.ranks) > 1:
        print(f"eprt plan: several --ranks ({','.join(map(str, args.ranks))}) need --exchange", file=sys.stderr)
        return 2
    settings = Settings(
        ranks=args.ranks[0],
        max_batch=args.max_batch,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        reserved_gib=args.reserved_gib,
        dtype=args.dtype,
        cpu_weights=args.cpu_weights,
        context=args.context,
        prefill_chunk=args.prefill_chunk,
        num_redundant_experts=args.num_redundant_experts,
    )
    hardware = Hardware(args.gpu_mem_gib, args.hbm_tbps, args.link_gbps, args.tflops)
    plan = make_plan(model, load_config(model), settings, hardware, args.attention)
    print(json.dumps(to_json(plan), indent=1) if args.json else render(plan))
    return 0 if not plan.kv.problem else 1


def _exchange(args, model: str) -> int:
    """``--exchange``: the MoE exchange table at each --ranks (link figures: --link-gbps inside a node)."""
    cpu_precision(args.dtype, args.cpu_weights)  # refused with the GPU's dtype; rows are activations either way
    cfg = load_config(model)
    links = Links(args.link_gbps, args.ib_gbps, args.gpus_per_node)
    rows = exchange_rows(cfg, args.ranks, args.max_batch, 2 if args.dtype == "bf16" else 4, links)
    if args.exchange != "both":
        rows = [r for r in rows if r.exchange == args.exchange or r.exchange == "allgather"]
    name = model.rstrip("/").split("/")[-1]
    if args.json:
        print(json.dumps(exchange_json(rows, args.max_batch, links), indent=1))
    else:
        print(render_exchange(cfg, name, rows, args.max_batch, args.dtype, links))
    return 0


def to_json(plan: Plan) -> dict:
    out = asdict(plan)
    for w, d in zip(plan.weights, out["weights"]):
        d["resident_bytes"] = w.resident_bytes
        d["precisions"] = dict(w.precisions)
    for wire, d in zip((*plan.decode_wire, plan.prefill_wire), (*out["decode_wire"], out["prefill_wire"])):
        d["total"] = wire.total
    out["decode_wire"] = dict(zip(map(str, DECODE_BATCHES), out["decode_wire"]))
    out["decode"] = dict(zip(map(str, DECODE_BATCHES), out["decode"]))
    out["fits"] = not plan.kv.problem
    return out


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def duration(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]


def render(plan: Plan) -> str:
    s, hw = plan.settings, plan.hardware
    unit, memory = ("GPU", "HBM") if s.dtype != "fp32" else ("rank", "memory")  # --gpu-mem-gib, --hbm-tbps
    lines = [
        f"eprt plan: {plan.model} ({plan.model_type}, {count(plan.params)} parameters) on {plan.ranks} "
        f"rank(s), {plan.attention} attention, {backend(s)}",
        f"hardware: {hw.gpu_mem_gib:g} GiB per {unit} ({s.gpu_memory_utilization:.0%} usable, {s.reserved_gib:g} GiB "
        f"reserved), {memory} {hw.hbm_tbps:g} TB/s, link {hw.link_gbps:g} GB/s, {hw.tflops:g} TFLOP/s",
        "",
        f"weights per rank (checkpoint bytes from the {plan.weight_source})",
    ]
    return "\n".join(lines + _weights(plan) + _kv(plan) + _wire(plan) + _bounds(plan))


def backend(s: Settings) -> str:
    """The backend and how it holds weights and KV."""
    if s.dtype != "fp32":
        return f"GPU backend: weights and KV in {s.dtype}"
    group = f", groups of {s.int8_group} along k" if s.cpu_weights == "int8" else ""
    return f"CPU backend: weights --cpu-weights {s.cpu_weights}{group}, KV float32"


def held_as(w) -> str:
    """A rank's resident precisions with their shares of its bytes, e.g. "bf16 91%, f32 9%"."""
    return ", ".join(f"{kind} {n / max(w.resident_bytes, 1):.0%}" for kind, n in w.precisions)


def _weights(plan: Plan) -> list[str]:
    s, kv = plan.settings, plan.kv
    rows = [
        [
            str(w.rank),
            f"[{w.expert_start}, {w.expert_end})",
            size(w.read_bytes),
            size(w.replicated_bytes),
            size(w.expert_bytes),
            size(w.resident_bytes),
            held_as(w),
            "-" if kv.blocks_per_rank[w.rank] is None else str(kv.blocks_per_rank[w.rank]),
        ]
        for w in plan.weights
    ]
    slots = "experts" if not s.num_redundant_experts else f"slots (+{s.num_redundant_experts} redundant)"
    header = ["rank", slots, "read", "replicated", "experts", "on device", "held as", "KV room (blocks)"]
    return _table(header, rows)


def _kv(plan: Plan) -> list[str]:
    s, kv = plan.settings, plan.kv
    lines = [
        "",
        f"KV cache: {size(kv.bytes_per_token)} per token, {size(kv.bytes_per_block)} per block of {s.block_size}",
    ]
    if kv.problem:
        return [*lines, f"  DOES NOT FIT: {kv.problem}"]
    lines.append(
        f"  pool: {kv.blocks} blocks = {kv.blocks * s.block_size} tokens per rank (the smallest room over the "
        f"ranks), max_model_len {kv.max_model_len}"
    )
    if plan.attention == "dp":
        return lines + [
            f"  job capacity: {kv.tokens} tokens. Attention is dp: each sequence's KV lives on its owner rank",
            "  and each rank keeps the pool its memory allows, so the ranks' pools add up. (The wire and the",
            "  bounds below are replicated attention's; dp adds an all-gather of hidden states per MoE layer.)",
        ]
    return lines + [
        f"  job capacity: {kv.tokens} tokens. Attention is replicated: every rank holds every sequence's KV,",
        "  so the job holds what one rank's pool holds, whatever the number of ranks.",
    ]


def _wire(plan: Plan) -> list[str]:
    rows = [[f"decode step, batch {b}", size(w.frame_bytes), size(w.combine_bytes), w.combine]
            for b, w in zip(DECODE_BATCHES, plan.decode_wire)]  # fmt: skip
    p, c = plan.prefill_wire, plan.settings.prefill_chunk
    rows.append([f"prefill token (chunks of {c})", size(p.frame_bytes / c), size(p.combine_bytes / c), p.combine])
    lines = ["", "bytes on the wire, the busiest rank (command frames + MoE combines)"]
    return lines + _table(["", "frames", "combine", "combine as"], rows)


def _bounds(plan: Plan) -> list[str]:
    lines = [
        "",
        f"decode step lower bounds (roofline; experts touched as under uniform routing; context "
        f"{plan.settings.context} tokens)",
    ]
    rows = [
        [
            str(d.batch),
            str(d.rank),
            size(d.hbm_bytes),
            duration(d.hbm_s),
            size(d.wire_bytes),
            duration(d.link_s),
            f"{d.flops / 1e9:.2f} G",
            duration(d.compute_s),
            duration(d.bound_s),
            d.binding,
        ]
        for d in plan.decode
    ]
    header = ["batch", "rank", "HBM read", "HBM", "wire", "link", "FLOPs", "compute", "bound", "binding"]
    return lines + _table(header, rows)
