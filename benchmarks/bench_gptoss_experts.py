"""One gpt-oss-20b MoE layer's experts on the GPU (CupyOps.moe_experts_swiglu), MXFP4 against bf16:
32 experts, D = I = 2880, top-4, the clamped SwiGLU with biases; random weights (the MXFP4 ones random
nibbles and scales), the experts of ``--layers`` layers held so each call reads its weights from HBM.

    python benchmarks/bench_gptoss_experts.py [--batches 1,32,128] [--layers 4] [--steps 20]
    PYTHONPATH=tests:. python3 -m cusim.run benchmarks/bench_gptoss_experts.py --experts 4 --hidden 64 \
        --batches 2 --layers 1 --steps 1   # the dry run on cusim

Prints per batch the milliseconds per layer (synchronized wall time, the median over the steps), the weight
bytes the chosen experts hold in each format, and what that is as a read rate.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

TOP_K = 4


def _stacks(ops, rng, quant: str, E: int, D: int):
    shapes = ((E, 2 * D, D), (E, D, D))  # gate_up [E, 2I, D], down [E, D, I], I = D
    if quant == "mxfp4":
        blocks = [rng.integers(0, 256, (*s[:2], s[2] // 32, 16), dtype=np.uint8) for s in shapes]
        scales = [rng.integers(118, 124, (*s[:2], s[2] // 32), dtype=np.uint8) for s in shapes]
        return ops.mxfp4_expert_weights(blocks[0], scales[0], blocks[1], scales[1])
    return ops.swiglu_expert_weights(*(rng.standard_normal(s, dtype=np.float32) * 0.02 for s in shapes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2880, help="D = I (a multiple of 32)")
    args = ap.parse_args()
    E, D = args.experts, args.hidden
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    ops, rng = CupyOps(), np.random.default_rng(0)
    layers = {q: [_stacks(ops, rng, q, E, D) for _ in range(args.layers)] for q in ("bf16", "mxfp4")}
    b_gu = cupy.asarray(rng.standard_normal((E, 2 * D), dtype=np.float32) * 0.1)
    b_d = cupy.asarray(rng.standard_normal((E, D), dtype=np.float32) * 0.1)
    per_expert = {"bf16": 3 * D * D * 2, "mxfp4": 3 * D * D // 2 + 3 * D * D // 32}
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"{name}: one layer's experts ({E} x D = I = {D}, top-{TOP_K}), ms (median of {args.steps})")
    print("| batch | experts read | bf16 ms | bf16 GB/s | MXFP4 ms | MXFP4 GB/s | MXFP4 / bf16 time |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        x = ops.activation(rng.standard_normal((batch, D), dtype=np.float32))
        ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(batch)]).astype(np.int32)
        weights = cupy.asarray(rng.random((batch, TOP_K), dtype=np.float32))
        chosen = len(np.unique(ids))
        row = {}
        for quant, stacks in layers.items():
            times = []
            for step in range(args.steps + 2):
                ops.synchronize()
                t0 = time.perf_counter()
                for stack in stacks:
                    ops.moe_experts_swiglu(x, weights, ops.index(ids), *stack, b_gu, b_d, 0, 1.702, 7.0)
                ops.synchronize()
                if step >= 2:  # warm-up
                    times.append((time.perf_counter() - t0) * 1e3 / len(stacks))
            ms = float(np.median(times))
            row[quant] = (ms, chosen * per_expert[quant] / (ms * 1e-3) / 1e9)
        (bt, bg), (mt, mg) = row["bf16"], row["mxfp4"]
        print(f"| {batch} | {chosen} | {bt:.3f} | {bg:.0f} | {mt:.3f} | {mg:.0f} | {mt / bt:.2f} |")


if __name__ == "__main__":
    main()
