"""Time to first token of 16 requests arriving together, batched prefill on vs off, one run.

    python benchmarks/bench_prefill_batch.py [--dir /tmp/eprt-bench-moe] [--requests 16] [--repeats 3]

The ~115M Qwen3-MoE of bench_decode_cpu.py (built once). 16 prompts of 24..144 tokens are
submitted at once with whole-prompt prefill (default --max-prefill-tokens 0) and with the CPU's
default 512-token chunks; each request's time to first token is measured from the submit. Batched:
a tick's prompts run as one forward pass (``--batch-prefill on``); off: one pass per prompt.
Outputs (greedy) must be identical. Figures: the best of ``--repeats`` runs of each setting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 8000 + 3 for j in range(24 + (120 * i) // max(1, n - 1))] for i in range(n)]


def first_tokens(path, batch: bool, chunk: int, reqs: list) -> tuple[np.ndarray, float, list, int]:
    """(time to first token of each request [n] s, wall s until all finished, outputs, prefill passes)."""
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(
        model=path, device="cpu", max_batch=len(reqs), max_model_len=256, max_prefill_tokens=chunk,
        batch_prefill=batch, prefix_cache=False,
    )  # fmt: skip
    with launch_engine(cfg) as engine:
        engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2))])  # warm-up
        passes = engine.runner.prefill_passes
        first = [None] * len(reqs)
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        def stamp(i):
            return lambda _token: first.__setitem__(i, first[i] or time.perf_counter())

        t0 = time.perf_counter()
        handles = [
            engine.submit(GenerationRequest(p, params, stream=True, on_token=stamp(i))) for i, p in enumerate(reqs)
        ]
        while not all(h.done() for h in handles):
            engine.scheduler.step()
        out = [h.result().token_ids for h in handles]
        wall = time.perf_counter() - t0
        return np.array(first) - t0, wall, out, engine.runner.prefill_passes - passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from bench_decode_cpu import BENCH_MODEL
    from checkpoints import build_checkpoint

    path = build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL)
    reqs = prompts(args.requests)
    print(f"{args.requests} requests together, prompts {len(reqs[0])}..{len(reqs[-1])} tokens, 4 new tokens each")
    print(f"{'chunk':>6} {'batched':>8} {'passes':>6} {'TTFT mean ms':>12} {'p50 ms':>8} {'max ms':>8} {'wall s':>7}")
    for chunk in (0, 512):
        outputs = {}
        for batch in (False, True):
            runs = [first_tokens(path, batch, chunk, reqs) for _ in range(args.repeats)]
            ttft, wall, out, passes = min(runs, key=lambda r: r[0].mean())
            outputs[batch] = out
            print(
                f"{chunk or 'whole':>6} {'on' if batch else 'off':>8} {passes:6d} {ttft.mean() * 1e3:12.0f} "
                f"{np.median(ttft) * 1e3:8.0f} {ttft.max() * 1e3:8.0f} {wall:7.2f}"
            )
        assert outputs[True] == outputs[False], "batched prefill changed the greedy outputs"
    print("greedy outputs identical with batched prefill on and off")


if __name__ == "__main__":
    main()
