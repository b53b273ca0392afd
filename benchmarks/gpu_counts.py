"""``bench_gpu.py --count``: what the host issues per decode step on the GPU path, eager
(--cuda-graphs off) and with CUDA graphs, counted by cusim (tests/cusim/streams.py):

    PYTHONPATH=tests:. python -m cusim.run benchmarks/bench_gpu.py --count

kernel launches (kernels, cuBLAS calls, CuPy array operations, NCCL collectives; not those a graph
replays), graph launches, host-to-device copies and host synchronisations per decode step and per
layer, before the sampled tokens are read (the greedy argmax's read of them is not counted), for
bench_decode_cpu.py's ~115M Qwen3-MoE and a DeepSeek-V3-shaped model (its real widths: hidden 7168,
128 heads, MLA ranks 1536 / 512 + 64, expert width 2048, dense width 18432, top-8 of 8 groups; 2 layers,
the first dense, 16 routed experts, a vocabulary of 1024). Nothing runs: cusim counts and captures the work
without executing it (``count_only``), so the counts of a model far too large to simulate come in
seconds. Launch counts depend on the widths only through the kernels chosen by shape.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

DEEPSEEK_V3_SHAPED = dict(
    vocab_size=1024,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    max_position_embeddings=4096,
)
BATCHES = (1, 3, 32)
PROMPT = [5, 77, 3, 9, 11, 140, 17, 64]


def models(root: str) -> list[tuple[str, str]]:
    """(name, checkpoint) of the two models, built once under ``root`` (bf16)."""
    from bench_decode_cpu import BENCH_MODEL
    from checkpoints import build_checkpoint

    qwen = build_checkpoint("qwen3_moe", os.path.join(root, "qwen3-115m-bf16"), dtype="bfloat16", **BENCH_MODEL)
    ds = build_checkpoint("deepseek_v3", os.path.join(root, "deepseek-v3-shaped-16e-bf16"), dtype="bfloat16",
                          **DEEPSEEK_V3_SHAPED)  # fmt: skip
    return [("Qwen3-MoE ~115M (8 layers)", qwen), ("DeepSeek-V3-shaped (2 layers)", ds)]


def step_counts(model, batch: int, graphs: bool) -> dict:
    """The counters of one decode step of ``batch`` rows (after a first, uncounted one)."""
    from cusim import streams

    from eprt.engine.cuda_graphs import DecodeGraphs
    from eprt.engine.executor import ShardExecutor

    ops = model.ops
    blocks = batch * (64 // 16 + 1)
    ex = ShardExecutor(model, blocks, 16, batch, prefix_cache=False)
    ex.passes.graphs = DecodeGraphs(ex, batch, graphs)
    ex.passes.graphs.capture_all()
    slots = list(range(batch))
    for s in slots:
        ex.allocate(s, PROMPT)
        ex.prefill(s, PROMPT, 0, len(PROMPT))
    for _ in range(2):  # the second step counted
        streams.reset_counters()
        logits = ex.decode(slots, [7] * batch)  # [B, V]
        before = streams.counters()
        ops.argmax_values(logits)  # the greedy tokens' read (RowSampler.greedy)
        after = streams.counters()
    captured = [c for (rows, _), c in ex.passes.graphs.graphs.items() if rows >= batch]
    in_graph = len(min(captured, key=lambda c: len(c.graph)).graph) if graphs else before["launches"]
    read = {f"read_{k}": after[k] - before[k] for k in ("launches", "h2d_copies", "d2h_copies")}
    return {**before, **read, "layers": model.cfg.num_layers, "issued": in_graph}


def table(root: str | None = None) -> str:
    """The markdown table of docs/gpu.md, "Launches per decode step"."""
    import gc

    from cusim import fake_cupy, streams

    from eprt.model.loader import load_model
    from eprt.ops.cupy_ops import CupyOps

    fake_cupy.MEMORY_TOTAL = 64 << 30  # nothing runs: room for the real widths (host memory as allocated)
    root = root or os.path.join(tempfile.gettempdir(), "eprt-bench-count")
    rows = [
        "| model | batch | mode | host launches / step | graph launches | H2D copies | host syncs | kernels run / step "
        "| per layer | greedy read: launches, H2D, D2H |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    streams.count_only(True)
    try:
        for name, path in models(root):
            model = load_model(path, CupyOps(), max_len=64).model
            for batch in BATCHES:
                for graphs in (False, True):
                    c = step_counts(model, batch, graphs)
                    rows.append(
                        f"| {name} | {batch} | {'graphs' if graphs else 'eager'} | {c['launches']} | "
                        f"{c['graph_launches']} | {c['h2d_copies']} | {c['host_syncs']} | {c['issued']} | "
                        f"{c['issued'] / c['layers']:.1f} | "
                        f"{c['read_launches']}, {c['read_h2d_copies']}, {c['read_d2h_copies']} |"
                    )
            del model
            gc.collect()
    finally:
        streams.count_only(False)
    return "\n".join(rows)


def main() -> int:
    import cupy

    if not getattr(cupy, "__cusim__", False):
        print(
            "bench_gpu.py --count runs on cusim: PYTHONPATH=tests:. python -m cusim.run benchmarks/bench_gpu.py --count"
        )
        return 1
    np.seterr(all="ignore")
    print(table())
    return 0
