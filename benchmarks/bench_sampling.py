"""Sampling cost on the CPU at a real vocabulary size (V = 151936, Qwen3), batch 32, one run:

1. the sampler alone: ms per step of 32 rows (greedy argmax vs ``sample_rows``) on
   Zipf-shaped logits (as language is) and on flat ones (a wide nucleus: the worst case);
   then vLLM's processing (``sample_processed``: penalties, logit_bias, bad words, with
   512-token prompts and 256 generated tokens per row; logprobs) vs plain greedy;
2. decode steps end to end: the benchmark model of bench_decode_cpu.py with the real
   vocabulary, 32 requests greedy vs 32 sampled vs 32 penalized, step time = (t_N - t_1) / (N - 1).

    python benchmarks/bench_sampling.py [--threads 1] [--dir /tmp/eprt-bench-moe-152k]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

from bench_decode_cpu import BENCH_MODEL, THREADS, timed  # sets the BLAS threads before NumPy loads

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpy as np  # noqa: E402

from eprt.api import SamplingParams  # noqa: E402
from eprt.engine.sampling import History, sample_processed, sample_rows  # noqa: E402

PARAMS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T=0.7 top_k=20 top_p=0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
}


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
PROCESSED = {
    "greedy penalties": SamplingParams(**PENALTIES),
    "greedy pen+bias+bad": SamplingParams(
        **PENALTIES, logit_bias=tuple((t, 2.0) for t in range(0, 2000, 20)), bad_words_ids=((11, 12), (13,))
    ),
    "greedy logprobs=5": SamplingParams(logprobs=5),
    "T=0.7 top_p=0.95 pen": SamplingParams(temperature=0.7, top_p=0.95, **PENALTIES),
}


def best_of(fn, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def sampler_table(vocab: int, rows: int) -> None:
    rng = np.random.default_rng(1)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    cases = {
        "zipf": np.stack([rng.permutation(-1.1 * np.log(ranks)) for _ in range(rows)]).astype(np.float32),
        "flat": (rng.standard_normal((rows, vocab)) * 2.0).astype(np.float32),
    }
    uniforms = rng.random(rows)
    print(f"sampler alone: V={vocab}, {rows} rows; ms per step (best of 7)")
    print(f"{'logits':>7} {'params':>26} {'greedy':>8} {'sampled':>8} {'ratio':>6}")
    for name, logits in cases.items():
        greedy = best_of(lambda x=logits: np.argmax(x, axis=1))
        for label, params in PARAMS.items():
            sampled = best_of(lambda x=logits, ps=[params] * rows: sample_rows(x, ps, uniforms))
            print(f"{name:>7} {label:>26} {greedy * 1e3:8.2f} {sampled * 1e3:8.2f} {sampled / greedy:6.1f}")
    histories = [
        History.of(rng.integers(0, vocab, 512)).sync(rng.integers(0, vocab, 256).tolist()) for _ in range(rows)
    ]
    logits = cases["zipf"]
    greedy = best_of(lambda x=logits: np.argmax(x, axis=1))
    for label, params in PROCESSED.items():
        t = best_of(lambda ps=[params] * rows: sample_processed(logits, ps, uniforms, histories, (2,)))
        print(f"{'zipf':>7} {label:>26} {greedy * 1e3:8.2f} {t * 1e3:8.2f} {t / greedy:6.1f}")


def step_times(path: str, rows: int, n: int) -> dict:
    """Decode step seconds of 32 greedy and 32 sampled requests per PARAMS, same engine."""
    from eprt.api import GenerationRequest
    from eprt.engine.engine import EngineConfig, launch_engine

    prompts = np.random.default_rng(0).integers(3, 1000, size=(rows, 16)).tolist()
    cfg = EngineConfig(model=path, device="cpu", max_batch=rows, max_model_len=256, prefix_cache=False)
    modes = {"greedy": SamplingParams(), **PARAMS, "greedy penalties": SamplingParams(**PENALTIES)}
    best = {m: float("inf") for m in modes}
    with launch_engine(cfg) as engine:

        def run(params, k):
            reqs = [
                GenerationRequest(p, SamplingParams(**{**params.__dict__, "max_tokens": k, "ignore_eos": True}))
                for p in prompts
            ]
            engine.generate(reqs)

        run(modes["greedy"], 2)
        for _ in range(3):  # interleaved, best of three: the machine is shared
            for mode, params in modes.items():
                t1, tn = timed(lambda ps=params: run(ps, 1)), timed(lambda ps=params: run(ps, n))
                best[mode] = min(best[mode], (tn - t1) / (n - 1))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe-152k")
    ap.add_argument("--threads", type=int, default=THREADS, help="BLAS threads (default: all cores)")
    args = ap.parse_args()
    sampler_table(args.vocab, args.rows)
    from checkpoints import build_checkpoint

    path = build_checkpoint("qwen3_moe", args.dir, **{**BENCH_MODEL, "vocab_size": args.vocab})
    best = step_times(path, args.rows, args.new_tokens)
    print(f"\ndecode steps: {path}, batch {args.rows}, {args.new_tokens} new tokens; ms per step (best of 3)")
    print(f"{'params':>26} {'step ms':>8} {'vs greedy':>10}")
    for mode, t in best.items():
        print(f"{mode:>26} {t * 1e3:8.1f} {t / best['greedy']:10.2f}")


if __name__ == "__main__":
    main()
