"""Milliseconds per MoE layer of NumpyOps.moe_experts on bench_decode_cpu.py's model shapes
(16 experts, D = I = 512, top-2; 8 layers' weights, 400 MB a path, so each layer's come from memory),
the expert paths interleaved in one run: numba (the cpu extra's kernel) and numpy (a GEMV per row).

    python benchmarks/bench_cpu_experts.py [--batches 1,32,64] [--repeats 15]

Reports the best and the median of CPU seconds (process time: less sensitive than wall time to
other processes on a shared machine, not to their memory traffic), and the largest difference
between the paths' outputs.
"""

from __future__ import annotations

import argparse
import os
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import numpy as np  # noqa: E402

from eprt.ops.numpy_ops import NumpyOps, numba_available  # noqa: E402

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 512, 512, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    paths = ["numba", "numpy"] if numba_available() else ["numpy"]
    ops = {p: NumpyOps(p, threads=1) for p in paths}
    for o in ops.values():
        o.warm_up()
    rng = np.random.default_rng(0)
    host = [
        (
            rng.standard_normal((EXPERTS, 2 * INTER, HIDDEN), dtype=np.float32) * 0.05,
            rng.standard_normal((EXPERTS, HIDDEN, INTER), dtype=np.float32) * 0.05,
        )
        for _ in range(LAYERS)
    ]
    stacks = {p: [o.expert_weights(*h) for h in host] for p, o in ops.items()}  # each path's layout
    del host
    print(f"paths: {', '.join(o.describe() for o in ops.values())}; ms per layer (CPU time), best / median")
    for batch in [int(b) for b in args.batches.split(",")]:
        x = rng.standard_normal((batch, HIDDEN), dtype=np.float32)  # [T, D]
        ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(batch)]).astype(np.int32)
        weights = rng.random((batch, TOP_K), dtype=np.float32)
        outs = {p: o.moe_experts(x, weights, ids, *stacks[p][0], 0) for p, o in ops.items()}
        times = {p: [] for p in ops}
        for _ in range(args.repeats):
            for p, o in ops.items():
                t = time.process_time()
                for layer in range(LAYERS):
                    o.moe_experts(x, weights, ids, *stacks[p][layer], 0)
                times[p].append((time.process_time() - t) / LAYERS * 1e3)
        rows = np.bincount(ids.reshape(-1), minlength=EXPERTS)
        diff = max(float(np.abs(outs[p] - outs["numpy"]).max()) for p in ops)
        cells = "  ".join(f"{p} {min(t):6.2f} / {np.median(t):6.2f}" for p, t in times.items())
        print(f"batch {batch:3d} (rows per expert {rows.min()}-{rows.max()}): {cells}  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
