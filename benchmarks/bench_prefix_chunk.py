"""Prefix caching and chunked prefill, each measured on/off side by side in one run.

    python benchmarks/bench_prefix_chunk.py [--dir /tmp/eprt-bench-ep]

A) Shared-prefix workload: 32 requests = one 192-token system prompt + an 8-token
   question each, 8 new tokens, max_batch 8. Reports prompt tokens computed, cached
   tokens and wall time with the prefix cache on and off.
B) Decode latency during a long prompt: 4 streaming sequences decode 48 tokens; after
   their 8th token a 768-token prompt arrives. Reports the worst and median gap between
   two tokens of the decoding sequences, with whole-prompt prefill and with
   ``--max-prefill-tokens 64``.
Uses the same Mixtral-style checkpoint as bench_ep.py (built once).
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


def shared_prefix(path, cache: bool):
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    system = [(11 * j) % 4000 + 3 for j in range(192)]
    cfg = EngineConfig(model=path, device="cpu", max_batch=8, max_model_len=512, prefix_cache=cache)
    with launch_engine(cfg) as engine:
        engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2))])  # warm-up
        before = engine.stats()["prompt_tokens_computed"]
        t = time.perf_counter()
        res = engine.generate(
            [GenerationRequest(system + [100 + i] * 8, SamplingParams(max_tokens=8)) for i in range(32)]
        )
        wall = time.perf_counter() - t
        computed = engine.stats()["prompt_tokens_computed"] - before
    return computed, sum(r.cached_tokens for r in res), wall, [r.token_ids for r in res]


def long_prompt_gaps(path, chunk: int):
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(model=path, device="cpu", max_batch=8, max_model_len=1024, max_prefill_tokens=chunk)
    stamps = [[] for _ in range(4)]
    with launch_engine(cfg) as engine:
        handles = [
            engine.submit(
                GenerationRequest(
                    [3 + i, 9, 10, 11],
                    SamplingParams(max_tokens=48, ignore_eos=True),
                    stream=True,
                    on_token=lambda t, i=i: stamps[i].append(time.perf_counter()),
                )
            )
            for i in range(4)
        ]
        while len(stamps[0]) < 8:
            engine.scheduler.step()
        long_req = engine.submit(
            GenerationRequest([(7 * j) % 4000 + 3 for j in range(768)], SamplingParams(max_tokens=4))
        )
        while not all(h.done() for h in handles) or not long_req.done():
            engine.scheduler.step()
    gaps = np.concatenate([np.diff(s) for s in stamps]) * 1e3
    return gaps.max(), np.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-ep")
    args = ap.parse_args()
    from bench_ep import EP_MODEL
    from checkpoints import build_checkpoint

    path = build_checkpoint("mixtral", args.dir, **EP_MODEL)
    print("A) shared 192-token system prompt, 32 requests, max_batch 8")
    print(f"{'prefix cache':>12} {'prompt tok computed':>20} {'cached tok':>10} {'wall s':>7}")
    rows = {c: shared_prefix(path, c) for c in (False, True)}
    for c, (computed, cached, wall, _) in rows.items():
        print(f"{'on' if c else 'off':>12} {computed:20d} {cached:10d} {wall:7.2f}")
    assert rows[True][3] == rows[False][3], "outputs differ with the prefix cache on"
    print(f"   speed-up {rows[False][2] / rows[True][2]:.2f}x, identical outputs")
    print("B) 4 decoding sequences while a 768-token prompt arrives")
    print(f"{'chunking':>12} {'worst gap ms':>12} {'median gap ms':>13}")
    for chunk in (0, 64):
        worst, median = long_prompt_gaps(path, chunk)
        print(f"{('off' if not chunk else f'{chunk} tok'):>12} {worst:12.1f} {median:13.1f}")


if __name__ == "__main__":
    main()
