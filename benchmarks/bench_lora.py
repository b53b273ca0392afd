"""Decode throughput with multi-LoRA: batch 16 with 0, 1 and 4 distinct adapters in the batch.

    python benchmarks/bench_lora.py [--dir /tmp/eprt-bench-lora] [--steps 24] [--rank 16] [--threads 1]

Builds (once) a Qwen3-MoE with random weights (hidden 512, 8 layers, 16 experts) and four random
PEFT adapters of rank R on q/k/v/o and on the fused experts (target_parameters gate_up_proj and
down_proj, as peft writes them for transformers 5.x), then on one ShardExecutor prefills 16
sequences (rows spread round-robin over the adapters) and times decode steps (median step of a
run, fastest of --repeats interleaved runs). Reports ms per step, tokens/s and the ratio to the
base-only step (target: 4 adapters <= 1.3x; docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _threads_from_argv() -> int:
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
    return 1


for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(_threads_from_argv())

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from checkpoints import BENCH_MODEL as MODEL  # noqa: E402

BATCH, PROMPT_LEN = 16, 32


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter: q/k/v/o modules and target_parameters LoRA on the fused experts."""
    from safetensors.numpy import save_file

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path
    rng = np.random.default_rng(seed)
    D, E, I, Q, KV = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, 8 * 64, 4 * 64
    tensors = {}

    def put(key, a_shape, b_shape):
        tensors[f"base_model.model.{key}.lora_A.weight"] = (rng.normal(size=a_shape) * 0.02).astype(np.float32)
        tensors[f"base_model.model.{key}.lora_B.weight"] = (rng.normal(size=b_shape) * 0.02).astype(np.float32)

    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn"
        for proj, out, inp in (("q", Q, D), ("k", KV, D), ("v", KV, D), ("o", D, Q)):
            put(f"{a}.{proj}_proj", (rank, inp), (out, rank))
        put(f"model.layers.{i}.mlp.experts.base_layer", (rank * E, D), (2 * I, rank * E))  # gate_up_proj
        put(f"model.layers.{i}.mlp.experts", (rank * E, I), (D, rank * E))  # down_proj
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    config["target_parameters"] = ["gate_up_proj", "down_proj"]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def time_decode(lm, adapters: list, distinct: int, steps: int, rank: int) -> float:
    """Seconds per decode step of BATCH rows, rows spread round-robin over ``distinct`` adapters."""
    from eprt.engine.executor import ShardExecutor
    from eprt.model.lora import LoraSlots

    cfg = lm.config
    lora = LoraSlots(lm.model.ops, cfg, 4, rank, 0, cfg.num_experts)
    ex = ShardExecutor(lm.model, 1024, 16, BATCH, prefix_cache=False, lora=lora)
    for s, path in enumerate(adapters):
        ex.adapters.load(s, s + 1, path)
    rng = np.random.default_rng(0)
    for row in range(BATCH):
        prompt = rng.integers(3, cfg.vocab_size, PROMPT_LEN).tolist()
        ex.allocate(row, prompt, adapter=(row % distinct) + 1 if distinct else -1)
        ex.prefill(row, prompt, 0, PROMPT_LEN)
    slots, times = list(range(BATCH)), []
    for _ in range(steps):
        tokens = rng.integers(3, cfg.vocab_size, BATCH).tolist()
        t = time.perf_counter()
        ex.decode(slots, tokens)
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/eprt-bench-lora")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of each case, interleaved; the fastest counts")
    args = p.parse_args()
    from checkpoints import build_checkpoint

    from eprt.model.loader import load_model
    from eprt.ops.numpy_ops import NumpyOps

    base = build_checkpoint("qwen3_moe", os.path.join(args.dir, "model"), **MODEL)
    lm = load_model(base, NumpyOps(), 256)
    adapters = [
        write_adapter(os.path.join(args.dir, f"lora-r{args.rank}-{i}"), lm.config, args.rank, i) for i in range(4)
    ]
    print(f"decode, batch {BATCH}, LoRA rank {args.rank} on q/k/v/o + experts, {args.threads} thread(s), NumPy")
    best = {d: float("inf") for d in (0, 1, 4)}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hurts every case alike
        for distinct in best:
            best[distinct] = min(best[distinct], time_decode(lm, adapters, distinct, args.steps, args.rank))
    base_step = best[0]
    for distinct, step in best.items():
        print(
            f"  {distinct} adapter(s): {step * 1e3:7.2f} ms/step  {BATCH / step:8.1f} tok/s  "
            f"{step / base_step:5.2f}x base"
        )


if __name__ == "__main__":
    main()
