"""What a batch-1 decode step spends outside its matrix products, on the compiled CPU path.

    python benchmarks/bench_decode_overhead.py [--dir /tmp/eprt-bench-moe] [--weights bf16] [--repeats 12]

The model of bench_decode_cpu.py (its bf16 copy, built once), one engine at --weights on one
thread, 32 new tokens at batch 1 after a one-token run, --repeats times: per decode step the CPU
time inside the product kernels and outside them (the engine, the routing's exp, the Python
around the calls), min and median over the repeats; then the calls per step into compiled kernels
from Python and the Python function calls per step (cProfile, the counting wrappers left out),
which do not depend on the load. The product kernels: cpu_kernels._linear_one (the head), and a
layer run as one op (``Ops.decode_layer``) in its two calls, _layer_front (its norms, the
attention's qkv and o products with the prologue and decode attention between them, the router's
product and shift) and _layer_back (the pick and the experts); for layers run as their ops apart,
_router_shift, _moe and _attention_block.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

PRODUCTS = ("_linear_one", "_router_shift", "_moe", "_attention_block", "_layer_front", "_layer_back")


class Counted:
    """Every compiled kernel of cpu_kernels wrapped: calls counted, the products' CPU time summed."""

    def __init__(self):
        from numba.core.registry import CPUDispatcher

        from eprt.ops import cpu_kernels

        self.calls, self.inside_ns = 0, 0
        for name in dir(cpu_kernels):
            kernel = getattr(cpu_kernels, name)
            if isinstance(kernel, CPUDispatcher):
                setattr(cpu_kernels, name, self._wrap(kernel, name in PRODUCTS))

    def _wrap(self, kernel, timed: bool):
        def call(*args):
            self.calls += 1
            if not timed:
                return kernel(*args)
            start = time.process_time_ns()
            out = kernel(*args)
            self.inside_ns += time.process_time_ns() - start
            return out

        return call


def step_times(run, counted: Counted, n: int) -> tuple[float, float]:
    """(inside, outside) the products, CPU ms per decode step: run(n) less run(1)."""
    results = []
    for k in (1, n):
        counted.inside_ns = 0
        start = time.process_time()
        run(k)
        results.append((time.process_time() - start, counted.inside_ns / 1e9))
    (whole1, in1), (whole_n, in_n) = results
    inside = (in_n - in1) / (n - 1)
    return 1e3 * inside, 1e3 * ((whole_n - whole1) / (n - 1) - inside)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--weights", default="bf16", choices=["f32", "bf16", "int8"])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from bench_decode_cpu import BENCH_MODEL
    from checkpoints import build_bf16_copy, build_checkpoint

    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    path = build_bf16_copy(build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL), args.dir + "-bf16")
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=1,
        max_model_len=256,
        prefix_cache=False,
        cpu_weights=args.weights,
        cpu_threads=1,
    )
    n = args.new_tokens + 1
    with launch_engine(cfg) as engine:

        def run(k):
            params = SamplingParams(max_tokens=k, ignore_eos=True)
            engine.generate([GenerationRequest(prompt_ids=list(range(3, 19)), params=params)])

        run(3)  # warm-up: every kernel the runs call compiled (or loaded) before they are wrapped
        counted = Counted()
        times = np.array([step_times(run, counted, n) for _ in range(args.repeats)])  # [repeats, 2]
        counted.calls = 0
        profile = cProfile.Profile()
        profile.runcall(run, n)
        compiled = counted.calls / n
    python_calls = pstats.Stats(profile).total_calls / n - compiled  # less the counting wrappers
    for i, part in enumerate(("inside the products", "outside them")):
        low, mid = times[:, i].min(), np.median(times[:, i])
        print(f"{args.weights}@1 batch 1, CPU ms per step {part}: min {low:.3f} median {mid:.3f}")
    print(f"calls into compiled kernels per step {compiled:.0f}, Python function calls per step {python_calls:.0f}")


if __name__ == "__main__":
    main()
