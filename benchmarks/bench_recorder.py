"""The flight recorder's cost on a decode step, side by side in one process.

    python benchmarks/bench_recorder.py [--batch 8] [--steps 24] [--rounds 3]

Times steady-state decode steps of the 53M-parameter model of bench_ep.py with the recorder on
(the default ring) and off (a recorder that records nothing), alternating rounds, and measures
the recorder's own work per step directly (one DECODE_BATCH frame plus one combine entry per
MoE layer, as a 2-rank job records them). Target: under 1% of the step.
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


class NoRecorder:
    """The recorder's interface, recording nothing."""

    def frame(self, *args, **kw):
        pass

    rows = combine = close = frame


def decode_step_ms(engine, prompts, steps: int) -> float:
    from eprt.api import GenerationRequest, SamplingParams

    def run(n):
        engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts])

    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    run(steps + 1)
    t2 = time.perf_counter()
    return 1e3 * ((t2 - t1) - (t1 - t0)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-ep")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from bench_ep import EP_MODEL
    from checkpoints import build_checkpoint

    from eprt.comm.protocol import DecodeBatch, encode
    from eprt.comm.recorder import Recorder
    from eprt.engine.engine import EngineConfig, launch_engine

    build_checkpoint("mixtral", args.dir, **EP_MODEL)
    cfg = EngineConfig(model=args.dir, device="cpu", max_batch=args.batch, max_model_len=512, prefix_cache=False)
    prompts = [[3 + (7 * i + j) % 4000 for j in range(16)] for i in range(args.batch)]
    with launch_engine(cfg) as engine:
        ring = engine.transport.recorder
        decode_step_ms(engine, prompts, 2)  # warm-up
        on, off = [], []
        for _ in range(args.rounds):
            engine.transport.recorder = ring
            on.append(decode_step_ms(engine, prompts, args.steps))
            engine.transport.recorder = NoRecorder()
            off.append(decode_step_ms(engine, prompts, args.steps))
        layers, hidden = engine.model_config.num_layers, engine.model_config.hidden_size
    # the recorder's own work per decode step of a 2-rank job, measured directly
    rec = Recorder(0, 2)
    frame = encode(DecodeBatch(tuple(range(args.batch)), tuple(range(args.batch))))
    partial = np.ones((args.batch, hidden), np.float32)  # [B, D]
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        rec.frame(frame, i, sent=True)
        for _ in range(layers):
            rec.combine(partial, partial, i)
    per_step_us = 1e6 * (time.perf_counter() - t0) / n
    best_on, best_off = min(on), min(off)
    print(f"decode step, batch {args.batch}, {layers} MoE layers, best of {args.rounds} rounds of {args.steps} steps")
    print("| recorder | step ms | ratio |")
    print("|---|---|---|")
    print(f"| off | {best_off:.2f} | 1.000 |")
    print(f"| on | {best_on:.2f} | {best_on / best_off:.3f} |")
    print(
        f"recorder work per step (1 frame + {layers} combines): {per_step_us:.1f} us = "
        f"{100 * per_step_us / 1e3 / best_off:.3f}% of the step"
    )


if __name__ == "__main__":
    main()
